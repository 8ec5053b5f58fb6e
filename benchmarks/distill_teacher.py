"""A teacher for on-policy distillation on the default job: a larger tiny model trained longer.

    PYTHONPATH=. .venv/bin/python benchmarks/distill_teacher.py [--root runs/distill-teacher] [--eval 500]
        [overrides...]

The teacher is SFT only, from configs/default.yaml with a model 1.5× as wide (hidden 192,
intermediate 576), 800 SFT steps instead of 220, and two-step problems at their natural share
of the demonstrations (`sft.multi_step_fraction=0.5`; the student's SFT keeps 0.05). Its tokenizer
is trained on the same task text, so it is the student's (the trainer refuses a teacher with
another). Prints its held-out greedy accuracy and the `algo.distill.teacher_path` to pass to
`configs/algorithms/distill.yaml`, e.g.

    PYTHONPATH=. .venv/bin/python benchmarks/algorithm_matrix.py --steps 200 --eval 500 --algos distill \\
        --etas 2 --extra --root runs/bench-algos-27-distill algo.distill.teacher_path=<printed>
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from areal_core.layout import LAYOUT
from areal_core.logs import setup_logging
from areal_core.run import pipeline
from areal_core.store import Store
from benchmarks.algorithm_matrix import accuracy

TEACHER = [
    "model.hidden_size=192",
    "model.intermediate_size=576",
    "sft.steps=800",
    "sft.multi_step_fraction=0.5",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="runs/distill-teacher")
    parser.add_argument("--eval", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    setup_logging()
    overrides = [
        f"seed={args.seed}",
        f"eval.num_samples={args.eval}",
        "tracking.enabled=false",
        *TEACHER,
        *args.overrides,
        f"store={args.root}",
    ]
    uri, _ = pipeline.prepare("configs/default.yaml", overrides)
    t0 = time.time()
    pipeline.sft(uri)
    sft_s = time.time() - t0
    store = Store(uri)
    result = {
        "teacher_path": store.url(LAYOUT.init_model),
        "sft_s": sft_s,
        "heldout": accuracy(store, LAYOUT.init_model, args.eval),
        "overrides": overrides,
    }
    Path(args.root, "teacher.json").write_text(json.dumps(result, indent=2))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
