"""A bubblewrap sandbox for untrusted programs: one run as `__main__`, or a session serving calls.

Every run is a fresh `bwrap` with:

* all namespaces new (user, pid, net, ipc, uts, cgroup): no network (only a private
  loopback), no view of host processes, no nested user namespaces, all capabilities dropped;
* a read-only system (`/usr` and its `/bin /lib /lib64` links; no `/etc`, `/home`, `/root`,
  `/work`, `/sys`), `/` and `/dev` remounted read-only;
* a private `/tmp` and `/dev/shm`, one tmpfs capped in bytes and in inodes (files and folders):
  bubblewrap cannot pass `nr_inodes`, so `unshare` (util-linux) first enters a user and mount
  namespace of its own (mapping the caller to its root), mounts the capped tmpfs over the run's
  scratch folder there and execs bwrap, which binds it in; where that cannot work the sandbox
  falls back to bwrap's byte-capped `--tmpfs` and says once that files are then uncounted;
* the program's files read-only at `/task`;
* an empty environment (the parent's environment never reaches bwrap, so even
  `/proc/1/environ` inside holds only PATH);
* limits applied inside by `prlimit`: CPU seconds, address space, processes (threads
  included), file size (which also caps stdout/stderr, both written to files), open files,
  no core dumps;
* a wall-clock timeout that kills bwrap's whole process group; bwrap's `--die-with-parent`
  and the pid namespace then take every process of the sandbox with it, so a killed
  reward process never leaves orphans behind.

When the caller is root the sandbox runs as an unprivileged uid (65534 by default), which
is what makes the process-count limit bite (the kernel exempts uid 0 from it).

Without bubblewrap, or where it cannot create namespaces, `Sandbox()` raises
`SandboxUnavailable`; nothing ever runs unsandboxed.

Inside, the first process is `sandbox_runner.py` (pid 1 of the sandbox, which nothing inside
can kill). It forks the program and reports how it ended, `exit N` or `signal N` from the real
wait status, on a file descriptor of its own: an `exit(137)` is never mistaken for a SIGKILL.

`Sandbox.run(program, stdin)` runs a program as `__main__` (mode `main`: stdin/stdout tests);
`Sandbox.spawn("serve", ...)` starts one that serves calls to the program's functions over a
pair of pipes (mode `serve`, driven by `areal_core.reward.boundary`). Scoring unit tests is
`areal_core.reward.grading.run_tests`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from areal_core.reward.seccomp import deny_filter


class SandboxUnavailable(RuntimeError):
    """bubblewrap (or prlimit) is missing or cannot build a sandbox here; nothing was run."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 5.0  # wall clock per run, per test, and for loading the program; the sandbox is killed after it
    call_s: float = 0.0  # wall clock per call of a program function (0: wall_s)
    cpu_s: int = 3  # CPU seconds per process (SIGXCPU, then SIGKILL one second later)
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    nproc: int = 16  # processes + threads (RLIMIT_NPROC, counted in the sandbox's user namespace)
    fsize_mb: int = 4  # largest file the program may write; stdout/stderr are files too
    tmp_mb: int = 16  # size of the private /tmp and /dev/shm (one tmpfs, both together)
    tmp_inodes: int = 4096  # files + folders there (the tmpfs's nr_inodes): an inode flood stops here
    nofile: int = 64  # open file descriptors
    output_bytes: int = 2**20  # stdout compared in full up to this size; more is "output over limit"

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> Limits:
        known = {f.name for f in fields(cls)}
        unknown = set(values or {}) - known
        if unknown:
            raise ValueError(f"unknown sandbox limits {sorted(unknown)}; known: {sorted(known)}")
        return replace(cls(), **(values or {}))


@dataclass
class RunResult:
    returncode: int | None  # the program's exit code, -N when signal N killed it, None when unknown
    stdout: str
    stderr: str  # its last STDERR_CHARS characters
    wall_s: float
    timed_out: bool = False
    reason: str = ""  # why it failed, in words ("" when it exited 0)
    output_over: bool = False  # stdout went past Limits.output_bytes

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_over


@dataclass
class TestOutcome:
    ok: bool
    reason: str
    wall_s: float


@dataclass
class TestReport:
    results: list[TestOutcome] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.results)

    @property
    def passed(self) -> int:
        return sum(r.ok for r in self.results)

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def reasons(self, limit: int = 5) -> list[str]:
        """Distinct failure reasons, most frequent first."""
        counts: dict[str, int] = {}
        for r in self.results:
            if not r.ok:
                counts[r.reason] = counts.get(r.reason, 0) + 1
        return sorted(counts, key=lambda k: -counts[k])[:limit]


log = logging.getLogger(__name__)
_SIGNALS = {int(s): s.name for s in signal.Signals}
_PROBED: dict[tuple[str, ...], str] = {}  # (bwrap, python, uid) -> "" or why no sandbox runs
_CAPPED: dict[tuple[str, ...], str] = {}  # the same, with the inode-capped tmpfs
SANDBOX_UID = 65534  # the program's uid inside (never 0, so that setuid(0) and root's exemptions fail)
_RUNNER = (Path(__file__).parent / "sandbox_runner.py").read_text()
STDERR_CHARS = 4096
_FILES = ("stdin", "stdout", "stderr", "status")


def _tmpfs_size_supported(bwrap: str) -> bool:
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--size" in out.stdout + out.stderr


def find_python() -> tuple[str, list[str]]:
    """The interpreter used inside, and extra host folders it needs bound read-only.

    $AREAL_SANDBOX_PYTHON, else /usr/bin/python3, else this interpreter's installation.
    """
    explicit = os.environ.get("AREAL_SANDBOX_PYTHON")
    if explicit:
        real = os.path.realpath(explicit)
        return real, [] if real.startswith("/usr/") else [str(Path(real).parent.parent)]
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3", []
    real = os.path.realpath(sys.executable)
    return real, [] if real.startswith("/usr/") else [os.path.realpath(sys.base_prefix)]


class Sandbox:
    def __init__(self, limits: Limits | None = None, python: str | None = None, uid: int = 65534):
        self.limits = limits or Limits()
        self.bwrap = shutil.which("bwrap")
        if not self.bwrap:
            raise SandboxUnavailable(
                "bubblewrap ('bwrap') is not installed or not on PATH; install it (apt-get install bubblewrap). "
                "Untrusted code is never run without the sandbox."
            )
        prlimit = "/usr/bin/prlimit"
        if not os.path.exists(prlimit):
            raise SandboxUnavailable("prlimit (util-linux) not found at /usr/bin/prlimit; it applies the limits")
        self.prlimit = prlimit
        if python:
            self.python, self.extra_ro = os.path.realpath(python), []
            if not self.python.startswith("/usr/"):
                self.extra_ro = [str(Path(self.python).parent.parent)]
        else:
            self.python, self.extra_ro = find_python()
        self.uid = uid if os.geteuid() == 0 else None  # root drops to an unprivileged uid
        self.sized_tmpfs = _tmpfs_size_supported(self.bwrap)
        self.unshare = shutil.which("unshare") or "/usr/bin/unshare"
        self.capped_tmpfs = os.path.exists(self.unshare) and shutil.which("mount") is not None
        key = (self.bwrap, self.python, str(self.uid))
        if self.capped_tmpfs and _CAPPED.setdefault(key, self._probe()) != "":
            self.capped_tmpfs = False
            log.warning("the sandbox's /tmp is capped in bytes only: %s", _CAPPED[key][:300])
        if key not in _PROBED:
            _PROBED[key] = self._probe()
        if _PROBED[key]:
            raise SandboxUnavailable(f"bubblewrap cannot build a sandbox here: {_PROBED[key].strip()[:500]}")

    def _probe(self) -> str:
        """ "" when a trivial program runs in this sandbox, else why not."""
        try:
            probe = self.run("import sys; print('ok')", limits=replace(self.limits, wall_s=30))
        except OSError as exc:  # bwrap not executable by the sandbox uid, ...
            return f"{type(exc).__name__}: {exc}"
        return "" if probe.ok and probe.stdout.strip() == "ok" else (probe.stderr.strip() or probe.reason or "?")

    # -- one run ----------------------------------------------------------------------------
    def command(self, task_dir: str, argv: list[str], limits: Limits, seccomp_fd: int | None = None) -> list[str]:
        """The host command line that runs `argv` inside a fresh sandbox, `task_dir` read-only at /task;
        `seccomp_fd`: an open file of `seccomp.deny_filter()` (io_uring, keyctl, bpf, ... refused)."""
        cmd = self.scratch_mount(task_dir, limits) if self.capped_tmpfs else []
        cmd += [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--as-pid-1"]
        cmd += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        if seccomp_fd is not None:
            cmd += ["--seccomp", str(seccomp_fd)]
        cmd += ["--cap-drop", "ALL", "--new-session", "--hostname", "sandbox", "--clearenv"]
        cmd += ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/lib", "/lib32", "/lib64", "/sbin"):
            if os.path.islink(top):
                cmd += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                cmd += ["--ro-bind", top, top]
        for extra in self.extra_ro:
            cmd += ["--ro-bind", extra, extra]
        cmd += ["--proc", "/proc", "--dev", "/dev"]
        for mount, sub in (("/tmp", "tmp"), ("/dev/shm", "shm")):
            if self.capped_tmpfs:
                cmd += ["--bind", f"{Path(task_dir).parent}/scratch/{sub}", mount]
                continue
            if self.sized_tmpfs:
                cmd += ["--size", str(limits.tmp_mb * 2**20)]
            cmd += ["--tmpfs", mount]
        cmd += ["--ro-bind", task_dir, "/task", "--remount-ro", "/dev", "--remount-ro", "/"]
        for k, v in (("PATH", "/usr/bin:/bin"), ("HOME", "/tmp"), ("LANG", "C.UTF-8"), ("PYTHONHASHSEED", "0")):
            cmd += ["--setenv", k, v]
        cmd += ["--chdir", "/tmp", "--", self.prlimit]
        cmd += [
            f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
            f"--as={limits.memory_mb * 2**20}",
            f"--nproc={limits.nproc}",
            f"--fsize={limits.fsize_mb * 2**20}",
            f"--nofile={limits.nofile}",
            "--core=0",
            "--",
            *argv,
        ]
        return cmd

    def scratch_mount(self, task_dir: str, limits: Limits) -> list[str]:
        """The prefix that mounts the run's capped tmpfs (bytes and inodes) at `<work>/scratch`
        in a namespace of its own, makes its `tmp` and `shm` folders and execs the rest."""
        scratch = f"{Path(task_dir).parent}/scratch"
        options = f"size={limits.tmp_mb * 2**20},nr_inodes={limits.tmp_inodes},mode=0755"
        script = 'mount -t tmpfs -o "$1" tmpfs "$2" && mkdir -m 1777 "$2/tmp" "$2/shm" && shift 2 && exec "$@"'
        return [self.unshare, "--user", "--map-root-user", "--mount", "--", "/bin/sh", "-c", script, "sh"] + [
            options,
            scratch,
        ]

    def run(self, program: str, stdin: str = "", limits: Limits | None = None) -> RunResult:
        """Run `program` (Python source) as `__main__` (/task/main.py) with `stdin`."""
        limits = limits or self.limits
        run = self.spawn("main", {"main.py": program}, limits, stdin=stdin)
        try:
            timed_out = not run.wait(limits.wall_s)
            if timed_out:
                run.kill()
            return run.result(timed_out)
        except BaseException:
            run.kill()
            raise
        finally:
            run.close()

    def spawn(
        self,
        mode: str,
        files: dict[str, str],
        limits: Limits,
        stdin: str = "",
        channel: tuple[int, ...] = (),
    ) -> Spawned:
        """Start a sandbox running `_runner.py MODE` over `files` (at /task); `channel` fds are passed in.

        The caller waits, kills and reads it (`Spawned`), then closes it (which removes its files).
        """
        work = Path(tempfile.mkdtemp(prefix="areal-sbx-"))
        stack = contextlib.ExitStack()
        try:
            task = work / "task"
            task.mkdir()
            (work / "scratch").mkdir(mode=0o755)
            for name, text in {"_runner.py": _RUNNER, **files}.items():
                (task / name).write_text(text)
                (task / name).chmod(0o644)
            task.chmod(0o755)
            work.chmod(0o755)
            (work / "stdin").write_text(stdin)
            fin, fout, ferr, fstatus = (
                stack.enter_context(open(work / n, "rb" if n == "stdin" else "wb")) for n in _FILES
            )
            (work / "seccomp.bpf").write_bytes(deny_filter())
            fseccomp = stack.enter_context(open(work / "seccomp.bpf", "rb"))
            fds = [fstatus.fileno(), *channel]
            argv = [self.python, "-I", "-S", "-B", "/task/_runner.py", mode, *map(str, fds)]
            kwargs: dict[str, Any] = {}
            if self.uid is not None:
                kwargs.update(user=self.uid, group=self.uid, extra_groups=[])
            t0 = time.monotonic()
            proc = subprocess.Popen(
                self.command(task.as_posix(), argv, limits, fseccomp.fileno()),
                stdin=fin,
                stdout=fout,
                stderr=ferr,
                env={"PATH": "/usr/bin:/bin"},  # nothing of the parent's environment
                start_new_session=True,
                close_fds=True,
                pass_fds=[*fds, fseccomp.fileno()],
                cwd=work,
                **kwargs,
            )
        except BaseException:
            stack.close()
            shutil.rmtree(work, ignore_errors=True)
            raise
        stack.close()  # the sandbox holds its own copies
        return Spawned(proc, work, mode, limits, t0)


@dataclass
class Spawned:
    """A started sandbox: wait for it, kill it, read how it ended, close it."""

    proc: subprocess.Popen
    work: Path
    mode: str
    limits: Limits
    t0: float

    def wait(self, timeout: float) -> bool:
        """True when it exited within `timeout` seconds."""
        return _wait(self.proc, timeout)

    def kill(self) -> None:
        """Kill bwrap's process group (and with it the sandbox's pid namespace)."""
        if self.proc.returncode is None:
            _kill_group(self.proc)

    def stderr_tail(self) -> str:
        return _read(self.work / "stderr", STDERR_CHARS * 4, tail=True)[-STDERR_CHARS:]

    def result(self, timed_out: bool = False) -> RunResult:
        """How the run ended (call after it exited or was killed)."""
        limits, work = self.limits, self.work
        wall = time.monotonic() - self.t0
        sizes = {n: (work / n).stat().st_size for n in _FILES[1:3]}
        out_limit = min(limits.output_bytes, limits.fsize_mb * 2**20 - 1)
        over = self.mode == "main" and sizes["stdout"] > out_limit
        capped = max(sizes.values()) >= limits.fsize_mb * 2**20
        stdout = _read(work / "stdout", out_limit) if self.mode == "main" else ""
        stderr = self.stderr_tail()
        status = parse_status((work / "status").read_bytes()[:64])
        if status is None and not timed_out:
            last = stderr.strip().splitlines()[-1:] or [f"bwrap exit code {self.proc.returncode}"]
            reason = (
                f"sandbox error: {last[0][:300]}"
                if last[0].startswith("bwrap")
                else f"sandbox error: the runner reported no status ({last[0][:200]})"
            )
        else:
            reason = explain(status, stderr, timed_out, limits, capped, over, out_limit)
        return RunResult(status, stdout, stderr, wall, timed_out, reason, over)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.work, ignore_errors=True)


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for `proc` up to `timeout` seconds; True when it exited.

    A pidfd wakes up the moment the process exits (Popen.wait(timeout) polls with sleeps of
    up to 50 ms, which would dominate a 30 ms sandbox run).
    """
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        ready = poller.poll(max(0, int(timeout * 1000)))
    finally:
        os.close(fd)
    if ready:
        proc.wait()
        return True
    return False


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _read(path: Path, limit: int, tail: bool = False) -> str:
    """At most `limit` bytes of a file (its head, or its tail), as text."""
    with open(path, "rb") as f:
        if tail:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
        return f.read(limit).decode("utf-8", "replace")


def parse_status(raw: bytes) -> int | None:
    """The runner's one line: `exit N` -> N, `signal N` -> -N; anything else -> None."""
    m = re.fullmatch(rb"(exit|signal) (\d{1,3})\n", raw)
    if not m:
        return None
    return int(m.group(2)) if m.group(1) == b"exit" else -int(m.group(2))


_KNOWN_ERRORS = [
    (re.compile(r"MemoryError"), "memory limit"),
    (re.compile(r"File too large|Errno 27"), "file size limit"),
    (re.compile(r"No space left on device"), "no space left (tmp size or namespace limit)"),
    (re.compile(r"Resource temporarily unavailable|can't start new thread"), "process limit"),
    (re.compile(r"Too many open files"), "open files limit"),
    (
        re.compile(r"Network is unreachable|Connection refused|Name or service not known|Temporary failure in name"),
        "no network",
    ),
    (re.compile(r"Read-only file system|Permission denied|Operation not permitted"), "not permitted"),
]


def explain(
    rc: int | None,
    stderr: str,
    timed_out: bool,
    limits: Limits,
    output_capped: bool = False,
    output_over: bool = False,
    output_limit: int | None = None,
) -> str:
    """A failed run's reason in words: the limit it hit, or its last error line.

    `rc` is the exit code, or -N when signal N killed the program (never 128 + N).
    """
    if timed_out:
        return f"timeout: wall clock over {limits.wall_s:g}s (sandbox killed)"
    if output_over:
        return f"output over limit: more than {output_limit or limits.output_bytes} bytes"
    if rc == 0:
        return ""
    if output_capped:
        return f"file size limit: output reached {limits.fsize_mb} MB"
    last = next((line.strip() for line in reversed(stderr.strip().splitlines()) if line.strip()), "")
    if last.startswith("bwrap:"):
        return f"sandbox error: {last}"
    sig = -rc if rc is not None and rc < 0 else 0
    if sig == signal.SIGXCPU:
        return f"cpu time limit ({limits.cpu_s}s) (SIGXCPU)"
    if sig:
        name = _SIGNALS.get(sig, str(sig))
        what = "cpu time or memory limit" if sig == signal.SIGKILL else "crashed"
        return f"{what}: killed by {name}" + (f" | {last[:200]}" if last else "")
    for pattern, word in _KNOWN_ERRORS:
        if pattern.search(last):
            return f"{word}: {last[:200]}"
    return f"exit code {rc}" + (f": {last[:200]}" if last else "")


def check_sandbox() -> None:
    """Raise SandboxUnavailable unless a sandbox can be built here (a cheap preflight)."""
    Sandbox()
