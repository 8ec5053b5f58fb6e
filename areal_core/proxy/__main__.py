"""`python -m areal_core.proxy --follow SOURCE --api-key <key> [--engine E] [--store URI]`: serve a
policy through the proxy, following a source of versions (online mode: with --store, each ended
session is written there as a shard).

SOURCE (proxy/versions.py): `models:/NAME@ALIAS` (the registry's alias, polled every
--poll-interval-s; moving it back rolls the proxy back), `RUN/weights` (the versions a run's
trainer publishes), or an HF folder (fixed; `--model DIR` is the same). The engine is the one
`rollout.engine` names (`--engine torch|continuous|vllm|sglang`, built by rollout/factory.py from
`--config` and `--set key=value`), and takes each new version as a rollout worker does."""

from __future__ import annotations

import argparse
import os

from fastapi import FastAPI

from areal_core.config import RunConfig, load_config
from areal_core.layout import LAYOUT
from areal_core.logs import setup_logging
from areal_core.proxy.app import create_app
from areal_core.proxy.backpressure import SessionAdmission, admission_bound
from areal_core.proxy.guard import ProxyLimits
from areal_core.proxy.runner import server_config
from areal_core.proxy.versions import Follower, first_version, make_source
from areal_core.store import Store


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m areal_core.proxy", description="Serve a policy through the OpenAI-compatible proxy."
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--follow", help="models:/NAME@ALIAS, RUN/weights, or an HF folder (fixed)")
    src.add_argument("--model", help="HF checkpoint folder or fsspec URI (= --follow DIR)")
    ap.add_argument("--engine", choices=["torch", "continuous", "vllm", "sglang"], help="default: the config's")
    ap.add_argument("--config", default="", help="YAML config files, comma-separated (rollout.*, device)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeat)")
    ap.add_argument("--device", default="", help="cpu, cuda or npu (default: the config's)")
    ap.add_argument("--server-url", default="", help="the vLLM/SGLang server (rollout.server.url)")
    ap.add_argument("--poll-interval-s", type=float, default=5.0, help="seconds between polls of the source")
    ap.add_argument("--tracking-uri", default="", help="the MLflow registry (default: $MLFLOW_TRACKING_URI)")
    ap.add_argument("--staging", default="", help="local folder for the versions served (default: a temporary one)")
    ap.add_argument("--wait-s", type=float, default=600.0, help="how long to wait for the source's first version")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", action="append", default=[], help="accepted key (repeat); or AREAL_PROXY_KEYS")
    ap.add_argument("--store", default="", help="run root: ended sessions are written there as shards")
    ap.add_argument(
        "--max-waiting-rows",
        type=int,
        default=-1,
        help="with --store: no new session (429) while this many of the proxy's rows wait for the trainer;"
        " -1: (η + 1)·B·G from the run root's config, 0: no bound",
    )
    ap.add_argument("--worker-id", default="proxy-0")
    ap.add_argument("--version", type=int, default=0, help="a folder's version (the first MLflow one's number)")
    ap.add_argument("--turn-discount", type=float, default=1.0)
    ap.add_argument("--tool-prompt", default="full", choices=["full", "names", "none"])
    ap.add_argument("--max-context-tokens", type=int, default=0)
    ap.add_argument("--default-max-tokens", type=int, default=256)
    ap.add_argument(
        "--max-images", type=int, default=ProxyLimits.max_images, help="a VLM: image_url parts per chat request"
    )
    ap.add_argument(
        "--max-image-pixels", type=int, default=ProxyLimits.max_image_pixels, help="a VLM: width × height of one image"
    )
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
    ap.add_argument(
        "--max-session-rows",
        type=int,
        default=ProxyLimits.max_session_rows or 0,
        help="rows one session may write (429 session_rows_exceeded above; docs/proxy.md); 0: no cap",
    )
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def engine_config(args: argparse.Namespace) -> RunConfig:
    """The run config the engine is built from: --config, then --set, then the flags."""
    flags = [f"seed={args.seed}"]
    flags += [f"rollout.engine={args.engine}"] if args.engine else []
    flags += [f"device={args.device}"] if args.device else []
    flags += [f"rollout.server.url={args.server_url}"] if args.server_url else []
    return load_config(args.config or None, [*args.set, *flags])


def build_app(args: argparse.Namespace) -> FastAPI:
    """The proxy app of the command line: the engine built by the rollout factory on the source's
    first version, the follower (started with the app) delivering the next ones."""
    import torch

    from areal_core.rollout.factory import build_engine

    if args.threads:
        torch.set_num_threads(args.threads)
    keys = args.api_key + [k for k in os.environ.get("AREAL_PROXY_KEYS", "").split(",") if k]
    if not keys:
        raise SystemExit("give at least one --api-key (or AREAL_PROXY_KEYS)")
    cfg = engine_config(args)
    source = make_source(
        args.follow or args.model, tracking_uri=args.tracking_uri, staging=args.staging, version=args.version
    )
    try:
        version = first_version(source, args.wait_s)
        engine, tokenizer = build_engine(cfg, source.store, version)
    except BaseException:
        source.close()
        raise
    store = Store(args.store) if args.store else None
    return create_app(
        engine,
        tokenizer,
        store=store,
        api_keys=keys,
        limits=ProxyLimits(
            max_context_tokens=args.max_context_tokens or None,
            default_max_tokens=args.default_max_tokens,
            max_images=args.max_images,
            max_image_pixels=args.max_image_pixels,
            reward_min=args.reward_min,
            reward_max=args.reward_max,
            max_key_session_segments=args.max_key_session_segments or None,
            max_key_session_tokens=args.max_key_session_tokens or None,
            max_session_rows=args.max_session_rows or None,
        ),
        worker_id=args.worker_id,
        turn_discount=args.turn_discount,
        tool_prompt=args.tool_prompt,
        follower=Follower(source, engine, args.poll_interval_s, worker_id=args.worker_id),
        admission=session_admission(store, args),
    )


def session_admission(store: Store | None, args: argparse.Namespace) -> SessionAdmission | None:
    """The bound on the proxy's rows waiting for the trainer: --max-waiting-rows, or (η + 1)·B·G of
    the run root's config; None without a store, with 0, or for a store that is no run root."""
    from areal_core.context import load_run_config

    if store is None or args.max_waiting_rows == 0:
        return None
    bound = args.max_waiting_rows
    if bound < 0:
        if not store.exists(LAYOUT.config):
            return None
        cfg = load_run_config(store)
        bound = admission_bound(cfg.train.eta, cfg.train.batch_groups * cfg.rollout.group_size)
    return SessionAdmission(store, args.worker_id, bound, poll_s=min(1.0, args.poll_interval_s))


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    setup_logging()
    uvicorn.Server(server_config(build_app(args), args.host, args.port)).run()


if __name__ == "__main__":
    main()
