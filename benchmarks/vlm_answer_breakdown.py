"""Where a CLEVR-like VLM run's held-out accuracy comes from: one greedy answer per question (the run's
own evaluate pass), broken down two ways.

    PYTHONPATH=. .venv/bin/python benchmarks/vlm_answer_breakdown.py --run runs/vlm_desc1.0 \\
        [--model init_model | final_model] [--split eval | train] [--n 200] [--out breakdown.json]

- **confusion**: reference answer -> how often each answer was given (counting questions: a model
  that reads some colours or counts badly shows it on those rows);
- **worked answers** (`task.describe_fraction`): of the answers that list the grid's cells before
  `####`, the share whose list is exactly the scene's (`datasets.clevr.describe`), the share of cells
  read right, and the share whose final answer follows from the model's own list (the sum of its
  digits for digit_sum, the number of matching cells for counting). A warm start that reads badly
  and reasons right has a low list share and a high "follows" share: its limit is perception.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from typing import Any

import torch


def follows(scene: dict[str, Any], question: str, cells: list[str]) -> str | None:
    """The final answer the listed `cells` imply for `question` about `scene` (None: not a counting
    or digit-sum scene): the sum of the listed digits, or how many listed cells have the asked colour
    or shape (`scene["target"]`, the word the question names)."""
    if scene.get("qtype") == "digit_sum":
        return str(sum(int(c) for c in cells if c.isdigit()))
    target = scene.get("target")
    if target is None or target not in question.lower().replace("circles", "circle").replace("squares", "square"):
        return None
    return str(sum(target in c.split() for c in cells))


def worked_row(scene: dict[str, Any], question: str, answer: str) -> dict[str, Any] | None:
    """One worked answer `cells #### final` against its scene: list_exact, cells_right (of the
    scene's), follows (the final answer is what the model's own list implies). None: no list."""
    from datasets.clevr import describe, final_answer

    listed, sep, _ = answer.partition("####")
    if not sep or not listed.strip():
        return None
    cells = [c.strip() for c in listed.strip().rstrip(",").split(",")]
    want = [c.strip() for c in describe(scene).split(",")]
    implied = follows(scene, question, cells)
    return {
        "list_exact": cells == want,
        "cells_right": sum(a == b for a, b in zip(cells, want)),
        "cells": len(want),
        "follows": implied is not None and final_answer(answer) == implied,
    }


def breakdown(records: list[dict[str, Any]], answers: list[dict[str, Any]]) -> dict[str, Any]:
    """records (prompt records with meta.scene) and their `evaluate.answer_record`s -> the two tables."""
    from datasets.clevr import final_answer

    confusion: dict[str, Counter] = defaultdict(Counter)
    worked = []
    for rec, ans in zip(records, answers):
        confusion[final_answer(ans["reference"]) or "?"][final_answer(ans["answer"]) or "none"] += 1
        row = worked_row(rec["meta"]["scene"], rec["prompt"], ans["answer"])
        if row is not None:
            worked.append(row)
    n = len(answers)
    out: dict[str, Any] = {
        "n": n,
        "accuracy": round(sum(bool(a["correct"]) for a in answers) / max(n, 1), 3),
        "confusion": {ref: dict(sorted(c.items())) for ref, c in sorted(confusion.items())},
        "worked": len(worked),
    }
    if worked:
        out["worked_list_exact"] = round(sum(r["list_exact"] for r in worked) / len(worked), 3)
        out["worked_cells_right"] = round(sum(r["cells_right"] for r in worked) / sum(r["cells"] for r in worked), 3)
        out["worked_follows_own_list"] = round(sum(r["follows"] for r in worked) / len(worked), 3)
    return out


def main(argv: list[str] | None = None) -> None:
    from areal_core.context import load_run_config
    from areal_core.dataset import image_roots
    from areal_core.evaluate import heldout_eval
    from areal_core.layout import LAYOUT
    from areal_core.models import load_pretrained
    from areal_core.prompts import load_prompts
    from areal_core.store import Store
    from areal_core.vlm.images import ImageCache
    from benchmarks.vllm_rl import cpu_name, write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--model", default="init_model", choices=["init_model", "final_model"])
    ap.add_argument("--split", default="eval", choices=["eval", "train"])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    store = Store(args.run)
    cfg = load_run_config(store)
    if cfg.model.kind != "vlm" or cfg.task.name != "clevr":
        raise SystemExit(f"{args.run} is not a clevr VLM run (model.kind {cfg.model.kind}, task {cfg.task.name})")
    records = load_prompts(store, args.split)[: args.n]
    model, tokenizer = load_pretrained(store.url(getattr(LAYOUT, args.model)), cfg.device)
    _, answers = heldout_eval(model, tokenizer, cfg, records, ImageCache(image_roots(store)), keep=len(records))
    res = {"cpu": cpu_name(), "run": args.run, "model": args.model, "split": args.split}
    res.update(breakdown(records, answers))
    write_result(res, args.out)


if __name__ == "__main__":
    sys.exit(main())
