"""What the VLM benchmark scripts share: their command line (--run, --model, --n, --out) and opening
a finished `model.kind: vlm` run (its config, its held-out or training records, the chosen model and
the run's image cache)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


def vlm_run_parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--model", default="init_model", choices=["init_model", "final_model"])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--out", default="")
    return ap


@dataclass
class VlmRun:
    cfg: Any  # RunConfig
    records: list[dict[str, Any]]
    model: Any
    tokenizer: Any  # the model's VisionProcessor
    cache: Any  # vlm.images.ImageCache over the run's image roots


def open_vlm_run(args: argparse.Namespace, split: str = "eval") -> VlmRun:
    """The run at args.run with args.model loaded and its first args.n `split` records; exits with a
    message when the run is not a VLM run."""
    import torch

    from areal_core.context import load_run_config
    from areal_core.forks import image_roots
    from areal_core.layout import LAYOUT
    from areal_core.models import load_pretrained
    from areal_core.prompts import load_prompts
    from areal_core.store import Store
    from areal_core.vlm.images import ImageCache

    torch.set_num_threads(1)
    store = Store(args.run)
    cfg = load_run_config(store)
    if cfg.model.kind != "vlm":
        raise SystemExit(f"{args.run} is not a VLM run (model.kind {cfg.model.kind})")
    model, tokenizer = load_pretrained(store.url(getattr(LAYOUT, args.model)), cfg.device)
    records = load_prompts(store, split)[: args.n]
    return VlmRun(cfg, records, model, tokenizer, ImageCache(image_roots(store)))
