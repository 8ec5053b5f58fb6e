"""A run root has one owner: the lease `LEASE.json` (run id, host, pid, heartbeat, state).

- The run's start (`claim`, from run/prepare.py) writes it with a new run id, by a conditional
  write, so of two runs starting at once exactly one wins. A second run into a root whose
  lease is live is refused before any work; a resume (`resume_run`) keeps the run id and
  continues; a stale lease (not renewed for `lease.timeout_s`, or whose owner process on this
  host is gone) is taken over only with `lease.takeover=true`. A finished run's lease
  (state "done") is free for the next run.
- Every role holds the lease while it runs (`hold`): a thread checks every `lease.interval_s`
  that the lease still names the role's run id and that the run's history is still there
  (config.yaml; for the trainer, its newest committed checkpoint). The trainer (and the SFT
  step, and the single-machine launcher) also renew the heartbeat. When the check fails, the
  process is fenced out of the root (`Store.fence`): its next store operation raises RootLost
  with the reason, and the role stops with that error. Each claim writes a new claim token, a
  resume's too: the roles of a run that only looked stale (a long store outage) and is resumed
  elsewhere see the token change and stop, instead of training on beside the resumed run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields

from areal_core.config import LeaseConfig
from areal_core.layout import LAYOUT
from areal_core.procs import pid_alive
from areal_core.store import RootLost, Store

log = logging.getLogger("areal.ownership")

RUN_ID_ENV = "AREAL_RUN_ID"  # the launcher tells its role processes which run they belong to


class RootInUse(RuntimeError):
    """A run may not start in this root: another run owns it (the message says how to proceed)."""


class BadLease(RootInUse, RootLost):
    """LEASE.json is not a lease: no run may claim the root, and a run holding it has lost it."""


@dataclass
class Lease:
    run_id: str
    host: str
    pid: int
    started: float
    heartbeat: float
    state: str = "running"  # running | done
    claim: str = ""  # new at every claim, a resume's too: the old run's roles, still alive, see it change
    timeout_s: float = 0.0  # the owner's lease.timeout_s: a newcomer's shorter one cannot make it stale

    @classmethod
    def new(cls, run_id: str, started: float | None = None, claim: str = "", timeout_s: float = 0.0) -> Lease:
        now = time.time()
        return cls(run_id, socket.gethostname(), os.getpid(), started or now, now, claim=claim, timeout_s=timeout_s)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    def status(self, timeout_s: float, now: float | None = None) -> str:
        """'done', 'stale' (no heartbeat for max(timeout_s, the owner's own timeout), or its process
        on this host is gone) or 'live'. The owner's timeout counts because it heartbeats by it."""
        if self.state == "done":
            return "done"
        if (now or time.time()) - self.heartbeat > max(timeout_s, self.timeout_s):
            return "stale"
        if self.host == socket.gethostname() and not pid_alive(self.pid):
            return "stale"
        return "live"

    def describe(self) -> str:
        return (
            f"run {self.run_id} (host {self.host}, pid {self.pid}, heartbeat {time.time() - self.heartbeat:.0f}s ago)"
        )


def read_lease(store: Store) -> tuple[Lease, str] | None:
    """The lease and its version token; None when the root has none."""
    got = store.read_versioned(LAYOUT.lease)
    if got is None:
        return None
    return decode_lease(got[0], store.uri), got[1]


def decode_lease(data: bytes, where: str) -> Lease:
    """A lease from its JSON; BadLease (no claim, and a holder has lost the root) when it is not one."""
    names = {f.name: f.type for f in fields(Lease)}
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict) or not {"run_id", "host", "pid", "started", "heartbeat"} <= raw.keys():
            raise ValueError("not a lease")
        lease = Lease(**{k: v for k, v in raw.items() if k in names})
        numbers = (lease.pid, lease.started, lease.heartbeat, lease.timeout_s)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in numbers):
            raise ValueError("a number field is not a number")
        if not all(isinstance(x, str) for x in (lease.run_id, lease.host, lease.state, lease.claim)):
            raise ValueError("a text field is not text")
    except (ValueError, TypeError, RecursionError) as exc:
        raise BadLease(
            f"{where}/{LAYOUT.lease} is not a lease ({str(exc)[:100]}): if no run owns this root, delete that file"
        ) from None
    return lease


def claim(store: Store, lease_cfg: LeaseConfig, resume: bool) -> str:
    """Make this run the root's owner (see the module docstring); returns its run id. Raises
    RootInUse with a one-line message when the root is someone else's."""
    current = read_lease(store)
    if current is None:
        lease = Lease.new(uuid.uuid4().hex[:12], claim=uuid.uuid4().hex[:12], timeout_s=lease_cfg.timeout_s)
    else:
        old, _ = current
        status = old.status(lease_cfg.timeout_s)
        if status == "live":
            what = "resume" if resume else "start a new run in"
            raise RootInUse(
                f"cannot {what} {store.uri}: it is owned by live {old.describe()}; stop that run first, "
                f"or once its lease is stale (no heartbeat for {max(lease_cfg.timeout_s, old.timeout_s):g}s) "
                "resume it with resume_run or take it over with lease.takeover=true"
            )
        if status == "stale" and not resume and not lease_cfg.takeover:
            raise RootInUse(
                f"{store.uri} belongs to {old.describe()}, which stopped without finishing: resume it "
                "with resume_run, or start a new run there with lease.takeover=true (its state is cleared)"
            )
        run_id, started = (old.run_id, old.started) if resume else (uuid.uuid4().hex[:12], None)
        lease = Lease.new(run_id, started, claim=uuid.uuid4().hex[:12], timeout_s=lease_cfg.timeout_s)
    if not store.write_if(LAYOUT.lease, lease.encode(), current[1] if current else None):
        winner = read_lease(store)
        who = winner[0].describe() if winner else "another run"
        raise RootInUse(f"cannot start in {store.uri}: {who} claimed it at the same moment")
    log.info("run %s owns %s%s", lease.run_id, store.uri, " (resumed)" if resume and current else "")
    return lease.run_id


def owner(store: Store) -> str:
    """The run id a role started on this root belongs to: the launcher's $AREAL_RUN_ID, else the
    lease's. Raises RootLost when the root has no lease."""
    current = read_lease(store)
    if current is None:
        raise RootLost(f"{store.uri} has no {LAYOUT.lease}: the run was not started (prepare) or the root was wiped")
    expected = os.environ.get(RUN_ID_ENV) or current[0].run_id
    if current[0].run_id != expected:
        raise RootLost(f"{store.uri} now belongs to {current[0].describe()}, not to run {expected}")
    return expected


def renew(store: Store, run_id: str, state: str = "running", claim: str | None = None) -> None:
    """Move the heartbeat of our lease to now (state 'done': the run finished); RootLost if not
    ours: another run id, or (given `claim`) the same run resumed by another process since."""
    for _ in range(20):
        current = read_lease(store)
        if current is None or current[0].run_id != run_id or (claim is not None and current[0].claim != claim):
            raise RootLost(lost_reason(store, run_id, current[0] if current else None))
        lease = Lease.new(run_id, current[0].started, claim=current[0].claim, timeout_s=current[0].timeout_s)
        lease.state = "done" if "done" in (state, current[0].state) else "running"  # only claim reopens a run
        if store.write_if(LAYOUT.lease, lease.encode(), current[1]):
            return
    raise RootLost(f"{store.uri}: could not renew the lease of run {run_id} (20 conflicting writes)")


def lost_reason(store: Store, run_id: str, lease: Lease | None) -> str:
    if lease is None:
        return f"{store.uri} lost its {LAYOUT.lease} under run {run_id}: the run root was wiped; stopping"
    if lease.run_id == run_id:
        return f"{store.uri}: run {run_id} was resumed by another process ({lease.describe()}); this one stops"
    return f"{store.uri} was taken over by {lease.describe()}; run {run_id} stops"


class Holder:
    """The thread that checks (and, with `renew`, heartbeats) one run's lease; see the module
    docstring. `check()` runs the same check synchronously and raises RootLost."""

    def __init__(self, store: Store, run_id: str, interval_s: float, renew: bool, checkpoints: bool = False):
        self.store, self.run_id, self.interval_s, self.renew = store, run_id, interval_s, renew
        self.checkpoints = checkpoints
        self.newest_checkpoint = -1
        self.claim: str | None = None  # the lease's claim when this holder started (see Lease.claim)
        self.lost: str | None = None  # why the root is no longer this run's, once the thread found out
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lease", daemon=True)

    def check(self) -> None:
        """RootLost when the lease no longer names this run or the run's history is gone."""
        current = read_lease(self.store)
        if current is not None and self.claim is None:
            self.claim = current[0].claim
        if current is None or current[0].run_id != self.run_id or current[0].claim != self.claim:
            raise RootLost(lost_reason(self.store, self.run_id, current[0] if current else None))
        if not self.store.exists(LAYOUT.config):
            raise RootLost(f"{self.store.uri} lost its {LAYOUT.config} under run {self.run_id}; stopping")
        if self.checkpoints:
            from areal_core.train.checkpoint import committed_steps

            newest = max(committed_steps(self.store), default=-1)
            if newest < self.newest_checkpoint:
                raise RootLost(
                    f"{self.store.uri} lost committed checkpoint step {self.newest_checkpoint} under run "
                    f"{self.run_id}; stopping"
                )
            self.newest_checkpoint = newest
        if self.renew:
            renew(self.store, self.run_id, claim=self.claim)

    def lost_reason(self) -> str | None:
        """Why the root is no longer this run's (the thread's finding, else a check now); None if it is."""
        if self.lost is None:
            try:
                self.check()
            except RootLost as exc:
                self.lost = str(exc)
            except Exception:  # the store cannot tell now
                return None
        return self.lost

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except RootLost as exc:
                log.error("%s", exc)
                self.lost = str(exc)
                Store.fence(self.store.uri, self.lost)
                return
            except Exception as exc:  # a store hiccup is not a lost root: check again next time
                log.warning("lease check of %s failed: %s", self.store.uri, exc)

    def start(self) -> Holder:
        self.check()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 5)


@contextlib.contextmanager
def hold(
    store: Store, lease_cfg: LeaseConfig, renew: bool = False, checkpoints: bool = False, run_id: str | None = None
) -> Iterator[Holder]:
    """Hold the lease of the run this process belongs to (`owner`) while the block runs."""
    holder = Holder(store, run_id or owner(store), lease_cfg.interval_s, renew, checkpoints).start()
    try:
        yield holder
    finally:
        holder.stop()
