"""Version numbers after a trainer restart: never publish different weights under a used number.

Rollout tokens carry the number of the weights that sampled them, so `weights/v{N}` must mean
one set of weights for the whole run. The trainer checkpoints before it publishes, but with
`train.checkpoint_every = k > 1` it publishes k − 1 versions after each checkpoint without one.
A trainer that dies there restarts from checkpoint version M while the store already holds
published versions up to N > M, whose weights (M+1..N) it can no longer reproduce.

Resume rule (pure, no I/O here; the trainer applies it):

    newest N ≤ M  →  continue at M (republish v{M} if LATEST does not name it: same bytes)
    newest N > M  →  publish the restored weights as v{N+1} and continue numbering from there;
                     M+1..N are *abandoned*: outside the trainer's lineage, recorded in the
                     trainer state, and any sample holding a token of an abandoned version is
                     dropped before training (counted as `abandoned_samples`, logged per step).

The hard staleness bound stays the numeric one (`version ≥ v − η`). After a jump the numeric
distance to restored-lineage tokens (≤ M) exceeds their true distance, so the rule only drops
more, never trains a token staler than η updates.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_core.layout import LAYOUT
from areal_core.protocol import Sample
from areal_core.store import Store


@dataclass(frozen=True)
class Resume:
    version: int  # the number the restored weights are published under and training continues from
    publish: bool  # publish them now (not yet, or not as LATEST)
    abandoned: tuple[int, int] | None  # inclusive range of published versions outside the lineage


def newest_published(store: Store) -> int | None:
    """The highest version any rollout worker may have loaded: LATEST, or a higher version whose
    MANIFEST.json made it complete (a publish that died between MANIFEST and LATEST)."""
    found = [store.latest_version()]
    for name in store.listdir(LAYOUT.weights_root):
        v = LAYOUT.weights_version(name)
        if v is not None and store.exists(LAYOUT.manifest(v)):
            found.append(v)
    versions = [v for v in found if v is not None]
    return max(versions) if versions else None


def resume_version(restored: int, newest: int | None, latest: int | None) -> Resume:
    """Where a trainer whose state holds version `restored` continues, given the newest published
    version and the one LATEST names (see the module docstring)."""
    if newest is None or newest <= restored:
        return Resume(restored, latest != restored, None)
    return Resume(newest + 1, True, (restored + 1, newest))


def holds_version_in(sample: Sample, ranges: list[list[int]] | list[tuple[int, int]]) -> bool:
    """True when a policy-produced token of `sample` carries a version inside one of `ranges`."""
    if not ranges:
        return False
    produced = {v for v, m in zip(sample.versions, sample.loss_mask) if m}
    return any(lo <= v <= hi for v in produced for lo, hi in ranges)
