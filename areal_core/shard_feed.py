"""The new shards of one trajectory layer, listed from a cursor per worker folder, so a poll costs
what is new, not the run (a run of 100k shards is 100 LIST pages a poll when listed whole).

Writers name shards `{worker}/{seq:08d}.arrow` with per-worker sequence numbers. Per worker
folder the feed keeps a floor f: every seq ≤ f has been handled by the caller (or will never
exist), and lists only the paths after shard f (`Store.find_after`: S3's StartAfter). The floor
rises through handled sequence numbers one by one, so a shard that lands late, after a higher one
(two reward workers grading one rollout worker's shards), is still found: the floor waits below
it. A missing number the caller's `gap` rule calls permanent (no such shard can come any more) is
stepped over; until then the listing costs the shards above the floor. Names that are not
sequence numbers (copies: 'copy-of-1.arrow') are listed every poll and returned once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from areal_core.layout import LAYOUT
from areal_core.store import Store

SUFFIX = ".arrow"


def ungraded_gaps(store: Store) -> Callable[[str, int, int], set[int]]:
    """The graded layer's gap rule: a graded seq can never appear when its ungraded shard is not
    there (never written, or quarantined by a reward worker) while a later one is; one listing
    of the worker's ungraded folder from `lo`."""

    def gaps(worker: str, lo: int, hi: int) -> set[int]:
        folder = LAYOUT.shard_dir("ungraded", worker)
        after = LAYOUT.shard_in(folder, lo - 1) if lo > 0 else None
        present = {LAYOUT.shard_seq(p) for p in store.find_after(folder, after, SUFFIX)}
        return {s for s in range(lo, hi + 1) if s not in present}

    return gaps


class ShardFeed:
    """`poll()` returns the shards of `layer_dir` (e.g. LAYOUT.graded_dir) not handled yet;
    `handled(rel)` records one; `handled` at construction: those already handled (a restart).
    `gaps(worker, lo, hi)`: which missing seqs in lo..hi, below a handled one, can never appear
    (default: all of them, as a layer written in order by one writer per worker has it)."""

    def __init__(
        self,
        store: Store,
        layer_dir: str,
        handled: Iterable[str] = (),
        gaps: Callable[[str, int, int], set[int]] | None = None,
    ):
        self.store, self.layer_dir = store, layer_dir
        self.gaps = gaps or (lambda worker, lo, hi: set(range(lo, hi + 1)))
        self.floor: dict[str, int] = {}  # worker -> every seq ≤ it handled (absent: none yet)
        self.above: dict[str, set[int]] = {}  # worker -> handled seqs above its floor
        self.named: set[str] = set()  # handled shards whose names are not sequence numbers
        for rel in handled:
            self.handled(rel, advance=False)
        for worker in list(self.above):
            self._advance(worker)

    def poll(self) -> list[str]:
        """The shards not handled yet, sorted per worker folder."""
        out = []
        for worker in self.store.listdir(self.layer_dir):
            folder = f"{self.layer_dir}/{worker}"
            floor = self.floor.get(worker)
            after = None if floor is None else LAYOUT.shard_in(folder, floor)
            for rel in self.store.find_after(folder, after, SUFFIX):
                if not self.is_handled(rel):
                    out.append(rel)
            if self.above.get(worker):
                self._advance(worker)
        return out

    def is_handled(self, rel: str) -> bool:
        worker, seq = self._parse(rel)
        if seq is None:
            return rel in self.named
        return seq <= self.floor.get(worker, -1) or seq in self.above.get(worker, ())

    def handled(self, rel: str, advance: bool = True) -> None:
        worker, seq = self._parse(rel)
        if seq is None:
            self.named.add(rel)
            return
        if seq > self.floor.get(worker, -1):
            self.above.setdefault(worker, set()).add(seq)
            if advance:
                self._advance(worker)

    def floors(self) -> dict[str, int]:
        """worker -> its floor (every seq up to it handled)."""
        return dict(self.floor)

    def _advance(self, worker: str) -> None:
        """Raise the floor through handled numbers, and over missing ones the gap rule calls
        permanent while a handled one lies above them (one call of the rule per advance)."""
        above = self.above.get(worker, set())
        floor = self.floor.get(worker, -1)
        if not above:
            return
        top = max(above)
        missing = [s for s in range(floor + 1, top) if s not in above] if top - floor <= 1 << 20 else []
        gone = self.gaps(worker, missing[0], missing[-1]) if missing else set()
        while above:
            nxt = floor + 1
            if nxt in above:
                above.discard(nxt)
            elif nxt not in gone:
                break
            floor = nxt
        if floor >= 0:
            self.floor[worker] = floor

    def _parse(self, rel: str) -> tuple[str, int | None]:
        worker = rel[len(self.layer_dir) + 1 :].split("/", 1)[0]
        return worker, LAYOUT.shard_seq(rel)
