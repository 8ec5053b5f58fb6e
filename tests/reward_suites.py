"""Test suites for the code-reward cheat matrix: MBPP-style tasks, trivial programs, HumanEval samples.

MBPP_TASKS wrap the program's value in the builtins and library calls that real data sets use
(set, sorted, len, abs, math.isclose, isinstance, all, any, sum, round, str, dict, list, map):
the calls the program could patch when the tests ran inside the sandbox. Each has a canonical
solution and tests that no echo, constant or identity program passes.
"""

from __future__ import annotations

import json

from task_data import code_tasks, humaneval

MBPP_TASKS: list[dict] = [
    {
        "name": "uniq",
        "solution": "def uniq(xs):\n    return list(dict.fromkeys(xs))\n",
        "tests": ["assert set(uniq([1, 2, 2, 3])) == set([1, 2, 3])\nassert sorted(uniq([5, 5, 4])) == [4, 5]"],
    },
    {
        "name": "srt",
        "solution": "def srt(xs):\n    return sorted(xs, reverse=True)\n",
        "tests": ["assert sorted(srt([1, 3, 2])) == [1, 2, 3] and srt([1, 3, 2])[0] == 3"],
    },
    {
        "name": "evens",
        "solution": "def evens(xs):\n    return [x for x in xs if x % 2 == 0]\n",
        "tests": ["assert len(evens([1, 2, 3, 4, 6])) == 3\nassert len(evens([1, 3])) == 0"],
    },
    {
        "name": "half",
        "solution": "def half(x):\n    return x / 2\n",
        "tests": ["assert abs(half(5) - 2.5) < 1e-6\nassert abs(half(-3) + 1.5) < 1e-6"],
    },
    {
        "name": "area",
        "solution": "import math\ndef area(r):\n    return math.pi * r * r\n",
        "tests": [
            "import math\nassert math.isclose(area(2), 12.566370614359172, rel_tol=1e-6)\n"
            "assert math.isclose(area(1), math.pi)"
        ],
    },
    {
        "name": "to_int",
        "solution": "def to_int(s):\n    return int(s)\n",
        "tests": ["assert isinstance(to_int('7'), int) and to_int('7') == 7 and to_int('-12') == -12"],
    },
    {
        "name": "positives",
        "solution": "def positives(xs):\n    return [x for x in xs if x > 0]\n",
        "tests": [
            "assert all(x > 0 for x in positives([-1, 2, -3, 4]))\nassert all([len(positives([-1, 2, -3, 4])) == 2])"
        ],
    },
    {
        "name": "negs",
        "solution": "def negs(xs):\n    return [x < 0 for x in xs]\n",
        "tests": ["assert any(negs([1, -2, 3]))\nassert not any(negs([1, 2]))\nassert negs([-1]) == [True]"],
    },
    {
        "name": "squares",
        "solution": "def squares(n):\n    return [i * i for i in range(1, n + 1)]\n",
        "tests": ["assert sum(squares(3)) == 14\nassert sum(squares(1)) == 1"],
    },
    {
        "name": "avg",
        "solution": "def avg(xs):\n    return sum(xs) / len(xs)\n",
        "tests": ["assert round(avg([1, 2, 2]), 2) == 1.67\nassert round(avg([4, 5]), 1) == 4.5"],
    },
    {
        "name": "rev_num",
        "solution": "def rev_num(n):\n    return int(str(n)[::-1])\n",
        "tests": ["assert str(rev_num(123)) == '321'\nassert str(rev_num(40)) == '4'"],
    },
    {
        "name": "freq",
        "solution": "def freq(s):\n    out = {}\n    for c in s:\n        out[c] = out.get(c, 0) + 1\n    return out\n",
        "tests": ["assert dict(freq('aab')) == {'a': 2, 'b': 1}\nassert dict(freq('z')) == {'z': 1}"],
    },
    {
        "name": "upper_chars",
        "solution": "def upper_chars(s):\n    return [c.upper() for c in s]\n",
        "tests": ["assert list(upper_chars('abc')) == ['A', 'B', 'C']\nassert list(upper_chars('')) == []"],
    },
    {
        "name": "double",
        "solution": "def double(x):\n    return 2 * x\n",
        "tests": ["assert list(map(double, [1, 2, 3])) == [2, 4, 6]\nassert list(map(double, [0, -5])) == [0, -10]"],
    },
]

SHIPPED_FUNCTIONS = sorted(t["name"] for t in code_tasks.TASKS if isinstance(t["tests"][0], str))
HUMANEVAL_SAMPLE = list(humaneval.problems()[::8])  # 21 problems, every eighth
NAMES = sorted(set(SHIPPED_FUNCTIONS) | {t["name"] for t in MBPP_TASKS} | {p["entry_point"] for p in HUMANEVAL_SAMPLE})


def define(body: str, names: list[str] = NAMES) -> str:
    """Every name defined as `def name(*args, **kwargs): <body>`."""
    return "".join(f"def {name}(*args, **kwargs):\n    {body}\n" for name in names)


def adapt(program: str, via: str = SHIPPED_FUNCTIONS[0]) -> str:
    """A program written for the shipped tasks, with every other name delegating to its `via`."""
    extra = [n for n in NAMES if n not in SHIPPED_FUNCTIONS]
    return program + "".join(f"\ndef {n}(*args, **kwargs):\n    return {via}(*args, **kwargs)\n" for n in extra)


def references(limits: dict | None = None, humaneval_too: bool = False) -> list[tuple[str, str]]:
    """(suite/task, reference JSON) for every shipped task, MBPP-style task and (optionally) HumanEval sample."""
    out = []
    for task in code_tasks.TASKS:
        out.append((f"shipped/{task['name']}", {"tests": task["tests"], "parallel": 4}))
    for task in MBPP_TASKS:
        out.append((f"mbpp/{task['name']}", {"tests": task["tests"]}))
    if humaneval_too:
        for problem in HUMANEVAL_SAMPLE:
            out.append((problem["task_id"], humaneval.spec(problem)))
    refs = []
    for name, spec in out:
        if limits:
            spec = {**spec, "limits": dict(limits)}
        refs.append((name, json.dumps(spec)))
    return refs


def completion(program: str) -> str:
    return f"Here is my solution.\n```python\n{program}```\n"
