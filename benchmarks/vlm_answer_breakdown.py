"""Where a CLEVR-like VLM run's held-out accuracy comes from: one greedy answer per question (the run's
own evaluate pass), broken down two ways.

    PYTHONPATH=. .venv/bin/python benchmarks/vlm_answer_breakdown.py --run runs/vlm_desc1.0 \\
        [--model init_model | final_model] [--split eval | train] [--n 200] [--out breakdown.json]

- **confusion**: reference answer -> how often each answer was given (counting questions: a model
  that reads some colours or counts badly shows it on those rows);
- **worked answers** (`task.describe_fraction`): of the answers that list the grid's cells before
  `####`, the share whose list is exactly the scene's (`task_data.clevr.describe`), the share of cells
  read right, and the share whose final answer follows from the model's own list (the sum of its
  digits for digit_sum, the number of matching cells for counting). A warm start that reads badly
  and reasons right has a low list share and a high "follows" share: its limit is perception.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from typing import Any


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
    from task_data.clevr import describe, final_answer

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
    from task_data.clevr import final_answer

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
    from areal_core.evaluate import heldout_eval
    from benchmarks.vllm_rl import cpu_name, write_result
    from benchmarks.vlm_run import open_vlm_run, vlm_run_parser

    ap = vlm_run_parser(__doc__)
    ap.add_argument("--split", default="eval", choices=["eval", "train"])
    args = ap.parse_args(argv)
    run = open_vlm_run(args, args.split)
    if run.cfg.task.name != "clevr":
        raise SystemExit(f"{args.run} is not a clevr run (task {run.cfg.task.name})")
    _, answers = heldout_eval(run.model, run.tokenizer, run.cfg, run.records, run.cache, keep=len(run.records))
    res = {"cpu": cpu_name(), "run": args.run, "model": args.model, "split": args.split}
    res.update(breakdown(run.records, answers))
    write_result(res, args.out)


if __name__ == "__main__":
    sys.exit(main())
