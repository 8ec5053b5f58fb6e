"""Where every row of a finished run went, from the store's records alone (issue 54).

    written    the identities (`Sample.identity()`) in the run's ungraded and graded shards
    trained    the audit records' samples (trainer/trained/step-{N}.json)
    dropped    the drop records (trainer/drops/step-{N}.json, train/drops.py)
    untrained  at the end: the final checkpoint's pending samples, the graded shards it had not
               consumed, and the rows never graded
    lost       = |written − trained − dropped − untrained|

No counter enters: a row the trainer dropped without a record is lost here, so a count cannot hide
a loss. Besides, what was settled twice: a row trained twice, dropped twice, or both dropped and
trained (a `duplicate` drop names a copy of a row settled elsewhere, so it is left out of these).
"""

from __future__ import annotations

from collections import Counter

from areal_core.layout import LAYOUT
from areal_core.protocol import ShardError, decode_shard
from areal_core.store import Store
from areal_core.train import checkpoint
from areal_core.train.drops import read_drops
from areal_core.train.sources import record_ids


def shard_identities(store: Store, prefix: str) -> tuple[dict[str, set[str]], int]:
    """({shard: its rows' identities}, shards that do not parse) under `prefix`."""
    out: dict[str, set[str]] = {}
    unreadable = 0
    for rel in store.find(prefix, ".arrow"):
        try:
            out[rel] = {s.identity() for s in decode_shard(store.read_bytes(rel))}
        except ShardError:
            unreadable += 1
    return out, unreadable


def final_untrained(store: Store, graded: dict[str, set[str]]) -> set[str]:
    """The rows the final checkpoint (the one at DONE's step) left untrained: its pending samples
    and the rows of the graded shards it had not consumed. ValueError for a run without one."""
    done = store.read_json(LAYOUT.done) if store.exists(LAYOUT.done) else None
    steps = checkpoint.committed_steps(store)
    if done is None or not steps or steps[-1] != done["step"]:
        raise ValueError(f"{store.uri}: no committed checkpoint at the step of DONE ({steps[-1:] or 'none'})")
    state = store.read_json(LAYOUT.checkpoint_file(steps[-1], checkpoint.STATE_FILE))
    raw = store.read_bytes(LAYOUT.checkpoint_file(steps[-1], checkpoint.PENDING_FILE))
    pending = {s.identity() for s in decode_shard(raw)} if raw else set()
    consumed = set(state.get("consumed", []))
    return pending.union(*(ids for rel, ids in graded.items() if rel not in consumed))


def row_accounting(store: Store) -> dict:
    """Every row the run wrote: trained, dropped with a record, or untrained at the end; `lost`
    the rest (module docstring). A finished run only (DONE and its final checkpoint)."""
    graded, bad_graded = shard_identities(store, LAYOUT.graded_dir)
    ungraded, bad_ungraded = shard_identities(store, LAYOUT.ungraded_dir)
    graded_ids = set().union(*graded.values())
    written = graded_ids.union(*ungraded.values())
    trained = [i for rel in store.find(LAYOUT.trained_dir, ".json") for i in record_ids(store.read_json(rel))]
    drops = read_drops(store)
    dropped = {f"{d['worker']}/{d['sample_id']}" for d in drops}
    settled = Counter(f"{d['worker']}/{d['sample_id']}" for d in drops if d["reason"] != "duplicate")
    untrained = final_untrained(store, graded) | (written - graded_ids)
    lost = written - set(trained) - dropped - untrained
    return {
        "written": len(written),
        "trained": len(trained),
        "dropped": len(drops),
        "dropped_by_reason": dict(Counter(d["reason"] for d in drops)),
        "untrained_at_end": len(untrained),
        "lost": len(lost),
        "lost_examples": sorted(lost)[:5],
        "trained_twice": sum(n - 1 for n in Counter(trained).values()),
        "dropped_twice": sum(n - 1 for n in settled.values()),
        "dropped_and_trained": len(settled.keys() & set(trained)),
        "unreadable_shards": bad_graded + bad_ungraded,
    }
