"""The staleness contract as pure functions (no I/O).

Admission (AReaL): with B groups a batch, bound η and newest loaded version v, the rollout
side may have started at most (v + η + 1)·B + D groups in all, where D counts the groups the
trainer discarded without training them (DAPO's all-equal groups, hard-bound drops): like
AReaL's StalenessManager, only groups that can still be trained hold admission. Without D, a
trainer that filters groups waits for a refill that admission never starts. A worker w of W
owns its share; a worker taken out of the run (weights/faults.py) keeps the groups it held and
the live workers share the rest.

Hard bound (checked by the trainer when consuming): the step that produces version v+1
trains only on tokens whose version is >= v − η.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping


def admission_capacity(version: int, eta: int, batch_groups: int, discarded: int = 0) -> int:
    """Total groups the whole rollout side may have started: (v + η + 1)·B + D (D: discarded groups)."""
    return (version + eta + 1) * batch_groups + discarded


def worker_share(total: int, worker_index: int, num_workers: int) -> int:
    """Worker `worker_index`'s part of `total`, splitting the remainder over the first workers."""
    base, rest = divmod(total, num_workers)
    return base + (1 if worker_index < rest else 0)


def live_worker_share(total: int, worker_index: int, num_workers: int, retired: Mapping[int, int]) -> int:
    """Worker w's part of `total` when the workers in `retired` (index -> the groups it held when it
    stopped) left the run: theirs stays theirs, the rest is split among the live workers,
    `worker_share(total − Σ retired, rank of w among the live, W − |retired|)`."""
    gone = {i: n for i, n in retired.items() if 0 <= i < num_workers and i != worker_index}
    if not gone:
        return worker_share(total, worker_index, num_workers)
    live = [i for i in range(num_workers) if i not in gone]
    return worker_share(max(0, total - sum(gone.values())), live.index(worker_index), len(live))


def groups_admissible(
    started: int,
    version: int,
    eta: int,
    batch_groups: int,
    worker_index: int,
    num_workers: int,
    discarded: int = 0,
    retired: Mapping[int, int] | None = None,
) -> int:
    """How many more groups worker `worker_index` may start now (>= 0); `retired`: live_worker_share."""
    total = admission_capacity(version, eta, batch_groups, discarded)
    return max(0, live_worker_share(total, worker_index, num_workers, retired or {}) - started)


def sessions_admissible(written: int, settled: int, eta: int, batch_rows: int) -> int:
    """How many more live sessions' rows a serving proxy may write before the trainer catches up:
    (η + 1)·B·G − (written − settled), at least 0.

    The admission rule above restated for sessions, which no worker starts in groups: with
    `settled` the proxy's rows the trainer has trained, dropped or left out, `written − settled`
    rows wait, and AReaL's (v + η + 1)·B groups started with v·B trained and D discarded is
    exactly (η + 1)·B waiting. A row is settled whatever becomes of it, so a dropped session
    gives its place back and the trainer, which waits for B·G rows, is never starved."""
    return max(0, (eta + 1) * batch_rows - (written - settled))


def min_allowed_version(trainer_version: int, eta: int) -> int:
    """Oldest token version the step producing `trainer_version + 1` may train on: v − η."""
    return trainer_version - eta


def is_fresh(sample_min_version: int, trainer_version: int, eta: int) -> bool:
    return sample_min_version >= min_allowed_version(trainer_version, eta)


def staleness_histogram(token_versions: Iterable[int], trainer_version: int) -> dict[int, int]:
    """Count of trained tokens by staleness (trainer version − token version)."""
    return dict(sorted(Counter(trainer_version - v for v in token_versions).items()))
