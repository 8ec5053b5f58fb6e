"""verl's GSM8K, as its `examples/data_preprocess/gsm8k.py` writes it and its
`verl/utils/reward_score/gsm8k.py` grades it, unchanged.

    python -m examples.coming_from.verl_gsm8k OUT_DIR      # writes OUT_DIR/train.parquet, test.parquet

Train with `task.name=dataset task.path=OUT_DIR task.reference_field=reward_model.ground_truth
reward.function=examples.coming_from.verl_gsm8k:compute_score`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_SOLUTION_CLIP_CHARS = 300


def extract_solution(solution_str: str) -> str:
    """verl's preprocessing: the final answer after '#### ' in a GSM8K solution."""
    solution = re.search("#### (\\-?[0-9\\.\\,]+)", solution_str)
    assert solution is not None
    return solution.group(0).split("#### ")[1].replace(",", "")


def make_map_fn(split: str):
    def process_fn(example: dict[str, Any], idx: int) -> dict[str, Any]:
        question_raw = example.pop("question")
        question = question_raw + " " + INSTRUCTION
        answer_raw = example.pop("answer")
        solution = extract_solution(answer_raw)
        return {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": idx, "answer": answer_raw, "question": question_raw},
        }

    return process_fn


def write(out_dir: str | Path, train: list[dict[str, str]], test: list[dict[str, str]]) -> Path:
    """GSM8K rows ({question, answer}) as verl's preprocessing writes them: `to_parquet` per split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train), ("test", test)):
        fn = make_map_fn(split)
        pq.write_table(pa.Table.from_pylist([fn(dict(r), i) for i, r in enumerate(rows)]), out / f"{split}.parquet")
    return out


def _extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """verl's `gsm8k.extract_solution` of a model's completion."""
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
        return solutions[-1].replace(",", "").replace("$", "") if solutions else None
    answer = re.findall("(\\-?[0-9\\.\\,]+)", solution_str)
    for final_answer in reversed(answer):
        if final_answer not in ("", "."):
            return final_answer
    return None


def gsm8k_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                score: float = 1.0) -> float:  # fmt: skip
    """verl's `gsm8k.compute_score`."""
    answer = _extract_answer(solution_str=solution_str, method=method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """A verl custom reward function (`custom_reward_function.path/name`), as verl's
    `default_compute_score` dispatches on `data_source`."""
    if data_source in ("openai/gsm8k",):
        return gsm8k_score(solution_str, ground_truth)
    raise NotImplementedError(f"Reward function is not implemented for {data_source=}")


def compute_score_with_info(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> dict[str, Any]:
    """verl's dict form: "score" is the reward, the other keys are logged. Here a length bonus
    makes the reward vary on a tiny random model, and `index` shows extra_info arrived."""
    acc = gsm8k_score(solution_str, ground_truth)
    return {"score": acc + len(solution_str) / 100, "acc": acc, "index": (extra_info or {}).get("index", -1)}


def sums() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """GSM8K-shaped rows (a worked answer ending '#### N') of one-digit sums: 60 train, 21 test."""
    rows = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a in range(9)
            for b in range(9)]  # fmt: skip
    return rows[:60], rows[60:]


if __name__ == "__main__":
    print(write(sys.argv[1], *sums()))
