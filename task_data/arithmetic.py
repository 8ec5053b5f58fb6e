"""The embedded default task: short arithmetic word problems generated from a seed.

    "Ann has 23 pens and gets 45 more. How many pens now?"
    answer: "23+45=68\n#### 68"

Problems have 1..max_steps worked steps over + - *; every intermediate value is >= 0.
"""

from __future__ import annotations

import random
from typing import Any

NAMES = ["Ann", "Ben", "Cal", "Dee", "Eva", "Finn", "Gus", "Hana", "Ivy", "Jon"]
ITEMS = ["apples", "pens", "books", "coins", "cards", "eggs", "toys", "shells"]


def _step(rng: random.Random, value: int, ops: str, lo: int, hi: int, item: str) -> tuple[str, str, int]:
    """One more step applied to `value`: (clause, worked line, new value)."""
    op = rng.choice(ops)
    if op == "-" and value < lo:
        op = "+"
    if op == "+":
        b = rng.randint(lo, hi)
        return f"gets {b} more", f"{value}+{b}={value + b}", value + b
    if op == "-":
        b = rng.randint(lo, min(hi, value))
        return f"gives away {b}", f"{value}-{b}={value - b}", value - b
    b = rng.randint(2, 9)
    return f"makes it {b} times as many", f"{value}*{b}={value * b}", value * b


def make_problem(rng: random.Random, ops: str, lo: int, hi: int, max_steps: int) -> dict[str, Any]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(lo, hi)
    clauses, lines = [], []
    for _ in range(rng.randint(1, max_steps)):
        clause, line, value = _step(rng, value, ops, lo, hi, item)
        clauses.append(clause)
        lines.append(line)
    start = lines[0].split("+")[0].split("-")[0].split("*")[0]
    question = f"{name} has {start} {item} and " + ", then ".join(clauses) + f". How many {item} now?"
    answer = "\n".join(lines) + f"\n#### {value}"
    return {"prompt": question, "answer": answer, "meta": {"final": str(value), "steps": len(lines)}}


def generate(seed: int, num_train: int, num_eval: int, ops: str = "+-", lo: int = 10, hi: int = 99, max_steps: int = 1):
    """(train, eval) record lists; held-out questions never appear in the train split."""
    rng = random.Random(seed)
    seen: set[str] = set()
    eval_records: list[dict[str, Any]] = []
    train_records: list[dict[str, Any]] = []
    attempts = 0
    while len(eval_records) < num_eval or len(train_records) < num_train:
        attempts += 1
        if attempts > 50 * (num_train + num_eval):
            raise ValueError("arithmetic task: value range too small for the requested number of distinct problems")
        p = make_problem(rng, ops, lo, hi, max_steps)
        if p["prompt"] in seen:
            continue
        seen.add(p["prompt"])
        if len(eval_records) < num_eval:
            p["prompt_id"] = f"arith-eval-{len(eval_records)}"
            eval_records.append(p)
        else:
            p["prompt_id"] = f"arith-train-{len(train_records)}"
            train_records.append(p)
    return train_records, eval_records
