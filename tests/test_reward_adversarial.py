"""Code rewards cannot be gamed: cheating programs score 0 on every shipped code task.

Each cheat solves nothing. It attacks the way a test harness decides "pass": it neuters
builtins or the interpreter, forges return values (`__eq__` that is always true, subclasses
of int/str/list, values that are not plain), prints pass-like tokens or many candidate
answers, leaves early with a zero exit, reads whatever the sandbox holds (its files, /proc,
stdin, the caller's frame, the heap) for the expected values, writes into the runner's
channels, or exhausts a limit. Every shipped task's canonical solution still scores 1.

The tests run on the host and the program is only called, across a typed boundary (see
`areal_core.reward.boundary`), so the only way to pass is to return the right values; none of
these does. tests/test_reward_cheats.py runs these and more on MBPP-style tests and HumanEval.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from areal_core.reward import codec
from areal_core.reward.code import code_reward
from areal_core.reward.grading import run_tests
from areal_core.reward.sandbox import Limits, Sandbox
from task_data import code_tasks

HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap not installed (.ci/run installs it)")
FUNCTIONS = sorted(t["name"] for t in code_tasks.TASKS if isinstance(t["tests"][0], str))  # the name is the function's
# cheats get tight limits so that the ones that hang cost little; a timeout scores 0 anyway
CHEAT_LIMITS = {"wall_s": 1, "cpu_s": 1, "memory_mb": 256, "fsize_mb": 4}

# An object equal to everything: the classic way to pass `assert f(x) == expected`.
ANYTHING = """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return True
    __le__ = __gt__ = __ge__ = __lt__
    def __bool__(self): return True
    def __len__(self): return 100
    def __hash__(self): return 0
    def __contains__(self, item): return True
    def __getitem__(self, key): return self
    def __getattr__(self, name): return lambda *a, **k: self
    def __iter__(self): return iter(())
    def __call__(self, *a, **k): return self
    def __repr__(self): return "True"
"""


def define(body: str) -> str:
    """Every shipped function name defined as `def name(*args, **kwargs): <body>`."""
    return "".join(f"def {name}(*args, **kwargs):\n    {body}\n" for name in FUNCTIONS)


ALL_ANYTHING = ANYTHING + define("return Anything()")

# name -> program (the whole completion's code). Each must score 0 on every task.
CHEATS: dict[str, str] = {
    "eq_always_true": ALL_ANYTHING,
    "int_subclass_equal_to_all": "class I(int):\n    def __eq__(self, o): return True\n    __hash__ = int.__hash__\n"
    + define("return I(0)"),
    "str_subclass_equal_to_all": "class S(str):\n    def __eq__(self, o): return True\n    __hash__ = str.__hash__\n"
    + define("return S('x')"),
    "list_subclass_equal_to_all": "class L(list):\n    def __eq__(self, o): return True\n" + define("return L()"),
    "dict_subclass_equal_to_all": "class D(dict):\n    def __eq__(self, o): return True\n" + define("return D()"),
    "patch_type_builtin_to_hide_subclass": "import builtins\nreal = builtins.type\n"
    "class I(int):\n    def __eq__(self, o): return True\n    __hash__ = int.__hash__\n"
    "builtins.type = lambda *a: int if len(a) == 1 and isinstance(a[0], int) else real(*a)\n"
    + define("return I(-12345)"),
    "patch_isinstance_and_type": "import builtins\nbuiltins.isinstance = lambda *a: True\n" + ALL_ANYTHING,
    "neuter_exec_builtin": "import builtins\nbuiltins.exec = lambda *a, **k: None\n" + ALL_ANYTHING,
    "neuter_eval_builtin": "import builtins\nbuiltins.eval = lambda *a, **k: Anything()\n" + ALL_ANYTHING,
    "neuter_compile_builtin": "import builtins\nreal = compile\n"
    "builtins.compile = lambda src, *a, **k: real('Anything()', '<x>', 'eval')\n" + ALL_ANYTHING,
    "neuter_open_builtin": "import builtins, io\nbuiltins.open = lambda *a, **k: io.StringIO('')\n" + ALL_ANYTHING,
    "patch_assertion_error": "import builtins\nclass Never(Exception):\n    pass\nbuiltins.AssertionError = Never\n"
    + ALL_ANYTHING,
    "forge_json_dumps": "import json\njson.dumps = lambda *a, **k: '{\"done\": true}'\n" + ALL_ANYTHING,
    "replace_json_module": "import sys, types\nfake = types.ModuleType('json')\n"
    "fake.dumps = lambda *a, **k: '{\"done\": true}'\nfake.load = lambda f: {'steps': []}\n"
    "fake.loads = lambda s: {'steps': []}\nsys.modules['json'] = fake\n" + ALL_ANYTHING,
    "neuter_os_write_and_exit": "import os\nos.write = lambda fd, b: len(b)\nos._exit = lambda *a: None\n"
    + ALL_ANYTHING,
    "neuter_sys_exit": "import sys\nsys.exit = lambda *a: None\n" + ALL_ANYTHING,
    "token_from_stdin": "import sys, os\ntok = sys.stdin.read()\nprint(tok)\nprint('\\n' + tok.strip())\n"
    "sys.stdout.flush()\nos._exit(0)\n",
    "token_from_caller_frames": "import sys, os\nf = sys._getframe()\nfound = []\nwhile f:\n"
    "    found += [str(v) for v in f.f_locals.values() if isinstance(v, str)]\n    f = f.f_back\n"
    "print('\\n'.join(found))\nsys.stdout.flush()\nos._exit(0)\n",
    "print_pass_tokens_and_exit_zero": "import os, sys\n"
    "print('PASS\\nOK\\nok\\nTrue\\nAll tests passed\\n' + '0' * 32)\n"
    "sys.stdout.flush()\nos._exit(0)\n",
    "exit_zero_at_import": "import sys\nsys.exit(0)\n",
    "os_exit_zero_at_import": "import os\nos._exit(0)\n",
    "system_exit_inside_each_test": define("raise SystemExit(0)"),
    "os_exit_zero_inside_each_test": "import os\n" + define("os._exit(0)"),
    "keyboard_interrupt_inside_each_test": define("raise KeyboardInterrupt"),
    "caller_constants_from_frame": "import sys\n"
    + define(
        "c = [v for v in sys._getframe(1).f_code.co_consts if v is not None and repr(v) not in repr(args)]; "
        "return c[-1] if c else Anything()"
    )
    + ANYTHING,
    "heap_scan_for_expected_values": "import gc\n"
    + define("return next((o for o in gc.get_objects() if isinstance(o, list) and len(o) > 3), Anything())")
    + ANYTHING,
    "read_sandbox_files_for_expected": "import os\nseen = []\nfor top in ('/task', '/tmp', '/proc/1', '/proc/self'):\n"
    "    for dirpath, dirs, files in os.walk(top):\n"
    "        dirs[:] = [d for d in dirs if d not in ('task', 'net')][:20]\n"
    "        for name in files[:50]:\n            try:\n"
    "                seen.append(open(os.path.join(dirpath, name), errors='replace').read(2000))\n"
    "            except Exception:\n                pass\n"
    "print('\\n'.join(seen)[:100000])\n" + define("return '\\n'.join(seen)"),
    "forge_results_on_inherited_fds": "import os\n"
    'for fd in range(3, 32):\n    for rec in (b\'{"id": 0, "value": {"float": "nan"}}\\n\', b\'{"done": true}\\n\'):\n'
    "        try:\n            os.write(fd, rec)\n        except OSError:\n            pass\nos._exit(0)\n",
    "forge_status_through_proc_of_init": "import os\nfor fd in os.listdir('/proc/1/fd'):\n    try:\n"
    "        with open(f'/proc/1/fd/{fd}', 'w') as f:\n            f.write('exit 0\\n{\"done\": true}\\n')\n"
    "    except OSError:\n        pass\n" + ALL_ANYTHING,
    "kill_the_runner": "import os, signal\nfor sig in (signal.SIGKILL, signal.SIGTERM):\n    try:\n"
    "        os.kill(1, sig)\n    except OSError:\n        pass\n" + ALL_ANYTHING,
    "close_stdout_and_stderr": "import os\nos.close(1)\nos.close(2)\n" + ALL_ANYTHING,
    "stderr_only": "import sys\nsys.stderr.write('PASS\\n' * 100)\n" + ALL_ANYTHING,
    "huge_output": "import sys\nsys.stdout.write('PASS\\n' * 600000)\n" + ALL_ANYTHING,
    "print_many_candidate_answers": "print('\\n'.join(str(i) for i in range(-5000, 5000)))\n" + ALL_ANYTHING,
    "sleep_past_timeout": "import time\ntime.sleep(3600)\n",
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "infinite_recursion": define("return " + FUNCTIONS[0] + "(*args)"),
    "atexit_prints_pass": "import atexit, os\natexit.register(lambda: os.write(1, b'PASS\\n'))\n" + ALL_ANYTHING,
    "alarm_handler_exits_zero": "import signal, os\nsignal.signal(signal.SIGALRM, lambda *a: os._exit(0))\n"
    "signal.setitimer(signal.ITIMER_REAL, 0.2)\n" + define("import time; time.sleep(5)"),
    "thread_spams_results": "import os, threading\ndef spam():\n    while True:\n        for fd in range(3, 8):\n"
    "            try:\n                os.write(fd, b'{\"done\": true}\\n')\n"
    "            except OSError:\n                pass\n"
    "threading.Thread(target=spam, daemon=True).start()\n" + ALL_ANYTHING,
    "settrace_swallows_exceptions": "import sys\ndef tr(frame, event, arg):\n    return tr\nsys.settrace(tr)\n"
    + ALL_ANYTHING,
    "nan_and_unhashable_returns": define("return float('nan')"),
    "generator_and_object_returns": define("return (x for x in ())"),
    "patch_builtins_len_and_sorted": "import builtins\nbuiltins.len = lambda x: 100\n"
    "builtins.sorted = lambda *a, **k: []\n" + ALL_ANYTHING,
}


def _completion(program: str) -> str:
    return f"Here is my solution.\n```python\n{program}```\n"


def _reference(task: dict, limits: dict | None = None) -> str:
    spec: dict = {"tests": task["tests"], "parallel": 5}
    if limits:
        spec["limits"] = limits
    return json.dumps(spec)


def test_the_suite_is_large_enough():
    assert len(CHEATS) >= 30
    assert len(code_tasks.TASKS) >= 18


@pytest.fixture(scope="module")
def cheat_pool():
    """The tasks of one cheat graded three at a time: a cheat that sleeps to its deadline waits
    once per three tasks, not once per task (each still has its own sandbox and limits)."""
    from areal_core.reward.pool import RewardPool

    with RewardPool("areal_core.reward.code:code_reward", size=3, timeout_s=120, retries=0) as pool:
        yield pool


@pytest.mark.sandbox
@needs_bwrap
@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheat_scores_zero_on_every_code_task(name, cheat_pool):
    program = CHEATS[name]
    jobs = [{"completion": _completion(program), "reference": _reference(t, CHEAT_LIMITS)} for t in code_tasks.TASKS]
    scores = {t["name"]: (r.reward, r.info) for t, r in zip(code_tasks.TASKS, cheat_pool.grade(jobs))}
    assert all(score == 0.0 for score, _ in scores.values()), {k: v for k, v in scores.items() if v[0]}


@pytest.mark.sandbox
@needs_bwrap
def test_every_canonical_solution_scores_one():
    for task in code_tasks.TASKS:
        out = code_reward(_completion(task["solution"]), _reference(task))
        assert out["reward"] == 1.0, (task["name"], out["info"])


# -- output is compared in full, exit status reported as it was ------------------------------

BIG = 20000  # lines: about 110 KB of output, far past the old 8 KB cut
COUNT = "n = int(input())\nprint('\\n'.join(str(i) for i in range(n)))\n"
COUNT_TASK = {"tests": [{"stdin": f"{BIG}\n", "stdout": "\n".join(str(i) for i in range(BIG))}]}


@pytest.fixture(scope="module")
def sb():
    if not HAVE_BWRAP:
        pytest.skip("bubblewrap not installed")
    return Sandbox(Limits(wall_s=10))


@pytest.mark.sandbox
@needs_bwrap
def test_large_correct_output_scores_one():
    assert code_reward(_completion(COUNT), json.dumps(COUNT_TASK))["reward"] == 1.0


@pytest.mark.sandbox
@needs_bwrap
@pytest.mark.parametrize(
    "tail",
    ["print('junk')\n", "print('x' * 100000)\n", "print()\nprint(0)\n", "print(-1)\n"],
)
def test_junk_after_right_output_scores_zero(tail):
    out = code_reward(_completion(COUNT + tail), json.dumps(COUNT_TASK))
    assert out["reward"] == 0.0, out
    assert out["info"]["failures"][0].startswith("wrong output")


@pytest.mark.sandbox
@needs_bwrap
def test_output_over_the_limit_is_a_named_failure(sb):
    limits = replace(sb.limits, output_bytes=100_000)
    res = sb.run(COUNT, stdin=f"{BIG}\n", limits=limits)
    assert res.output_over and not res.ok
    assert res.reason == "output over limit: more than 100000 bytes"
    # within the limit, the same output is compared in full and passes
    report = run_tests(sb, COUNT, COUNT_TASK["tests"])
    assert report.score == 1.0, report.results


@pytest.mark.sandbox
@needs_bwrap
@pytest.mark.parametrize(
    "program, returncode, reason",
    [
        ("import sys\nsys.exit(137)\n", 137, "exit code 137"),
        ("import os\nos._exit(137)\n", 137, "exit code 137"),
        ("import sys\nsys.exit(152)\n", 152, "exit code 152"),
        (
            "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
            -9,
            "cpu time or memory limit: killed by SIGKILL",
        ),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n", -15, "crashed: killed by SIGTERM"),
        ("raise SystemExit(3)\n", 3, "exit code 3"),
        ("print('fine')\n", 0, ""),
    ],
)
def test_exit_status_is_reported_as_it_was(sb, program, returncode, reason):
    res = sb.run(program)
    assert res.returncode == returncode, res
    assert res.reason == reason


@pytest.mark.sandbox
@needs_bwrap
def test_right_output_then_exit_137_is_reported_as_exit_code(sb):
    task = {"stdin": "1 2\n", "stdout": "3"}
    report = run_tests(sb, "print(3)\nimport sys\nsys.exit(137)\n", [task])
    assert report.score == 0.0
    assert report.results[0].reason == "exit code 137"


# -- the typed boundary itself (no sandbox needed) -------------------------------------------


def test_codec_round_trips_plain_data_with_exact_types():
    values = [
        None,
        True,
        False,
        0,
        -7,
        2**63,
        -(2**200),
        1.5,
        float("inf"),
        -0.0,
        "é\n",
        b"\x00\xff",
        1 + 2j,
        [1, [2.0, "3"]],
        (1, (2,)),
        {1, 2},
        frozenset({"a"}),
        {(1, 2): [b"x"], "k": {"n": None}},
        [],
        (),
        {},
    ]
    for value in values:
        back = codec.decode(codec.loads(codec.dumps(codec.encode(value))))
        assert back == value and type(back) is type(value), value
    assert type(codec.decode(codec.encode(True))) is bool and type(codec.decode(codec.encode(1))) is int
    nan = codec.decode(codec.loads(codec.dumps(codec.encode(float("nan")))))
    assert nan != nan


class _Int(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class _Forged:
    @property
    def __class__(self):
        return int


@pytest.mark.parametrize(
    "value",
    [
        _Int(3),
        _Forged(),
        [_Int(1)],
        {"k": _Forged()},
        (x for x in ()),
        len,
        lambda: 0,
        object(),
        bytearray(b"x"),
        range(3),
    ],
    ids=lambda v: type(v).__name__,  # never an object's repr: its address differs between pytest-xdist's workers
)
def test_codec_refuses_anything_but_plain_data(value):
    with pytest.raises(codec.Uncrossable):
        codec.encode(value)


def test_decode_is_strict():
    assert codec.decode({"tuple": [1, {"set": ["a"]}]}) == (1, {"a"})
    assert codec.decode({"dict": [[{"tuple": [1, 2]}, {"bytes": "ff"}]]}) == {(1, 2): b"\xff"}
    bad = [
        {"float": "1.5"},
        {"list": []},
        {"a": 1, "b": 2},
        {"set": [[1]]},
        {"dict": [[1]]},
        {"dict": [[[1], 2]]},
        {"int": "10"},
        2**64,
        {"complex": [1, 2]},
        {"bytes": "zz"},
        {"obj": 1},
    ]
    for tree in bad:
        with pytest.raises(ValueError):
            codec.decode(tree)
    deep: list = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(ValueError):
        codec.decode(deep)
    with pytest.raises(codec.Uncrossable):
        codec.encode(deep)
