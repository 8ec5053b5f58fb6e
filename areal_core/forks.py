"""A forked run root's reference to its parent: `lineage/parent.json`, written by `run/fork.py`,
read by the trainer (shards by reference) and the rollout workers (the prompt cursor); and the
roots a run derives from (`image_roots`: its own, a fork's parents, a replay's source).

A fork C of run P at step k holds P's checkpoint step-k (weights v_k, optimizer, pending
samples, consumed identities), its own config and this reference:

- Shards by reference: `shards` lists P's graded shards that the checkpoint had not consumed
  when C was made (a frozen list: shards P writes later are never C's), each with the root that
  holds it (P's; an ancestor's when P is itself a fork). C's trainer reads them from there,
  never writes there (a corrupt one is skipped, not quarantined), and keeps only
  the groups on C's lineage (`on_lineage`): every policy token sampled by a version ≤ v_k that
  is not in P's abandoned ranges. Tokens of P's later versions came from weights C never had.
- The prompt cursor (`workers`): C's rollout worker w continues P's worker w. Its shard numbers
  start after P's (`next_seq`), so no path of C equals a path P's checkpoint consumed or C
  references; the groups it has already started are P's groups on C's lineage (`groups`,
  counted by admission); a group index below the highest of them that is missing is generated
  again first, as after a restart (rollout/admission.py).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from areal_core.layout import LAYOUT
from areal_core.protocol import DEFAULT_LIMITS, Sample, ShardError, ShardLimits, read_shard
from areal_core.store import Store

log = logging.getLogger("areal.forks")


@dataclass
class WorkerCursor:
    next_seq: int  # the first shard number of C's worker (after every shard P's worker wrote)
    groups: list[int]  # the group indices of P's worker on C's lineage (already started)


@dataclass
class ForkRef:
    parent: str  # P's run root URI
    step: int  # the checkpoint C starts from
    version: int  # v_k: the weights of that checkpoint
    shards: dict[str, str]  # graded shards C may read (not consumed at step k): path -> the root holding it
    workers: dict[str, WorkerCursor]
    abandoned: list[list[int]] = field(default_factory=list)  # P's abandoned ranges at step k
    parent_run_id: str = ""  # P's MLflow run, when it had one
    overrides: list[str] = field(default_factory=list)  # C's settings over P's
    created_at: float = 0.0

    @classmethod
    def from_json(cls, data: dict) -> ForkRef:
        workers = {w: WorkerCursor(**c) for w, c in data.pop("workers").items()}
        return cls(workers=workers, **data)

    def to_json(self) -> dict:
        return asdict(self)

    def unread(self, consumed: set[str]) -> list[str]:
        """The referenced shards not in `consumed` (the trainer's shards read)."""
        return [rel for rel in self.shards if rel not in consumed]

    def read_shard(self, rel: str, limits: ShardLimits = DEFAULT_LIMITS) -> list[Sample] | None:
        """The samples on C's lineage in the referenced shard `rel`; None (logged) when it does not
        parse. The root holding it (P's, or an ancestor's for a fork of a fork) is only read."""
        root = self.shards[rel]
        try:
            samples = read_shard(Store(root), rel, limits)
        except ShardError as exc:
            log.warning("referenced shard %s/%s does not parse, skipped: %s", root, rel, exc)
            return None
        return on_lineage(samples, self.version, self.abandoned)


def on_lineage(samples: list[Sample], version: int, abandoned: list[list[int]]) -> list[Sample]:
    """The samples of the groups every one of whose policy tokens has a version v with
    v ≤ `version` and lo > v or v > hi for each abandoned [lo, hi]: a group holding one token
    of other weights is left out whole (its group statistics would mix two policies)."""

    def ok(s: Sample) -> bool:
        produced = [v for v, m in zip(s.versions, s.loss_mask) if m]
        return all(v <= version and not any(lo <= v <= hi for lo, hi in abandoned) for v in produced)

    bad = {s.group_id for s in samples if not ok(s)}
    return [s for s in samples if s.group_id not in bad]


def read_fork(store: Store) -> ForkRef | None:
    """The root's fork reference; None for a root that is not a fork."""
    if not store.exists(LAYOUT.fork_parent):
        return None
    return ForkRef.from_json(store.read_json(LAYOUT.fork_parent))


def write_fork(store: Store, ref: ForkRef) -> None:
    store.write_json(LAYOUT.fork_parent, ref.to_json())


def image_roots(run: str | Store) -> list[Store]:
    """The roots whose images a run's rows may name: its own, then a fork's parents (their shards
    are read by reference) and a replay's source, recursively."""
    out, todo, seen = [], [Store.of(run)], set()
    while todo:
        store = todo.pop(0)
        if store.uri in seen:
            continue
        seen.add(store.uri)
        out.append(store)
        if (ref := read_fork(store)) is not None:
            todo.append(Store(ref.parent))
        if store.exists(LAYOUT.replay_record):
            todo.append(Store(store.read_json(LAYOUT.replay_record)["source"]))
    return out
