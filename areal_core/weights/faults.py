"""Versions a reader cannot load, reported to the trainer, which repairs them, retires the reader
or stops the run.

A corrupted newest version (bytes flipped in the store, a broken delta chain) used to stall a run
without an error: the rollout workers kept their old version and retried the bad one at every
poll; under the staleness bound they could not start new groups, and the trainer waited for
samples that never came.

Now:
- a reader (`WeightWatcher`, a rollout worker's first load, a proxy following a run) that fails
  `REPORT_AFTER` times in a row (across versions: a broken delta chain fails each newer one)
  writes `weights_faults/{worker}.json` (`report`): the newest version it tried, its failures in
  a row and the error; it deletes the report once it loads a version (`clear`);
- at `RESTART_AFTER` failures in a row the reader restarts its loader once: the weights it keeps
  (`reader.forget`: the delta base, a LoRA base; a server's staged folders) are dropped and the
  next tries read everything from the store again;
- the trainer, while it waits for a batch, reads the reports (`reports`, size-limited and
  untrusted: a report of a version newer than the trainer's is ignored) and decides with
  `RepairPolicy.decide`: when the version fails the trainer's own check (`verify_version`), it is
  republished from the trainer's weights, which are that version's weights, as a full snapshot
  (no delta base to depend on); after `MAX_REPAIRS` republications that still fail, the run stops
  with a `VersionUnloadable` naming the version, the worker and the error;
- when the version verifies in the store but a reader still fails it `RETIRE_AFTER` times in a
  row (after its restart), the fault is the reader's: the trainer retires it
  (`readers_retired/{worker}.json`, a `reader_retired` event, a doctor finding) and the others go
  on. The reader sees the record (`Reporter.failed`), stops (a rollout worker finishes and writes
  the groups it has in flight; a proxy stops following and answers /health with ok false) and
  adds the groups it holds (`Reporter.retire`), whose admission the other workers then share
  (`rollout/admission.py`). The run stops only when no reader is left (`check_readers_left`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from areal_core.layout import LAYOUT, BadName
from areal_core.store import SMALL_JSON_BYTES, Store, UnreadableObject
from areal_core.weights import DELTA_FILE, WEIGHTS_FILE, WeightsError
from areal_core.weights.reader import MAX_MANIFEST_BYTES, load_weights_bytes, read_manifest, read_version_file

REPORT_AFTER = 3  # failures in a row of one version before a reader reports it
RESTART_AFTER = 12  # failures in a row (a report is due then): the reader restarts its loader, cache cleared
RETIRE_AFTER = 24  # failures in a row (a report is due then) of a version that verifies in the store: retired
MAX_REPAIRS = 2  # republications of one version that may still fail their check before the run stops
MAX_REPORTS = 256  # reports read per check: a flood of files cannot make a check unbounded

log = logging.getLogger("areal.weights")


class VersionUnloadable(RuntimeError):
    """The trainer's newest version cannot be repaired, or no reader is left to load it."""


def report_due(failures: int) -> bool:
    """Whether a reader writes its report at this count of failures in a row: REPORT_AFTER, then at
    every doubling (3, 6, 12, 24, ...), so a version failing for hours costs a few writes."""
    k, rest = divmod(failures, REPORT_AFTER)
    return k > 0 and rest == 0 and k & (k - 1) == 0


def report(store: Store, worker: str, version: int, failures: int, error: str) -> None:
    store.write_json(
        LAYOUT.weights_fault(worker),
        {"worker": worker, "version": version, "failures": failures, "error": error[:500], "time": time.time()},
    )


def clear(store: Store, worker: str) -> None:
    store.delete(LAYOUT.weights_fault(worker))


class VersionCheck:
    """`verify_version`, remembered per version and manifest: a version whose manifest has not
    changed since it was checked is not read and hashed again (a 7B version is ~14 GB), so a report
    that persists costs one manifest read a check; a republished version (new manifest) is checked
    once more."""

    def __init__(self, store: Store):
        self.store = store
        self._done: dict[int, tuple[bytes, str | None]] = {}

    def __call__(self, version: int) -> str | None:
        try:
            key = self.store.read_bytes(LAYOUT.manifest(version), MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            return f"weights v{version} incomplete: no {LAYOUT.manifest_name}"
        except UnreadableObject as exc:
            return f"weights v{version}: {exc}"
        if version in self._done and self._done[version][0] == key:
            return self._done[version][1]
        error = verify_version(self.store, version)
        self._done = {version: (key, error)}  # the newest only
        return error


@dataclass(frozen=True)
class Report:
    worker: str
    version: int
    failures: int
    error: str


def reports(store: Store) -> list[Report]:
    """The readers' reports; a file that is not a small JSON report of the expected fields is ignored."""
    out = []
    for rel in store.find(LAYOUT.weights_faults_dir, ".json")[:MAX_REPORTS]:
        try:
            d = json.loads(store.read_bytes(rel, SMALL_JSON_BYTES))
            r = Report(str(d["worker"])[:100], d["version"], d["failures"], str(d.get("error", ""))[:500])
        except (FileNotFoundError, ValueError, RecursionError, KeyError, TypeError):
            continue
        if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (r.version, r.failures)):
            out.append(r)
    return out


def verify_version(store: Store, version: int) -> str | None:
    """None when every file of weights/v{version} passes its check (a delta-published version
    rebuilt from its chain); else the first error."""
    try:
        manifest = read_manifest(store, version)
        rebuilt: set[str] = set()
        if "weights" in manifest:  # delta-published: the weights rebuilt from the chain and checked
            load_weights_bytes(store, version)
            rebuilt = {WEIGHTS_FILE, DELTA_FILE}
        for name in manifest["files"]:
            if name not in rebuilt:
                read_version_file(store, version, manifest, name)
    except (WeightsError, BadName) as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class Decision:
    """What the trainer does about the reports: "wait" or "repair" the version; and the readers it
    retires now (their reports)."""

    action: str
    retire: tuple[Report, ...] = ()


@dataclass
class RepairPolicy:
    """The trainer's side (module docstring). `decide(version, reports, verify)` returns a Decision
    or raises VersionUnloadable; `repaired(version)` counts a republication; `retired` holds the
    readers this trainer retired. A report only retires its reader once it has grown while this
    trainer watched (`first_seen`): one left by a reader of an earlier attempt, or a file written
    once by hand, never does."""

    repairs: dict[int, int] = field(default_factory=dict)
    first_seen: dict[str, tuple[int, int]] = field(default_factory=dict)  # worker -> (version, failures)
    retired: dict[str, Report] = field(default_factory=dict)

    def decide(self, version: int, found: list[Report], verify: Any) -> Decision:
        for r in found:
            self.first_seen.setdefault(r.worker, (r.version, r.failures))
        # a report of an older version counts too: the reader tries the newest next, and a delta
        # chain broken below it fails that one as well (verify says whether it does)
        failing = [
            r for r in found if r.version <= version and r.failures >= REPORT_AFTER and r.worker not in self.retired
        ]
        if not failing:
            return Decision("wait")
        worst = max(failing, key=lambda r: (r.version, r.failures))
        error = verify(version)
        if error is not None:
            if self.repairs.get(version, 0) >= MAX_REPAIRS:
                raise VersionUnloadable(
                    f"weights v{version} still fails its check after {MAX_REPAIRS} republications "
                    f"({error}); {worst.worker} reports {worst.failures} failures: {worst.error}"
                )
            return Decision("repair")
        live = [r for r in failing if r.version == version and self.first_seen[r.worker] != (r.version, r.failures)]
        stuck = tuple(r for r in live if r.failures >= RETIRE_AFTER)  # the version is fine: the reader is not
        self.retired.update((r.worker, r) for r in stuck)
        return Decision("wait", stuck)

    def repaired(self, version: int) -> None:
        self.repairs[version] = self.repairs.get(version, 0) + 1


def check_readers_left(readers: Iterable[str], retired: dict[str, Report]) -> None:
    """VersionUnloadable when readers were retired and every reader known (`readers`) is among them."""
    if retired and set(readers) <= set(retired):
        r = max(retired.values(), key=lambda r: (r.version, r.failures))
        raise VersionUnloadable(
            f"no reader is left: {', '.join(sorted(retired))} retired; weights v{r.version} passes its check "
            f"in the store but {r.worker} failed to load it {r.failures} times in a row: {r.error}"
        )


def retire(store: Store, r: Report) -> None:
    """The trainer's record that reader `r.worker` is out of the run (the reader adds its groups)."""
    store.write_json(
        LAYOUT.reader_retired(r.worker),
        {"worker": r.worker, "version": r.version, "failures": r.failures, "error": r.error, "time": time.time()},
    )


def retired_groups(store: Store) -> dict[str, int]:
    """worker -> the groups it held when it stopped, for each retired reader that has stopped (its
    record holds `groups`); a file that is not a small JSON record of the expected fields is ignored."""
    out: dict[str, int] = {}
    for rel in store.find(LAYOUT.readers_retired_dir, ".json")[:MAX_REPORTS]:
        try:
            d = json.loads(store.read_bytes(rel, SMALL_JSON_BYTES))
            worker, groups = str(d["worker"])[:100], d["groups"]
        except (FileNotFoundError, ValueError, RecursionError, KeyError, TypeError):
            continue
        if isinstance(groups, int) and not isinstance(groups, bool) and groups >= 0:
            out[worker] = groups
    return out


class Reporter:
    """A reader's side. `failed(version, failures, error)` writes the report when due (report_due);
    at RESTART_AFTER failures in a row it calls `restart` (the reader drops the weights it keeps:
    once a run of failures); from RETIRE_AFTER on it looks, every REPORT_AFTER failures, whether the
    trainer retired it: then `retired` holds the trainer's record and `on_retired` is called.
    `loaded()` deletes the report once a version loads; `retire(groups)` completes the record once
    the reader stopped. A new reader deletes what its id's earlier process left (a report, a
    retirement). Store errors here are logged, never raised: the report is advice, the load is the
    work."""

    def __init__(
        self,
        store: Store,
        worker: str,
        restart: Callable[[], None] | None = None,
        on_retired: Callable[[], None] | None = None,
    ):
        self.store, self.worker, self.reported = store, worker, True
        self.restart, self.on_retired = restart, on_retired
        self.restarts = 0
        self.retired: dict[str, Any] | None = None
        try:  # a retirement of this id's earlier process (an earlier attempt): this one starts afresh
            store.delete(LAYOUT.reader_retired(worker))
        except Exception as exc:  # noqa: BLE001 - the trainer only counts retirements it decided itself
            log.warning("%s: deleting an earlier retirement failed: %s", worker, exc)
        self.loaded()  # a report left by this id's earlier process (a restart) is stale now

    def failed(self, version: int, failures: int, error: BaseException) -> None:
        if self.retired is not None:
            return
        if failures == RESTART_AFTER and self.restart is not None:
            self._restart(version, error)
        if report_due(failures):
            try:
                report(self.store, self.worker, version, failures, str(error))
                self.reported = True
            except Exception as exc:  # noqa: BLE001 - written again when next due
                log.warning("%s: reporting weights v%d failed: %s", self.worker, version, exc)
        if failures >= RETIRE_AFTER and failures % REPORT_AFTER == 0:
            self._look_for_retirement()

    def _restart(self, version: int, error: BaseException) -> None:
        log.warning(
            "%s: weights v%d failed to load %d times in a row (%s): restarting the loader, its cache cleared",
            *(self.worker, version, RESTART_AFTER, error),
        )
        try:
            self.restart()  # type: ignore[misc]
            self.restarts += 1
        except Exception as exc:  # noqa: BLE001 - the loads go on; the trainer retires the reader if they fail
            log.warning("%s: restarting the loader failed: %s", self.worker, exc)

    def _look_for_retirement(self) -> None:
        try:
            record = json.loads(self.store.read_bytes(LAYOUT.reader_retired(self.worker), SMALL_JSON_BYTES))
        except FileNotFoundError:
            return
        except Exception as exc:  # noqa: BLE001 - looked for again in REPORT_AFTER failures
            log.warning("%s: reading its retirement failed: %s", self.worker, exc)
            return
        self.retired = record if isinstance(record, dict) else {"worker": self.worker}
        log.error("%s: retired by the trainer (weights v%s verifies in the store): stopping", self.worker,
                  self.retired.get("version", "?"))  # fmt: skip
        if self.on_retired is not None:
            self.on_retired()

    def retire(self, groups: int) -> None:
        """The reader stopped holding `groups` groups (their admission goes to the other workers);
        its report is deleted: the retirement says it all."""
        try:
            self.store.write_json(
                LAYOUT.reader_retired(self.worker), {**(self.retired or {}), "worker": self.worker, "groups": groups}
            )
            clear(self.store, self.worker)
        except Exception as exc:  # noqa: BLE001 - the others then keep their own shares: slower, not wrong
            log.warning("%s: recording its retirement failed: %s", self.worker, exc)

    def loaded(self) -> None:
        if not self.reported:
            return
        try:
            clear(self.store, self.worker)
            self.reported = False
        except Exception as exc:  # noqa: BLE001 - deleted at the next load
            log.warning("%s: deleting its weights report failed: %s", self.worker, exc)
