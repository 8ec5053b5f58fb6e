"""One rollout worker's admission: which group starts next, on which prompt, and whether it
may start now.

- Capacity: the pure rule of `staleness.groups_admissible`, `(v + η + 1)·B + D` groups for
  the whole rollout side, this worker owning its share.
- Discarded credit D (groups the trainer discarded untrained give their admission back): read
  once at start, then re-read only while blocked, at most once every `reread_every_s` (five
  polls), so a blocked worker costs the store one small read per five polls, not one per poll.
  The workers taken out of the run (`read_retired`: index -> the groups each held) are read
  with it: the live workers share what the retired do not hold (`staleness.live_worker_share`).
- Prompt order: a fixed shuffle of the prompt set, interleaved across workers; the prompt of
  group g is a pure function of (seed, worker, g), so a restarted worker continues with the
  same prompts.
- Given back: a group this worker started and dropped (a bad prompt record, an empty group)
  never reaches the trainer, so it holds no admission (`give_back`), like the trainer's
  discarded groups (D); otherwise each drop would shrink the rollout side's room for good, and
  after η·B of them the trainer would wait for a batch that admission never lets start.
- Progress recovery: the next shard sequence number and the groups already written are read
  back from the worker's own ungraded shards; groups that were in flight when the worker died
  (missing below the highest written index) are started again first, so group indices end up
  without gaps or repeats.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from areal_core.forks import read_fork
from areal_core.layout import LAYOUT
from areal_core.protocol import decode_shard
from areal_core.staleness import groups_admissible
from areal_core.store import Store
from areal_core.weights.faults import retired_groups

UNLIMITED = 1 << 30  # room when admission is off (tests of the hard bound)


def prompt_order(num_prompts: int, seed: int) -> list[int]:
    """The fixed shuffle of prompt indices: `random.Random(seed·1000 + 7).shuffle(range(n))`."""
    order = list(range(num_prompts))
    random.Random(seed * 1000 + 7).shuffle(order)
    return order


def prompt_for_group(order: list[int], group: int, worker_index: int, num_workers: int) -> int:
    """Prompt index of group g of worker w of W: `order[(g·W + w) mod n]` (workers interleave)."""
    return order[(group * num_workers + worker_index) % len(order)]


def group_id(worker_id: str, group: int) -> str:
    """`rollout-0`, 12 -> `rollout-0-g0000012`."""
    return f"{worker_id}-g{group:07d}"


def group_index(gid: str) -> int:
    """The inverse of `group_id`."""
    return int(gid.rsplit("-g", 1)[1])


@dataclass
class Progress:
    """What a worker's shards say it already did: the next sequence number, the groups written."""

    next_seq: int = 0
    groups: set[int] = field(default_factory=set)


def recover_progress(store: Store, worker_id: str) -> Progress:
    """Progress from the worker's ungraded shards, up to the first shard that does not parse (a
    torn shard of ours is rewritten under the same name). In a fork, it starts from the parent's
    worker's cursor (forks.py)."""
    ref = read_fork(store)
    cursor = ref.workers.get(worker_id) if ref is not None else None
    progress = Progress(cursor.next_seq, set(cursor.groups)) if cursor is not None else Progress()
    for name in store.find(LAYOUT.shard_dir("ungraded", worker_id), ".arrow"):
        try:
            samples = decode_shard(store.read_bytes(name))
        except Exception:  # noqa: BLE001 - torn: rewritten from here on
            break
        own = f"{worker_id}-g"  # a row of another worker's groups (a copied shard) is not this worker's progress
        progress.groups.update(
            int(s.group_id[len(own) :])
            for s in samples
            if s.group_id.startswith(own) and s.group_id[len(own) :].isdigit()
        )
        seq = LAYOUT.shard_seq(name)  # None: a name no writer gives ('copy-of-1.arrow'); its groups still count
        if seq is not None:
            progress.next_seq = max(progress.next_seq, seq + 1)
    return progress


def read_retired_workers(store: Store) -> dict[int, int]:
    """Rollout worker index -> the groups it held when it stopped, of the workers taken out of the
    run (weights/faults.py); other readers (proxies) hold no groups."""
    out = {}
    for worker, groups in retired_groups(store).items():
        role, _, index = worker.rpartition("-")
        if role == "rollout" and index.isdigit():
            out[int(index)] = groups
    return out


class Admission:
    """Admission, discarded credit, prompt order and recovered progress of one rollout worker.

    `room(version)` says how many more groups may start under the newest loaded `version`;
    `start()` hands out the next group index and its prompt index and counts the group as
    started.
    """

    def __init__(
        self,
        *,
        num_prompts: int,
        seed: int,
        batch_groups: int,
        eta: int,
        worker_index: int = 0,
        num_workers: int = 1,
        enabled: bool = True,
        progress: Progress | None = None,
        read_discarded: Callable[[], int] | None = None,
        read_retired: Callable[[], dict[int, int]] | None = None,
        reread_every_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.batch_groups, self.eta, self.enabled = batch_groups, eta, enabled
        self.worker_index, self.num_workers = worker_index, num_workers
        self.order = prompt_order(num_prompts, seed)
        done = (progress or Progress()).groups
        top = max(done) + 1 if done else 0
        self._redo = [g for g in range(top) if g not in done]  # in flight when the worker died
        self._next = top
        self.first_new = top  # groups below it were started before a restart (redone first)
        self.started = len(done)
        self.given_back = 0  # started groups dropped by the worker (not in its shards: redone after a restart)
        self.read_discarded, self.reread_every_s, self.clock = read_discarded, reread_every_s, clock
        self.discarded = read_discarded() if read_discarded is not None else 0
        self.read_retired = read_retired
        self.retired = read_retired() if read_retired is not None else {}
        self._read_at = clock()

    def room(self, version: int) -> int:
        """Groups this worker may start now; while blocked, the trainer's discarded count is
        re-read at most once every `reread_every_s`."""
        if not self.enabled:
            return UNLIMITED
        held = self.started - self.given_back
        args = (held, version, self.eta, self.batch_groups, self.worker_index, self.num_workers)
        room = groups_admissible(*args, self.discarded, self.retired)
        if room == 0 and self.clock() - self._read_at >= self.reread_every_s:
            if self.read_discarded is not None:
                self.discarded = self.read_discarded()
            if self.read_retired is not None:
                self.retired = self.read_retired()
            self._read_at = self.clock()
            room = groups_admissible(*args, self.discarded, self.retired)
        return room

    def give_back(self, n: int = 1) -> None:
        """`n` started groups were dropped by the worker: they no longer hold admission."""
        if n < 0 or self.given_back + n > self.started:
            raise ValueError(f"cannot give back {n} more groups than the {self.started - self.given_back} held")
        self.given_back += n

    def prompt_index(self, group: int) -> int:
        return prompt_for_group(self.order, group, self.worker_index, self.num_workers)

    def start(self) -> tuple[int, int]:
        """(group index, prompt index) of the next group; it counts as started from now."""
        if self._redo:
            group = self._redo.pop(0)
        else:
            group, self._next = self._next, self._next + 1
        self.started += 1
        return group, self.prompt_index(group)
