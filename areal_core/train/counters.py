"""The trainer's counters: what it trained, dropped and refused, saved with every checkpoint
(`checkpoint.TrainerState.counters`) and written into DONE."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class TrainerCounters:
    trained_samples: int = 0
    dropped_samples: int = 0  # a token older than v − η when the batch was taken (the hard bound)
    abandoned_samples: int = 0  # a token of a published version outside the trainer's lineage
    duplicate_samples: int = 0  # already consumed under another shard name (a copied shard)
    quarantined_shards: int = 0  # a graded shard that did not parse, moved to quarantine/
    filtered_groups: int = 0  # DAPO's dynamic sampling: groups whose rewards were all equal
    discarded_groups: int = 0  # groups that left the buffer untrained (given back to admission)
    skipped_samples: int = 0  # every reward function returned None (TRL's "not applicable"): not trained on

    @classmethod
    def from_json(cls, data: dict | None) -> TrainerCounters:
        """From a checkpoint's or DONE's `counters` (an older checkpoint may lack keys; unknown
        keys are refused, so a typo cannot be restored as a silent zero)."""
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown trainer counters {unknown}; known: {sorted(known)}")
        return cls(**{k: int(v) for k, v in data.items()})

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)
