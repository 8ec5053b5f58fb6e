"""Fork: a new run root that continues run P from its checkpoint at step k under new settings.

    python -m areal_core.run.fork RUN_URI --step K --into NEW_URI [--set train.lr=1e-4 ...]

The child root C holds: its config (P's with the overrides), P's prompt set and initial model
(the reference model's weights), P's checkpoint step-k (weights v_k, optimizer, RNG, pending
samples, consumed identities, counters), P's trainer/metrics.jsonl (the trainer keeps the rows up
to k), the discarded-groups count at k (admission), and `lineage/parent.json` (forks.py): P's
graded shards C may still train on, by reference, and each rollout worker's cursor. Started
(run_async_rl, or the roles one by one), C's trainer restores step k and publishes v_k, its
rollout workers continue P's prompt order after P's groups on C's lineage, and the run goes on
asynchronously to `train.steps` and DONE.

Lineage: `lineage/parent.json` in C, `lineage/children/{id}.json` in P (nothing else of P is
written), and in MLflow the tags areal.fork.parent_store / parent_step / parent_run_id on C's run
and areal.fork.child.{id} on P's.

Refused, in one line, before anything is written: a step with no committed checkpoint (the
available steps are listed), unknown config keys, a child root that is P's (or inside it, or
an S3 key with '..') or holds anything but an earlier attempt of this same request,
train.steps ≤ k, overrides of what P's checkpoint fixes (model, task, SFT, seed: the weights and
the prompt order), and the GAE estimator when the checkpoint holds no critic. P may still be
running: a checkpoint it rotates away while it is copied fails the fork, never half-copied.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from typing import Any

from areal_core.context import load_run_config
from areal_core.forks import ForkRef, WorkerCursor, on_lineage, read_fork, write_fork
from areal_core.layout import LAYOUT
from areal_core.protocol import ShardError, decode_identities, read_shard
from areal_core.rollout.admission import group_index
from areal_core.run.derived import DerivedRunError, begin, copy_base, derived_config, fresh_root
from areal_core.store import Store
from areal_core.train.algorithm import required_inputs
from areal_core.train.checkpoint import SEEN_FILE, STATE_FILE, committed_steps, verify
from areal_core.train.value_head import CRITIC_FILE

FIXED = ("model.", "task.", "sft.", "seed")


def child_id(uri: str) -> str:
    """A child's name in its parent's lineage/children/: sha1 of its root URI, 12 hex digits."""
    return hashlib.sha1(Store(uri).uri.encode()).hexdigest()[:12]


def _group(sample_id: str) -> tuple[str, int] | None:
    """'rollout-0-g0000012-3' -> ('rollout-0', 12); None for an id not named by a rollout worker."""
    gid = sample_id.rsplit("-", 1)[0]
    try:
        return gid.rsplit("-g", 1)[0], group_index(gid)
    except (IndexError, ValueError):
        return None


def cursor(parent: Store, step: int, state: dict[str, Any]) -> tuple[dict[str, str], dict[str, WorkerCursor]]:
    """The graded shards the child may still train on (path -> root) and each rollout worker's
    cursor: the groups on the child's lineage (consumed by step k, from the checkpoint's
    identities, or in an unconsumed shard on the lineage) and the first free shard number."""
    consumed = set(state["consumed"])
    seen = decode_identities(parent.read_bytes(LAYOUT.checkpoint_file(step, SEEN_FILE)))
    groups: dict[str, set[int]] = {}
    for identity in seen:
        found = _group(identity.split("/", 1)[-1])
        if found is not None:
            groups.setdefault(found[0], set()).add(found[1])
    grand = read_fork(parent)  # P is itself a fork: its own references count too
    next_seq = {w: c.next_seq for w, c in grand.workers.items()} if grand else {}
    for rel in parent.find(LAYOUT.trajectories_dir, ".arrow"):
        seq = LAYOUT.shard_seq(rel)  # None for a name no writer gives ('copy-of-1.arrow'): no position
        if seq is not None:
            worker = rel.split("/")[-2]
            next_seq[worker] = max(next_seq.get(worker, 0), seq + 1)
    candidates = {rel: parent.uri for rel in parent.find(LAYOUT.graded_dir, ".arrow")}
    if grand is not None:
        candidates |= grand.shards
    shards: dict[str, str] = {}
    for rel, root in sorted(candidates.items()):
        if rel in consumed:
            continue
        try:
            samples = read_shard(Store(root), rel)
        except ShardError:
            continue
        kept = on_lineage(samples, state["version"], state.get("abandoned", []))
        if kept:
            shards[rel] = root
        for s in kept:
            found = _group(s.sample_id)
            if found is not None:
                groups.setdefault(found[0], set()).add(found[1])
    workers = {
        w: WorkerCursor(next_seq=next_seq.get(w, 0), groups=sorted(groups.get(w, set())))
        for w in sorted(set(next_seq) | set(groups))
    }
    return shards, workers


def fork(run_uri: str, step: int, into: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Make the child root `into` from run `run_uri` at checkpoint `step` with `overrides`;
    returns lineage/parent.json's content (without the shard list) and the child's URI.

    Retry-safe: the request (parent, step, overrides) is the child's first object and the result
    its last (run/derived.py); a retry of the same request continues an unfinished child (its
    frozen shard list kept) or returns the finished one's result; any other request is refused."""
    from areal_core.run.ownership import claim
    from areal_core.run.tracking import Tracker

    parent = Store(run_uri)
    pcfg = load_run_config(parent)
    overrides = list(overrides or [])
    cfg = derived_config(pcfg, overrides, into, FIXED, "a fork")
    request = {"fork": parent.uri, "step": step, "overrides": overrides}
    store, state = fresh_root(into, parent, request)
    if state == "finished":
        return store.read_json(LAYOUT.derived_result)
    steps = committed_steps(parent)
    if step not in steps:
        raise DerivedRunError(
            f"{parent.uri} has no committed checkpoint at step {step}; available steps: "
            f"{', '.join(map(str, steps)) or 'none'} (train.checkpoint_every={pcfg.train.checkpoint_every}, "
            f"train.keep_checkpoints={pcfg.train.keep_checkpoints})"
        )
    if cfg.train.steps <= step:
        raise DerivedRunError(f"train.steps ({cfg.train.steps}) must be above the fork step {step}")
    if "values" in required_inputs(cfg.algo) and not parent.exists(LAYOUT.checkpoint_file(step, CRITIC_FILE)):
        raise DerivedRunError(
            f"algo.adv_estimator=gae needs a critic, and checkpoint step {step} of {parent.uri} has none"
        )
    ref = read_fork(store) if state == "unfinished" else None  # an earlier attempt's list stays frozen
    if ref is None:
        state_k = parent.read_json(LAYOUT.checkpoint_file(step, STATE_FILE))
        shards, workers = cursor(parent, step, state_k)
        ref = ForkRef(
            parent=parent.uri,
            step=step,
            version=state_k["version"],
            shards=shards,
            workers=workers,
            abandoned=state_k.get("abandoned", []),
            parent_run_id=Tracker.attach(parent).run_id or "",
            overrides=overrides,
            created_at=time.time(),
        )
    if state == "new":
        begin(store, request)
    if not store.exists(LAYOUT.lease):  # an earlier attempt's claim is this fork's own
        claim(store, cfg.lease, resume=False)
    copy_base(parent, store, cfg)
    copy_checkpoint(parent, store, step, pcfg.train.keep_checkpoints)
    if parent.exists(LAYOUT.metrics):
        store.write_bytes(LAYOUT.metrics, parent.read_bytes(LAYOUT.metrics))
    counters = parent.read_json(LAYOUT.checkpoint_file(step, STATE_FILE))["counters"]
    store.write_json(LAYOUT.discarded_groups, {"groups": int(counters.get("discarded_groups", 0))})
    write_fork(store, ref)
    tracker = Tracker.create(store, cfg)  # an earlier attempt's MLflow run is reused
    for key, value in (("parent_store", parent.uri), ("parent_step", str(step)), ("parent_run_id", ref.parent_run_id)):
        tracker.set_tag(f"areal.fork.{key}", value)
    name = child_id(store.uri)
    Tracker.attach(parent).set_tag(f"areal.fork.child.{name}", f"{store.uri} from step {step}")
    parent.write_json(
        LAYOUT.fork_child(name),
        {
            "child": store.uri,
            "step": step,
            "version": ref.version,
            "child_run_id": tracker.run_id or "",
            "overrides": overrides,
            "created_at": ref.created_at,
        },
    )
    summary = {k: v for k, v in ref.to_json().items() if k not in ("shards", "workers")}
    result = summary | {"run_uri": store.uri, "shards": len(ref.shards), "child_run_id": tracker.run_id or ""}
    store.write_json(LAYOUT.derived_result, result)  # last: the child is complete
    return result


def copy_checkpoint(parent: Store, store: Store, step: int, keep: int) -> None:
    """Copy P's checkpoint `step` into the child; DerivedRunError when it changed meanwhile (a
    parent still running drops its older checkpoints as it writes new ones: train.keep_checkpoints),
    so that a half-deleted checkpoint never becomes the child's."""
    folder = LAYOUT.checkpoint_dir(step)
    before = parent.find(folder)
    changed = (
        f"checkpoint step {step} of {parent.uri} was removed while it was copied (the run is still "
        f"running and keeps its newest {keep}): fork a newer step"
    )
    try:
        store.copy_dir(folder, folder, source=parent)
    except FileNotFoundError:
        raise DerivedRunError(changed) from None
    if LAYOUT.committed(folder) not in before or parent.find(folder) != before or store.find(folder) != before:
        raise DerivedRunError(changed)
    problems = verify(store, step)
    if problems:
        raise DerivedRunError(f"checkpoint step {step} of {parent.uri} fails verification: {'; '.join(problems[:3])}")


def fork_task(run_uri: str, step: int, into: str, overrides: str) -> dict[str, str]:
    """What the Flyte task returns: the child's root and initial model (overrides shell-split)."""
    from areal_core.run.pipeline import parse_overrides

    child = Store(fork(run_uri, step, into, parse_overrides(overrides))["run_uri"])
    return {"run_uri": child.uri, "sft_checkpoint": child.url(LAYOUT.init_model)}


def main(argv: list[str] | None = None) -> int:
    from areal_core.logs import setup_logging

    parser = argparse.ArgumentParser(prog="python -m areal_core.run.fork", description=__doc__.split("\n")[0])
    parser.add_argument("run_uri", help="the run root to fork")
    parser.add_argument("--step", type=int, required=True, help="a step with a committed checkpoint")
    parser.add_argument("--into", required=True, help="a new, empty run root for the child")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeat)")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        out = fork(args.run_uri, args.step, args.into, args.set)
    except (DerivedRunError, FileNotFoundError) as exc:
        print(f"fork: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
