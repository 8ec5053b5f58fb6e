"""`python -m areal_core.proxy --model <hf dir> --api-key <key> [--store URI]`: serve an HF checkpoint
through the proxy (online mode: with --store, each ended session is written there as a shard)."""

from __future__ import annotations

import argparse
import os

from areal_core.logs import setup_logging
from areal_core.proxy.app import create_app
from areal_core.proxy.guard import ProxyLimits
from areal_core.proxy.runner import server_config


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m areal_core.proxy", description="Serve a policy through the OpenAI-compatible proxy."
    )
    ap.add_argument("--model", required=True, help="HF checkpoint folder or fsspec URI")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", action="append", default=[], help="accepted key (repeat); or AREAL_PROXY_KEYS")
    ap.add_argument("--store", default="", help="run root: ended sessions are written there as shards")
    ap.add_argument("--worker-id", default="proxy-0")
    ap.add_argument("--version", type=int, default=0, help="policy version recorded for served tokens")
    ap.add_argument("--turn-discount", type=float, default=1.0)
    ap.add_argument("--tool-prompt", default="full", choices=["full", "names", "none"])
    ap.add_argument("--max-context-tokens", type=int, default=0)
    ap.add_argument("--default-max-tokens", type=int, default=256)
    ap.add_argument("--reward-min", type=float, default=-10.0, help="rewards outside [min, max] are a 422")
    ap.add_argument("--reward-max", type=float, default=10.0)
    ap.add_argument(
        "--max-key-session-segments",
        type=int,
        default=ProxyLimits.max_key_session_segments,
        help="a key's implicit session is ended (rows written) at this many segments; 0: no cap",
    )
    ap.add_argument(
        "--max-key-session-tokens",
        type=int,
        default=ProxyLimits.max_key_session_tokens,
        help="... or at this many tokens; 0: no cap",
    )
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    setup_logging()

    import torch
    import uvicorn

    from areal_core.models import load_pretrained
    from areal_core.rollout.torch_engine import TorchEngine
    from areal_core.store import Store

    if args.threads:
        torch.set_num_threads(args.threads)
    keys = args.api_key + [k for k in os.environ.get("AREAL_PROXY_KEYS", "").split(",") if k]
    if not keys:
        raise SystemExit("give at least one --api-key (or AREAL_PROXY_KEYS)")
    model, tokenizer = load_pretrained(args.model)
    engine = TorchEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, args.version, seed=args.seed)
    app = create_app(
        engine,
        tokenizer,
        store=Store(args.store) if args.store else None,
        api_keys=keys,
        limits=ProxyLimits(
            max_context_tokens=args.max_context_tokens or None,
            default_max_tokens=args.default_max_tokens,
            reward_min=args.reward_min,
            reward_max=args.reward_max,
            max_key_session_segments=args.max_key_session_segments or None,
            max_key_session_tokens=args.max_key_session_tokens or None,
        ),
        worker_id=args.worker_id,
        turn_discount=args.turn_discount,
        tool_prompt=args.tool_prompt,
    )
    uvicorn.Server(server_config(app, args.host, args.port)).run()


if __name__ == "__main__":
    main()
