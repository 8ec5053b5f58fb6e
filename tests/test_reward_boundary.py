"""The call boundary: test code runs verbatim on the host, the program is only ever called.

Nested asserts, helpers and loops are graded; arguments the program changes in place come
back; exceptions come back by name; every limit (per call, per test, on both sides) is a
named failure; a test that cannot run scores 0 with its reason and `code_reward` never raises
for a data-set problem.
"""

from __future__ import annotations

import json
import shutil

import pytest

from areal_core.reward.code import code_reward, program_of, task_spec
from areal_core.reward.grading import run_tests
from areal_core.reward.harness import needed_names
from areal_core.reward.remote import merge
from areal_core.reward.sandbox import Limits, Sandbox
from tests.conftest import baseline_s, scaled

HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap not installed (.ci/run installs it)")
GOOD = "def add(a, b):\n    return a + b\n"


def grade(program: str, tests: list, **spec) -> dict:
    return code_reward(f"```python\n{program}```", json.dumps({"tests": tests, **spec}))


@pytest.fixture(scope="module")
def session_s() -> float:
    """What a session of one passing code test takes here now (sandbox start, load, the test
    process, one call): limits that legitimate work must fit in are scaled by it (issue 46)."""
    if not HAVE_BWRAP:
        pytest.skip("bubblewrap not installed")
    probe = Sandbox(Limits(wall_s=60))
    return baseline_s(lambda: run_tests(probe, GOOD, ["assert add(1, 2) == 3"]))


@pytest.fixture(scope="module")
def sb(session_s):
    return Sandbox(Limits(wall_s=round(scaled(3, session_s), 1), cpu_s=2))


# -- test code runs verbatim on the host ------------------------------------------------------


@pytest.mark.sandbox
@needs_bwrap
def test_asserts_in_loops_helpers_and_check_functions_are_graded():
    tests = [
        "for i in range(10):\n    assert add(i, 1) == i + 1",
        "def helper(x):\n    assert add(x, x) == 2 * x\nhelper(3)\nhelper(-4)",
        "def check(candidate):\n    assert candidate(2, 3) == 5\n"
        "    assert abs(candidate(0.1, 0.2) - 0.3) < 1e-9\ncheck(add)",
        "import math\nassert math.isclose(add(0.5, 0.25), 0.75, rel_tol=1e-9)\n"
        "assert all(map(lambda t: add(*t) == sum(t), [(1, 2), (3, 4)]))",
        "x = add(3, 4)\nassert x == 7\nassert isinstance(x, int) and not isinstance(add(1.0, 1), int)",
    ]
    assert grade(GOOD, tests)["reward"] == 1.0
    out = grade("def add(a, b):\n    return a - b if a > 5 else a + b\n", tests)
    assert out["info"]["passed"] == 4 and "assertion failed: add(i, 1) == i + 1 (got 5)" in out["info"]["failures"]


@pytest.mark.sandbox
@needs_bwrap
def test_setup_runs_on_the_host_and_test_names_shadow_the_programs():
    """The task's helpers (HumanEval's poly, encode_cyclic) are the host's, never the program's;
    a program's `check`, `abs` or `set` never stands in for the test's or the builtins."""
    setup = "def encode(s):\n    return s[::-1]\n"
    tests = ["assert decode(encode('abc')) == 'abc'", "def check(f):\n    assert f('xy') == 'yx'\ncheck(decode)"]
    assert grade("def decode(s):\n    return s[::-1]\n", tests, setup=setup)["reward"] == 1.0
    cheat = (
        "def encode(s):\n    return s\ndef decode(s):\n    return s\ndef check(f):\n    return None\n"
        "def abs(x):\n    return 0\ndef set(*a):\n    return 0\ndef len(x):\n    return 3\n"
    )
    assert grade(cheat, tests, setup=setup)["reward"] == 0.0
    more = [
        "assert abs(len(decode('ab')) - 3) == 0",
        "assert set(decode('ab')) == set('xy')",
        "assert len(decode('ab')) == 3",
    ]
    assert grade(cheat, more)["reward"] == 0.0


@pytest.mark.sandbox
@needs_bwrap
def test_program_values_and_stdlib_modules_cross_as_host_copies():
    program = "import math as m\nimport os\nTABLE = {'a': [1, 2]}\ndef area(r):\n    return m.pi * r * r\n"
    tests = ["assert TABLE == {'a': [1, 2]} and m.isclose(area(1), m.pi)", "assert os"]
    out = grade(program, tests)
    assert out["info"]["passed"] == 1  # `os` is not mirrored: only pure modules of the standard library are
    assert "NameError" in out["info"]["failures"][0]


@pytest.mark.sandbox
@needs_bwrap
def test_arguments_changed_in_place_come_back():
    program = (
        "def fill(xs, d, s, grid, t):\n    xs.append(len(xs))\n    xs[0] = 'first'\n"
        "    d['k'] = [1]\n    del d['gone']\n"
        "    s.add(9)\n    grid[1][0] = 5\n    t[0].append('x')\n    return None\n"
        "def sort_in_place(xs):\n    xs.sort()\n"
    )
    test = (
        "xs, d, s, grid, t = [0, 1], {'gone': 1, 'k': 0}, {1}, [[0], [0]], ([],)\nrow = grid[1]\ninner = t[0]\n"
        "assert fill(xs, d, s, grid=grid, t=t) is None\n"
        "assert xs == ['first', 1, 2] and d == {'k': [1]} and s == {1, 9}\n"
        "assert grid == [[0], [5]] and row is grid[1] and row == [5] and inner == ['x']\n"
        "ys = [3, 1, 2]\nsort_in_place(ys)\nassert ys == [1, 2, 3]"
    )
    assert grade(program, [test])["reward"] == 1.0


def test_merge_keeps_the_hosts_objects_and_refuses_impossible_changes():
    inner = [1]
    target = [inner, {"a": 1}, 3]
    assert merge(target, [[1, 2], {"a": 2}, 4]) and target == [[1, 2], {"a": 2}, 4] and target[0] is inner
    assert not merge([1], (1,)) and not merge(3, 4) and not merge("a", "b") and not merge(frozenset(), frozenset({1}))
    t = ([1], 2)
    assert merge(t, ([1, 5], 99)) and t == ([1, 5], 2)  # only a tuple's mutable parts change


@pytest.mark.sandbox
@needs_bwrap
def test_exceptions_come_back_by_name_and_never_as_control_flow():
    program = (
        "def f(x):\n    if x == 0:\n        raise ValueError('zero')\n    if x == 1:\n        raise StopIteration\n"
        "    if x == 2:\n        raise SystemExit(0)\n    if x == 3:\n        raise KeyError('k')\n    return x\n"
    )
    tests = [
        "try:\n    f(0)\n    raise AssertionError('no error')\nexcept ValueError as e:\n    assert 'zero' in str(e)",
        "try:\n    f(3)\n    assert False\nexcept LookupError:\n    pass",
        "assert all(map(f, [1, 1, 1]))",  # a StopIteration from the program never ends the host's map early
        "assert f(2) == 2",
        "assert f(5) == 5",
    ]
    out = grade(program, tests)
    assert out["info"]["passed"] == 3, out
    assert "the program raised StopIteration" in out["info"]["failures"], out
    assert "the program raised SystemExit: 0" in out["info"]["failures"]


# -- limits -------------------------------------------------------------------------------


@pytest.mark.sandbox
@needs_bwrap
def test_every_limit_is_a_named_failure_and_later_tests_still_run(sb, session_s):
    program = (
        "import os, time\ndef hang():\n    time.sleep(60)\ndef spin():\n    while True:\n        pass\n"
        "def hog():\n    return bytearray(2**33)\ndef die():\n    os._exit(7)\ndef boom():\n    import ctypes\n"
        "    ctypes.string_at(0)\n" + GOOD
    )
    tests = [
        "hang()",
        "assert add(1, 2) == 3",
        "spin()",
        "assert add(2, 2) == 4",
        "hog()",
        "die()",
        "assert add(3, 3) == 6",
        "boom()",
        "while True:\n    pass",  # the host's own test code spinning
        "assert add(0, 0) == 0",
    ]
    # a passing test after a lost session starts a fresh one within the wall clock, and a call
    # (a fresh worker's start included) within call_s: both scaled to this machine now
    call_s = round(scaled(1, session_s), 1)
    limits = Limits(wall_s=2 * call_s, call_s=call_s, cpu_s=1, memory_mb=256)
    report = run_tests(sb, program, tests, limits=limits)
    # no time bound here: the reasons say each limit fired (hang() returns after 60 s and would pass)
    assert [r.ok for r in report.results] == [False, True, False, True, False, False, True, False, False, True]
    reasons = [r.reason for r in report.results]
    assert reasons[0] == f"timeout: hang(...) ran over {call_s:g}s (sandbox killed)"
    assert reasons[2] == f"timeout: spin(...) ran over {call_s:g}s (sandbox killed)" or "cpu time" in reasons[2]
    assert reasons[4].startswith("memory limit"), reasons[4]
    assert reasons[5] == "exit code 7"
    assert reasons[7] == "crashed: killed by SIGSEGV"
    assert "cpu time limit" in reasons[8] or "timeout" in reasons[8], reasons[8]


@pytest.mark.sandbox
@needs_bwrap
def test_a_program_that_cannot_load_fails_every_test_with_one_reason_and_one_wait(sb, monkeypatch):
    spawned: list[str] = []  # one wait is one load: counted as sandbox sessions, not timed
    spawn = sb.spawn
    monkeypatch.setattr(sb, "spawn", lambda mode, *a, **k: spawned.append(mode) or spawn(mode, *a, **k))
    report = run_tests(sb, "import time\ntime.sleep(3600)\n" + GOOD, ["assert add(1, 1) == 2"] * 5)
    wall = f"{sb.limits.wall_s:g}"
    assert {r.reason for r in report.results} == {f"timeout: loading the program ran over {wall}s (sandbox killed)"}
    assert spawned == ["serve"]
    report = run_tests(sb, "raise RuntimeError('no')\n", ["assert f()"] * 3)
    assert {r.reason for r in report.results} == {"exit code 1: RuntimeError: no"}
    assert spawned == ["serve"] * 2


@pytest.mark.sandbox
@needs_bwrap
def test_values_that_cannot_cross_are_named_failures():
    program = (
        "def fn(x):\n    return fn\ndef gen(x):\n    return (i for i in range(x))\n"
        "def big(x):\n    return 'x' * 2**21\n"
        "def obj(x):\n    class C:\n        pass\n    return C()\n"
    )
    out = grade(
        program, ["assert fn(1)", "assert list(gen(3)) == [0, 1, 2]", "assert big(1)", "assert obj(1)", "fn(fn)"]
    )
    assert out["reward"] == 0.0
    failures = " | ".join(out["info"]["failures"])
    assert "fn(...): a function cannot cross" in failures and "a generator cannot cross" in failures
    assert "output over limit" in failures and "an argument of fn(...): a function cannot cross" in failures


# -- data-set problems: scored 0 with the reason, never raised --------------------------------


@pytest.mark.sandbox
@needs_bwrap
@pytest.mark.parametrize(
    "spec, reason",
    [
        ({"tests": ["assert add(1, 2) == 3"], "limits": {"walltime": 1}}, "unknown sandbox limits"),
        ({"tests": ["assert add(1, 2) == 3"], "limits": [1]}, "limits must be an object"),
        ({"tests": ["assert add(1, 2) == 3"], "parallel": "two"}, "parallel must be a positive integer"),
        ({"tests": "assert add(1, 2) == 3"}, "tests must be a list"),
        ({"tests": ["assert add(1, 2) == 3"], "setup": 3}, "setup must be a string"),
    ],
)
def test_a_malformed_spec_scores_zero_with_the_reason(spec, reason):
    out = code_reward(f"```python\n{GOOD}```", json.dumps(spec))
    assert out["reward"] == 0.0 and reason in out["info"]["error"]


@pytest.mark.sandbox
@needs_bwrap
def test_tests_that_cannot_run_score_zero_with_the_reason():
    tests = ["assert add(1, 2) == 3", "assert add(1,", {"bogus": 1}, 42, {"stdin": 3}, "assert nope(1)", "import numpy"]
    out = grade(GOOD, tests)
    assert out["info"]["passed"] == 1 and out["info"]["total"] == 7
    failures = " | ".join(out["info"]["failures"] + grade(GOOD, tests[-2:])["info"]["failures"])
    assert "the test does not compile: SyntaxError" in failures
    assert "a test is code or a {'stdin', 'stdout'} pair of strings" in failures
    assert "NameError: name 'nope' is not defined" in failures and "ModuleNotFoundError" in failures


# -- pieces without a sandbox -------------------------------------------------------------


def test_the_names_a_test_needs_exclude_its_own_bindings_and_the_builtins():
    import ast

    test = (
        "import math\nfrom random import randint as ri\nMETA = 1\ndef check(candidate):\n    x = candidate(1)\n"
        "    assert abs(x) == poly(x) and helper(ri(1, 2))\nfor i in range(3):\n    y = i\n"
        "check(solve)\nglobal_g = solve2"
    )
    assert needed_names([ast.parse(test)]) == {"poly", "helper", "candidate", "x", "solve", "solve2"}


def test_program_of_prefix_continuation_and_restated_function():
    spec = {"prefix": "import math\n\ndef f(x):\n    '''doc'''\n", "entry_point": "f"}
    continued = program_of("    return x + 1\n\ndef unrelated():\n    pass\n", spec)
    assert continued.startswith(spec["prefix"] + "    return x + 1\n") and "unrelated" not in continued
    restated = program_of("Here:\n```python\ndef f(x):\n    return math.floor(x)\n```", spec)
    assert restated.startswith("import math") and restated.rstrip().endswith("return math.floor(x)")
    assert program_of("```python\ndef g():\n    pass\n```", {}) == "def g():\n    pass"
    assert task_spec("", {"tests": ["x"]})["tests"] == ["x"]
