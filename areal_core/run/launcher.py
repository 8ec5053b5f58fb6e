"""Single-machine supervisor: starts N rollout, K reward and one trainer process on one run
root, forwards their logs with the role's name, shows progress, and stops everything when
any role fails, naming it.

Each role leads its own process group and gets SIGKILL when the launcher dies (areal_core/procs.py);
stopping a role signals its whole group, so no grandchild (reward pool, vLLM server) outlives it.
A store outage never stops the launcher: a progress tick that cannot read the store is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from areal_core.events import EventTail
from areal_core.layout import LAYOUT
from areal_core.procs import descendants, kill_group, own_group_dying_with_parent
from areal_core.report.doctor import limiting_role
from areal_core.retry import POLICY
from areal_core.store import Store

PROJECT_ROOT = Path(__file__).resolve().parents[2]
RESULT_PREFIX = '{"role": '  # the last line a role process prints (areal_core/run/roles.py: main)


class RoleFailed(RuntimeError):
    """A role process exited with an error; the message names the role and its exit code."""


@dataclass
class RoleProcess:
    name: str
    proc: subprocess.Popen
    pump: threading.Thread
    last_line: list[str] = field(default_factory=list)  # its output's last non-empty line
    results: list[dict] = field(default_factory=list)  # its result lines ({"role": ..., "result": ...})


def _pump(name: str, stream, sink, last: list[str] | None = None, results: list[dict] | None = None) -> None:
    """Copy a role's output to `sink`, line by line, keeping its last non-empty line in `last` and
    its result lines, parsed, in `results`."""
    for line in iter(stream.readline, ""):
        if results is not None and line.startswith(RESULT_PREFIX):
            with contextlib.suppress(json.JSONDecodeError):
                results.append(json.loads(line))
        sink.write(f"[{name}] {line}")
        sink.flush()
        if last is not None and line.strip():
            last[:] = [line.strip()[:500]]
    stream.close()


def start_role(
    role: str,
    run_uri: str,
    index: int = 0,
    env: dict[str, str] | None = None,
    log_sink=None,
    nproc: int = 1,
    task: bool = False,
) -> RoleProcess:
    """The role as a process of its own (its own process group, killed with this one); `nproc` > 1
    runs it under torchrun as that many ranks (the trainer's FSDP2 on one machine). `task`: it runs
    the role's Flyte task entry point (roles.TASKS), whose result `wait_role` returns."""
    name = f"{role}-{index}"
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), full_env.get("PYTHONPATH", "")]))
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    ranks = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    proc = subprocess.Popen(
        [sys.executable, *ranks, "-m", "areal_core.run.roles", role, "--run-uri", run_uri, "--index", str(index)]
        + (["--task"] if task else []),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=str(PROJECT_ROOT),
        preexec_fn=own_group_dying_with_parent(signal.SIGKILL),
    )
    last: list[str] = []
    results: list[dict] = []
    sink = log_sink or sys.stderr
    pump = threading.Thread(target=_pump, args=(name, proc.stdout, sink, last, results), daemon=True)
    pump.start()
    return RoleProcess(name, proc, pump, last, results)


def wait_role(p: RoleProcess, store: Store) -> object:
    """The role's result once its process exited (None if it printed none); RoleFailed (and a
    `crash` event in the store, with its last output line) when it exited with an error."""
    rc = p.proc.wait()
    p.pump.join(timeout=5)
    if rc != 0:
        record_exit(store, p, rc)
        raise RoleFailed(f"role {p.name} exited with code {rc}")
    return p.results[-1]["result"] if p.results else None


def record_exit(store: Store, p: RoleProcess, rc: int) -> None:
    """A `crash` event of the launcher's: which role exited how, and its last output line (the role
    records its own exception when it has one; a killed one cannot). Best effort."""
    from areal_core.events import EventLog

    try:
        with EventLog(Store(store.uri, retry_s=0), "launcher", "0", flush_every_s=0) as ev:
            ev.emit("crash", name=p.name, exit_code=rc, last_line=(p.last_line or [""])[0])
    except Exception:  # noqa: BLE001 - the RoleFailed that follows is what matters
        pass


def stop_all(procs: list[RoleProcess], grace_s: float = 10.0) -> None:
    """SIGTERM to every role's process group, SIGKILL to what is left after `grace_s`, then to
    any descendant that left its group (e.g. a server in its own session)."""
    strays = {pid for p in procs for pid in descendants(p.proc.pid)}
    for p in procs:
        kill_group(p.proc.pid, signal.SIGTERM)
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()
    for p in procs:
        kill_group(p.proc.pid, signal.SIGKILL)
    for pid in strays:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Progress:
    """A one-line progress display of the trainer's heartbeat, with the shard backlog and the
    role that limits the run now (the doctor's `limiting_role` over the last `window_s` of
    events, read incrementally at most every `events_every_s`); a tick the store cannot answer
    at once is skipped (its store does not retry)."""

    def __init__(self, store: Store, enabled: bool, window_s: float = 60.0, events_every_s: float = 5.0):
        self.store, self.enabled = Store(store.uri, retry_s=0), enabled and sys.stderr.isatty()
        self.last_step = -1
        self.skipped = 0  # ticks skipped on a store error
        self.plain = enabled and not self.enabled
        self.window_s, self.events_every_s = window_s, events_every_s
        self.tail, self.recent, self.events_at = EventTail(self.store), [], -float("inf")
        self.backlog: dict | None = None
        self.limit: str | None = None

    def _read_events(self) -> None:
        """New events into the last `window_s` seconds; the newest backlog; the limiting role."""
        if time.monotonic() - self.events_at < self.events_every_s:
            return
        self.events_at = time.monotonic()
        new = self.tail.new()
        if not new:
            return
        self.backlog = next((r for r in reversed(new) if r["kind"] == "backlog"), self.backlog)
        newest = max(r["t"] for r in new)
        self.recent = [r for r in self.recent + new if r["t"] >= newest - self.window_s]
        self.limit = limiting_role(self.recent, self.window_s)

    def suffix(self) -> str:
        """ " · backlog U ungraded, G graded · limit: ROLE" (the parts known so far)."""
        out = ""
        if self.backlog is not None:  # a hand-written record may lack a key: the line never stops a run
            out += f" · backlog {self.backlog.get('ungraded', '?')} ungraded, {self.backlog.get('graded', '?')} graded"
        if self.limit:
            out += f" · limit: {self.limit}"
        return out

    def update(self) -> None:
        if not (self.enabled or self.plain):
            return
        try:
            st = self.store.read_json(LAYOUT.status("trainer", "0"))
            step = st.get("step", 0)
        except FileNotFoundError:  # no heartbeat yet
            return
        except Exception:  # a heartbeat being rewritten, or the store is unreachable now
            self.skipped += 1
            return
        if step != self.last_step:
            try:
                self._read_events()
            except Exception:  # unreadable or malformed events: the line goes on without them
                self.skipped += 1
        total = st.get("steps", 0)
        if step == self.last_step:
            return
        self.last_step = step
        width = 30
        filled = int(width * step / max(total, 1))
        line = (
            f"step {step}/{total} [{'#' * filled}{'.' * (width - filled)}] reward {st.get('reward_mean', 0):.3f} "
            f"staleness {st.get('staleness_mean', 0):.2f} dropped {int(st.get('dropped_samples', 0))} "
            f"{st.get('elapsed_s', 0):.0f}s"
        )
        if "eval_accuracy" in st:
            line += f" eval {st['eval_accuracy']:.3f}"
        line += self.suffix()
        if self.enabled:
            sys.stderr.write("\r" + line)
        elif step % 10 == 0 or step == total:
            sys.stderr.write(f"[progress] {line}\n")
        sys.stderr.flush()


def launch(
    run_uri: str,
    num_rollout: int,
    num_reward: int,
    timeout_s: float = 3600.0,
    progress: bool = True,
    env: dict[str, str] | None = None,
) -> dict:
    """Run all roles until the trainer writes DONE; raise RoleFailed naming a role that dies."""
    from areal_core.context import load_run_config

    store = Store(run_uri)
    nproc = load_run_config(store).train.nproc_per_node
    procs = [start_role("trainer", store.uri, 0, env, nproc=nproc)]
    procs += [start_role("rollout", store.uri, i, env) for i in range(num_rollout)]
    procs += [start_role("reward", store.uri, i, env) for i in range(num_reward)]
    bar = Progress(store, progress)
    t0 = time.time()
    try:
        while True:
            for p in procs:
                rc = p.proc.poll()
                if rc not in (None, 0):
                    p.pump.join(timeout=2)  # its last words
                    record_exit(store, p, rc)
                    raise RoleFailed(f"role {p.name} exited with code {rc}; stopping the run")
            if all(p.proc.poll() == 0 for p in procs):
                break
            if time.time() - t0 > timeout_s:
                raise RoleFailed(f"run did not finish within {timeout_s:.0f}s")
            bar.update()
            time.sleep(0.2)
    finally:
        stop_all(procs)
        for p in procs:
            p.pump.join(timeout=2)
        if bar.enabled:
            sys.stderr.write("\n")
    if not store.done():
        raise RoleFailed("all roles exited but the trainer wrote no DONE")
    return {
        "wall_s": time.time() - t0,
        "launcher_store_retries": POLICY.retries,
        "progress_skipped": bar.skipped,
        **store.read_json(LAYOUT.done),
    }
