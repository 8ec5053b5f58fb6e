"""Writes the example tables of docs/data.md (small, made up, in the layouts users have):

gsm8k_hub/main/{train,test}-00000-of-00001.parquet   GSM8K as the Hugging Face hub stores it
math/{train,test}.jsonl                                MATH-style: problem, solution, answer
words/data.jsonl                                       a custom task: prompt, reference (one file)

PYTHONPATH=. .venv/bin/python -m examples.own_data.make_files
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent


def gsm8k_rows() -> list[dict]:
    return [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
            "answer": f"{a} + {b} = {a + b}\n#### {a + b}",
        }
        for a in range(1, 10)
        for b in range(1, 10)
    ]


def math_rows() -> list[dict]:
    rows = []
    for a in range(1, 10):
        for b in range(2, 7):
            rows.append(
                {
                    "problem": f"Simplify $\\frac{{{a}\\pi}}{{{b}}} + \\frac{{{a}\\pi}}{{{b}}}$.",
                    "solution": (
                        f"The sum is $\\frac{{2 \\cdot {a}\\pi}}{{{b}}} = \\boxed{{\\frac{{{2 * a}\\pi}}{{{b}}}}}$."
                    ),
                    "answer": f"\\frac{{{2 * a}\\pi}}{{{b}}}",
                    "level": "Level 1",
                    "type": "Prealgebra",
                }
            )
    return rows


def word_rows() -> list[dict]:
    words = ["apple", "river", "stone", "cloud", "ember", "maple", "otter", "prism", "quill", "sable"]
    return [{"prompt": f"Repeat the word '{w}' once.", "reference": w} for w in words * 8]


def main() -> None:
    hub = HERE / "gsm8k_hub" / "main"
    hub.mkdir(parents=True, exist_ok=True)
    rows = gsm8k_rows()
    pq.write_table(pa.Table.from_pylist(rows[:64]), hub / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[64:]), hub / "test-00000-of-00001.parquet")
    (HERE / "math").mkdir(exist_ok=True)
    m = math_rows()
    (HERE / "math" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in m[:36]))
    (HERE / "math" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in m[36:]))
    (HERE / "words").mkdir(exist_ok=True)
    (HERE / "words" / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in word_rows()))


if __name__ == "__main__":
    main()
