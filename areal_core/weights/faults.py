"""Versions a reader cannot load, reported to the trainer, which repairs them or stops the run.

A corrupted newest version (bytes flipped in the store, a broken delta chain) used to stall a run
without an error: the rollout workers kept their old version and retried the bad one at every
poll; under the staleness bound they could not start new groups, and the trainer waited for
samples that never came.

Now:
- a reader (`WeightWatcher`, a rollout worker's first load, a proxy following a run) that fails
  `REPORT_AFTER` times in a row (across versions: a broken delta chain fails each newer one)
  writes `weights_faults/{worker}.json` (`report`): the newest version it tried, its failures in
  a row and the error; it deletes the report once it loads a version (`clear`);
- the trainer, while it waits for a batch, reads the reports (`reports`, size-limited and
  untrusted: a report of a version newer than the trainer's is ignored) and decides with
  `RepairPolicy.decide`: when the version fails the trainer's own check (`verify_version`), it is
  republished from the trainer's weights, which are that version's weights, as a full snapshot
  (no delta base to depend on); after `MAX_REPAIRS` republications that still fail, or when the
  version verifies in the store but a reader still fails it `STOP_AFTER` times in a row, the run
  stops with a `VersionUnloadable` naming the version, the worker and the error.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from areal_core.layout import LAYOUT, BadName
from areal_core.store import SMALL_JSON_BYTES, Store, UnreadableObject
from areal_core.weights import DELTA_FILE, WEIGHTS_FILE, WeightsError
from areal_core.weights.reader import MAX_MANIFEST_BYTES, load_weights_bytes, read_manifest, read_version_file

REPORT_AFTER = 3  # failures in a row of one version before a reader reports it
STOP_AFTER = 24  # failures in a row (a report is due then) of a version that verifies in the store: stop
MAX_REPAIRS = 2  # republications of one version that may still fail their check before the run stops
MAX_REPORTS = 256  # reports read per check: a flood of files cannot make a check unbounded

log = logging.getLogger("areal.weights")


class VersionUnloadable(RuntimeError):
    """The trainer's newest version cannot be loaded by its readers and cannot be repaired."""


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


@dataclass
class RepairPolicy:
    """The trainer's side (module docstring). `decide(version, reports, verify)` returns "repair",
    "wait" or raises VersionUnloadable; `repaired(version)` counts a republication. A report only
    stops the run once it has grown while this trainer watched (`first_seen`): one left by a reader
    of an earlier attempt, or a file written once by hand, never does."""

    repairs: dict[int, int] = field(default_factory=dict)
    first_seen: dict[str, tuple[int, int]] = field(default_factory=dict)  # worker -> (version, failures)

    def decide(self, version: int, found: list[Report], verify: Any) -> str:
        for r in found:
            self.first_seen.setdefault(r.worker, (r.version, r.failures))
        # a report of an older version counts too: the reader tries the newest next, and a delta
        # chain broken below it fails that one as well (verify says whether it does)
        failing = [r for r in found if r.version <= version and r.failures >= REPORT_AFTER]
        if not failing:
            return "wait"
        worst = max(failing, key=lambda r: (r.version, r.failures))
        error = verify(version)
        if error is not None:
            if self.repairs.get(version, 0) >= MAX_REPAIRS:
                raise VersionUnloadable(
                    f"weights v{version} still fails its check after {MAX_REPAIRS} republications "
                    f"({error}); {worst.worker} reports {worst.failures} failures: {worst.error}"
                )
            return "repair"
        live = [r for r in failing if r.version == version and self.first_seen[r.worker] != (r.version, r.failures)]
        stuck = [r for r in live if r.failures >= STOP_AFTER]
        if stuck:
            r = stuck[0]
            raise VersionUnloadable(
                f"weights v{version} passes its check in the store but {r.worker} failed to load it "
                f"{r.failures} times in a row: {r.error}"
            )
        return "wait"

    def repaired(self, version: int) -> None:
        self.repairs[version] = self.repairs.get(version, 0) + 1


class Reporter:
    """A reader's side: `failed(version, failures, error)` writes the report when due (report_due);
    `loaded()` deletes it once a version loads. A new reader deletes what its id's earlier process
    left. Store errors here are logged, never raised: the report is advice, the load is the work."""

    def __init__(self, store: Store, worker: str):
        self.store, self.worker, self.reported = store, worker, True
        self.loaded()  # a report left by this id's earlier process (a restart) is stale now

    def failed(self, version: int, failures: int, error: BaseException) -> None:
        if not report_due(failures):
            return
        try:
            report(self.store, self.worker, version, failures, str(error))
            self.reported = True
        except Exception as exc:  # noqa: BLE001 - written again when next due
            log.warning("%s: reporting weights v%d failed: %s", self.worker, version, exc)

    def loaded(self) -> None:
        if not self.reported:
            return
        try:
            clear(self.store, self.worker)
            self.reported = False
        except Exception as exc:  # noqa: BLE001 - deleted at the next load
            log.warning("%s: deleting its weights report failed: %s", self.worker, exc)
