"""Online mode: each ended proxy session is written as one shard under the proxy's worker id, its
images (a VLM's) stored content-addressed under the run root first (vlm/images.py: put_image)."""

from __future__ import annotations

import threading

from areal_core.events import EventLog
from areal_core.forks import read_fork
from areal_core.layout import LAYOUT
from areal_core.protocol import Sample, encode_shard
from areal_core.store import Store
from areal_core.vlm.images import put_image
from areal_core.writer_claim import WriterClaim

MAX_TAKEN = 10_000  # names found taken in a row before a write gives up


class ShardWriter:
    """Writes each finished session as one shard under the proxy's worker id (online mode).

    Rows with a reward go to the graded stage, others to the ungraded stage for the
    reward workers. Sequence numbers continue after the worker's existing shards (in a fork, after
    the parent's too: `lineage` names where the parent's worker stopped). The writer claims its
    worker id first (writer_claim.py: a second live writer of the id is refused, WriterInUse), and
    creates each shard only under a name no shard has (a taken name moves it to the next number,
    counted as `shard_name_taken`), so no row is ever replaced. The writer holds the proxy's event
    log (`count` records of completions and tokens); `close()` ends it and releases the claim.
    """

    def __init__(self, store: Store, worker_id: str):
        self.store, self.worker_id = store, worker_id
        self.claim = WriterClaim(store, worker_id)
        self._lock = threading.Lock()
        seqs = [
            seq
            for stage in ("graded", "ungraded")
            for p in store.find(LAYOUT.shard_dir(stage, worker_id), ".arrow")
            if (seq := LAYOUT.shard_seq(p)) is not None  # a copied or renamed shard holds no position
        ]
        cursor = fork.workers.get(worker_id) if (fork := read_fork(store)) is not None else None
        # in a fork, after every shard the parent's worker wrote: a path the parent's checkpoint consumed
        # would never be read by the fork's trainer
        self.seq = max([*seqs, (cursor.next_seq - 1) if cursor else -1]) + 1
        self.events = EventLog(store, "proxy", worker_id.rsplit("-", 1)[-1])

    def write(self, samples: list[Sample], images: dict[str, bytes] | None = None) -> list[str]:
        """Write `samples`; `images`: the bytes of the images they name, by id, stored before the
        shard so that no reader ever meets a row whose image is not there yet (it would be quarantined)."""
        if not samples:
            return []
        for sha in dict.fromkeys(i for s in samples for i in s.image_ids or []):
            if images is None or sha not in images:
                raise ValueError(f"no bytes given for image {sha} that a row names")
            put_image(self.store, images[sha])
        graded = [s for s in samples if s.reward is not None]
        ungraded = [s for s in samples if s.reward is None]
        names = []
        with self._lock:
            for stage, rows in (("graded", graded), ("ungraded", ungraded)):
                if rows:
                    with self.events.span("shard_write"):
                        names.append(self._create(stage, encode_shard(rows)))
        self.events.count(completions=len(samples), tokens=sum(sum(s.loss_mask) for s in samples))
        return names

    def _create(self, stage: str, data: bytes) -> str:
        """Write `data` as the next free shard of `stage`; its name."""
        for _ in range(MAX_TAKEN):
            name = LAYOUT.shard(stage, self.worker_id, self.seq)
            self.seq += 1
            if self.store.write_if(name, data, None):
                return name
            self.events.emit("shard_name_taken", path=name)
        raise RuntimeError(f"{MAX_TAKEN} shard names of {self.worker_id} in a row were taken: another writer?")

    def close(self) -> None:
        self.events.close()
        self.claim.release()
