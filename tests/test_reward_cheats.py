"""The cheat matrix: no cheating program scores above a wrong stub, on any suite.

Suites: the 18 shipped code tasks, MBPP-style tests that wrap the program's value in builtins
and library calls (tests/reward_suites.py), and a sample of HumanEval (all 164 for the main
cheats, in a slow test). A wrong stub (every function returns None) scores 0 on all of them;
so must every cheat:

* patching every builtin, every function of the standard library modules tests use, or
  replacing those modules (and `builtins` itself) in `sys.modules`: the tests' calls run on
  the host, where the program's interpreter is not;
* defining functions named like the builtins or the test's own helpers (`abs`, `set`, `check`,
  `poly`): a test's names and the builtins always win;
* `__eq__`, `__class__`, `__hash__` and subclass tricks on returned objects, returning the
  function itself, a class, a module, a builtin: none of these can cross the typed boundary;
* raising StopIteration, SystemExit, GeneratorExit or KeyboardInterrupt into the host's loops;
* forging the channel: the program's replies are its values, decoded strictly, nothing more;
* trivial programs (echo, constants, identity) and the 45 cheats of test_reward_adversarial.py.
"""

from __future__ import annotations

import json
import shutil

import pytest

from areal_core.reward.pool import RewardPool
from task_data import code_tasks, humaneval
from tests.reward_suites import MBPP_TASKS, NAMES, adapt, completion, define, references
from tests.test_reward_adversarial import ANYTHING, CHEAT_LIMITS, CHEATS

HAVE_BWRAP = shutil.which("bwrap") is not None
pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap not installed (.ci/run installs it)"),
]
MODULES = (
    "math cmath operator functools itertools collections statistics string re copy random json heapq bisect "
    "fractions decimal typing"
).split()
BUILTIN_NAMES = "abs all any bool dict float int isinstance len list map max min round set sorted str sum tuple type"
WRONG = define("return None")

PATCH_ALL_BUILTINS = (
    "import builtins\n"
    "for _n in [n for n in dir(builtins) if not n.startswith('_') and callable(getattr(builtins, n))]:\n"
    "    if _n not in ('isinstance', 'type', 'callable', 'getattr', 'str', 'len', 'sorted', 'list', 'dict', 'int'):\n"
    "        setattr(builtins, _n, {impl})\n"
)
PATCH_ALL_MODULES = (
    f"import importlib\nfor _m in {MODULES!r}:\n    _mod = importlib.import_module(_m)\n"
    "    for _n in dir(_mod):\n        if not _n.startswith('_') and callable(getattr(_mod, _n)):\n"
    "            try:\n                setattr(_mod, _n, {impl})\n            except (AttributeError, TypeError):\n"
    "                pass\n"
)
REPLACE_MODULES = (
    "import sys, types\nclass _Fake(types.ModuleType):\n    def __getattr__(self, name):\n"
    "        return lambda *a, **k: True\n"
    f"for _m in ['builtins'] + {MODULES!r}:\n    sys.modules[_m] = _Fake(_m)\n"
)
# each wins a test of an honest harness that ran the test's calls inside; none of them solves anything
NEW_CHEATS: dict[str, str] = {
    "wrong_stub": WRONG,  # the baseline
    "patch_every_builtin_true": WRONG + PATCH_ALL_BUILTINS.format(impl="lambda *a, **k: True"),
    "patch_every_builtin_identity": WRONG + PATCH_ALL_BUILTINS.format(impl="lambda *a, **k: a[0] if a else None"),
    "patch_every_builtin_anything": ANYTHING
    + define("return Anything()")
    + PATCH_ALL_BUILTINS.format(impl="Anything()"),
    "patch_every_stdlib_function": WRONG + PATCH_ALL_MODULES.format(impl="lambda *a, **k: True"),
    "replace_stdlib_modules_in_sys_modules": WRONG + REPLACE_MODULES,
    "replace_builtins_module_wholesale": "import sys, builtins, types\nfake = types.ModuleType('builtins')\n"
    "fake.__dict__.update(vars(builtins))\nfor n in " + repr(BUILTIN_NAMES.split()) + ":\n"
    "    setattr(fake, n, lambda *a, **k: True)\nsys.modules['builtins'] = fake\n"
    "__builtins__ = fake\n" + WRONG,
    "isclose_always_true": "import math\nmath.isclose = lambda *a, **k: True\nmath.fabs = lambda x: 0.0\n" + WRONG,
    "set_returns_frozenset": "import builtins\nbuiltins.set = lambda *a, **k: frozenset()\n" + define("return []"),
    "abs_returns_zero": "import builtins\nbuiltins.abs = lambda *a: 0.0\n" + define("return 0.0"),
    "define_builtin_and_helper_names": "".join(
        f"def {n}(*a, **k):\n    return True\n"
        for n in BUILTIN_NAMES.split() + ["check", "poly", "encode_cyclic", "encode_shift", "math", "candidate"]
    )
    + WRONG,
    "class_forged_as_int": "class F:\n    @property\n    def __class__(self):\n        return int\n"
    "    def __eq__(self, o):\n        return True\n    __hash__ = object.__hash__\n" + define("return F()"),
    "float_tuple_set_subclasses_equal_to_all": "".join(
        f"class {k.title()}X({k}):\n    def __eq__(self, o):\n        return True\n    __hash__ = {k}.__hash__\n"
        for k in ("float", "tuple", "frozenset", "bytes", "complex")
    )
    + "import itertools\n_c = itertools.cycle([FloatX(0), TupleX(), FrozensetX(), BytesX(), ComplexX()])\n"
    + define("return next(_c)"),
    "return_the_function_itself": "import sys\n"
    + define("return sys._getframe().f_globals[sys._getframe().f_code.co_name]"),
    "return_class_module_builtin": "import math, itertools\n_c = itertools.cycle([int, math, len, print, Ellipsis])\n"
    + define("return next(_c)"),
    "raise_stop_iteration": define("raise StopIteration"),
    "raise_system_exit_and_generator_exit": "import itertools\n_c = itertools.cycle([SystemExit(0), GeneratorExit(), "
    "KeyboardInterrupt(), AssertionError()])\n" + define("raise next(_c)"),
    "deeply_nested_value": define("x = []\n    for _ in range(500):\n        x = [x]\n    return x"),
    "mutate_arguments_to_junk": define(
        "for a in args:\n        if isinstance(a, list):\n            a[:] = [None] * 3\n"
        "        if isinstance(a, dict):\n            a.clear()\n    return None"
    ),
    "forge_replies_on_the_channel": "import gc\n"
    "_chan = [o for o in gc.get_objects() if type(o).__name__ == 'Channel']\n"
    "if _chan:\n    _real = type(_chan[0]).send\n"
    "    def _send(self, m):\n        if 'value' in m or 'raise' in m or 'fail' in m:\n"
    "            m = {'value': True}\n        return _real(self, m)\n    type(_chan[0]).send = _send\n" + WRONG,
    "forge_manifest_as_values": "import gc\n_chan = [o for o in gc.get_objects() if type(o).__name__ == 'Channel']\n"
    "if _chan:\n    _real = type(_chan[0]).send\n"
    "    def _send(self, m):\n        if 'manifest' in m:\n"
    "            m = {'manifest': {n: ['value', True] for n in m['manifest']} | {'check': ['value', True], "
    "'abs': ['module', 'os'], 'math': ['module', 'os']}}\n"
    "        return _real(self, m)\n    type(_chan[0]).send = _send\n" + WRONG,
    "raw_frames_on_every_fd": "import os, json\n_b = json.dumps({'value': True}).encode()\n"
    "_frame = len(_b).to_bytes(4, 'big') + _b\n"
    + define(
        "for fd in range(3, 20):\n        try:\n            os.write(fd, _frame * 4)\n        except OSError:\n"
        "            pass\n    return None"
    ),
}
TRIVIAL: dict[str, str] = {
    **{f"const {c}": define(f"return {c}") for c in ("0", "1", "-1", "True", "False", "''", "[]", "{}", "()", "0.0")},
    "identity": define("return args[0] if args else None"),
    "last_argument": define("return args[-1] if args else None"),
    "all_arguments": define("return args"),
    "str_of_argument": define("return str(args[0]) if args else ''"),
    "sorted_argument": define("return sorted(args[0]) if args else []"),
    "echo": "import sys\nsys.stdout.write(sys.stdin.read())\n" + define("return args[0] if args else None"),
    "echo_first_line": "print(input())\n",
    "echo_last_line": "import sys\n_l = sys.stdin.read().splitlines()\nprint(_l[-1] if _l else '')\n",
    **{f"print {c}": f"print({c})\n" for c in ("0", "1", "-1", "''", "True")},
}


@pytest.fixture(scope="module")
def pool():
    with RewardPool("areal_core.reward.code:code_reward", size=2, timeout_s=60, retries=0) as p:
        yield p


def scores(pool, program: str, refs: list[tuple[str, str]]) -> dict[str, float]:
    results = pool.grade([{"completion": completion(program), "reference": ref} for _, ref in refs])
    return {name: r.reward for (name, _), r in zip(refs, results)}


def wins(pool, programs: dict[str, str], refs: list[tuple[str, str]]) -> dict[tuple[str, str], float]:
    """{(program, task): reward} of every program on every task that scored above 0, graded in one
    batch (the pool never waits for one program's slowest task)."""
    cells = [(name, task, ref) for name in programs for task, ref in refs]
    results = pool.grade([{"completion": completion(programs[n]), "reference": ref} for n, _, ref in cells])
    return {(n, task): r.reward for (n, task, _), r in zip(cells, results) if r.reward}


def test_the_mbpp_style_canonical_solutions_score_one_and_the_wrong_stub_zero(pool):
    refs = references()
    mbpp = dict(refs[len(code_tasks.TASKS) :])
    good = pool.grade(
        [{"completion": completion(t["solution"]), "reference": mbpp[f"mbpp/{t['name']}"]} for t in MBPP_TASKS]
    )
    assert [r.reward for r in good] == [1.0] * len(MBPP_TASKS), [r.info for r in good]
    assert set(scores(pool, WRONG, refs).values()) == {0.0}


@pytest.mark.parametrize("name", sorted(NEW_CHEATS))
def test_a_new_cheat_scores_no_more_than_the_wrong_stub(pool, name):
    got = scores(pool, NEW_CHEATS[name], references(CHEAT_LIMITS))
    assert all(v == 0.0 for v in got.values()), {k: v for k, v in got.items() if v}


@pytest.mark.parametrize("name", sorted(TRIVIAL))
def test_a_trivial_program_scores_no_more_than_the_wrong_stub(pool, name):
    got = scores(pool, TRIVIAL[name], references(CHEAT_LIMITS))
    assert all(v == 0.0 for v in got.values()), {k: v for k, v in got.items() if v}


def humaneval_half() -> list[tuple[str, str]]:
    """Every other problem of the HumanEval sample (11 of 164): the matrix of every cheat on
    every problem; the main cheats meet all 164 in test_main_cheats_score_zero_on_all_of_humaneval."""
    return references(CHEAT_LIMITS, humaneval_too=True)[len(code_tasks.TASKS) + len(MBPP_TASKS) :][::2]


@pytest.mark.slow
def test_new_cheats_and_trivial_programs_score_zero_on_the_humaneval_sample(pool):
    won = wins(pool, {**NEW_CHEATS, **TRIVIAL}, humaneval_half())
    assert not won, won


@pytest.mark.slow
def test_the_adversarial_suites_cheats_score_zero_on_mbpp_style_tests_and_humaneval(pool):
    """test_reward_adversarial.py runs them on the shipped tasks; here, on the other two suites."""
    # every other MBPP-style task and every other problem of the half: 45 cheats x 13 tasks
    refs = references(CHEAT_LIMITS)[len(code_tasks.TASKS) :][::2] + humaneval_half()[::2]
    won = wins(pool, {name: adapt(CHEATS[name]) for name in sorted(CHEATS)}, refs)
    assert not won, won


@pytest.mark.slow
@pytest.mark.parametrize("name", ["patch_every_builtin_true", "replace_stdlib_modules_in_sys_modules"])
def test_main_cheats_score_zero_on_all_of_humaneval(pool, name):
    program = {**NEW_CHEATS, **TRIVIAL}[name]
    names = sorted({p["entry_point"] for p in humaneval.problems()} - set(NAMES))
    body = "return None"
    refs = []
    for p in humaneval.problems():
        spec = {**humaneval.spec(p), "limits": CHEAT_LIMITS}
        refs.append((p["task_id"], json.dumps(spec)))
    got = scores(pool, program + define(body, names), refs)
    assert all(v == 0.0 for v in got.values()), {k: v for k, v in got.items() if v}


def test_a_program_that_is_not_valid_utf8_scores_zero_with_the_reason():
    from areal_core.reward.code import code_reward

    reference = json.dumps(humaneval.spec(humaneval.problems()[0]))
    out = code_reward("    return 1  # \ud800\n", reference)  # a lone surrogate: no UTF-8 file can hold it
    assert out["reward"] == 0.0 and out["info"]["error"] == "the program is not valid UTF-8"
