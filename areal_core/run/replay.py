"""Replay: train again on a run's stored graded samples, in the order its trainer consumed them,
under the run's own config or another one, into a new run root.

    python -m areal_core.run.replay RUN_URI --into NEW_URI [--set algo.loss=gspo --set train.lr=1e-4] [--layer NAME]

`--layer NAME` takes the samples (their rewards) from a committed re-graded layer
(reward/regrade.py: trajectories/regraded/NAME/) instead of the graded one: retrain on the run's
samples under a fixed or new reward without generating again.

What determines a step, and where the replay takes it from:
- the samples and their order: the audit record trainer/trained/step-N.json (`samples` and
  `sample_workers`, in the order the step trained them), looked up in the run's graded shards: rewards, behaviour
  log-probs and versions as stored;
- the weights the run started from: its init_model, copied into the new root (the reference
  model and a critic start from it too); AdamW starts fresh from them, as the run's trainer did;
- the learning rate of step N: the schedule over `train.steps` (the run's, unless overridden);
- π_prox: the replaying trainer's own parameters before each update, as in the run;
- the RNG: torch seeded with `seed` before the model loads, as the trainer does (the tiny Qwen2
  has no dropout; sampling happened in the rollout workers, whose output is what is replayed);
- threads: `threads_per_role`, as the trainer role (another count reorders float sums);
- each step's trainer version (the hard bound, staleness): the record's `trainer_version`.
Nothing is published and no checkpoint is written; the new root gets the audit records,
trainer/metrics.jsonl, final_model/, DONE and lineage/replay.json (the source, the overrides,
and the largest relative difference of each step's loss and grad-norm from the run's).

One step implementation: the replay is the trainer (train/trainer.py) fed the recorded batches
(`RecordedBatches`) with a sink that publishes and checkpoints nothing (`NullSink`). With the
run's config and seed the per-step loss and grad-norm match the run's
(tests/test_replay.py). Under other settings (`--set`): algo.*, train.* (lr, schedule, η,
minibatches, clipping ...), seed, eval, tracking. The model, the task, the rollout settings (the
behaviour distribution: rollout.temperature is the trainer's too) and train.batch_groups are
fixed by the stored samples and refused. A smaller η drops (and counts) recorded samples beyond
it; DAPO's dynamic sampling filters recorded groups; a step left without groups is skipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from areal_core.context import load_run_config, set_threads
from areal_core.events import EventLog
from areal_core.forks import read_fork
from areal_core.layout import LAYOUT
from areal_core.protocol import Sample, ShardError, read_shard
from areal_core.run.derived import DerivedRunError, begin, copy_base, derived_config, fresh_root
from areal_core.store import Store
from areal_core.train.parts import load_parts
from areal_core.train.sinks import NullSink
from areal_core.train.sources import RecordedBatches, record_ids
from areal_core.train.trainer import Trainer

log = logging.getLogger("areal.replay")

FIXED = ("model.", "task.", "sft.", "rollout.", "agent.", "reward.", "train.batch_groups")
COMPARED = ("loss", "grad_norm")


def compare(rec: dict, metrics: dict[str, float]) -> dict[str, float]:
    """This step's loss and grad-norm next to the run's, with |a − b| / max(|b|, 1e-12)."""
    out = {"step": rec["step"], "train_s": metrics["train_s"]}
    recorded = rec.get("metrics", {})
    for k in COMPARED:
        out[k] = metrics[k]
        if k in recorded:
            out[f"run_{k}"] = recorded[k]
            out[f"{k}_rel_diff"] = abs(metrics[k] - recorded[k]) / max(abs(recorded[k]), 1e-12)
    return out


def train_recorded(
    store: Store, cfg: Any, records: list[dict], lookup: dict[str, Sample], **trainer_args: Any
) -> dict[str, Any]:
    """The trainer on `store`'s init_model fed each record's batch (screened by this config's η and
    dynamic sampling) at the record's trainer version, publishing nothing; then the final model and
    DONE. Returns the per-step comparison with the records' metrics."""
    t0 = time.time()
    events = EventLog(None, "trainer", "0")
    source = RecordedBatches(records, lookup, cfg, events)
    steps: list[dict] = []
    parts = load_parts(store.url(LAYOUT.init_model), cfg)
    trainer = Trainer(
        parts,
        source,
        NullSink(),
        store,
        cfg,
        events=events,
        on_step=lambda batch, metrics: steps.append(compare(batch.record, metrics)),
        **trainer_args,
    )
    trainer.fit()
    worst = {k: max((s[f"{k}_rel_diff"] for s in steps if f"{k}_rel_diff" in s), default=None) for k in COMPARED}
    return {
        "per_step": steps,
        "skipped": source.skipped,
        "max_rel_diff": worst,
        "train_s": sum(s["train_s"] for s in steps),
        "wall_s": time.time() - t0,
    }


def load_records(store: Store) -> list[dict]:
    """The run's audit records, steps 0..N-1 without a gap; DerivedRunError otherwise."""
    steps = sorted(s for name in store.listdir(LAYOUT.trained_dir) if (s := LAYOUT.trained_step(name)) is not None)
    if not steps:
        raise DerivedRunError(f"{store.uri} has no audit records ({LAYOUT.trained_dir}/): it trained no step")
    if steps != list(range(len(steps))):
        missing = sorted(set(range(steps[-1] + 1)) - set(steps))
        raise DerivedRunError(f"{store.uri}: audit records of steps {missing[:10]} are missing; cannot replay")
    return [store.read_json(LAYOUT.trained_record(s)) for s in steps]


def graded_samples(store: Store, wanted: set[str], by_identity: bool, layer: str = "graded") -> dict[str, Sample]:
    """The wanted samples from the run's graded layer (or a committed re-graded one,
    reward/regrade.py), by identity (or sample id for records older than `sample_workers`);
    DerivedRunError naming the first ones missing."""
    try:
        folder = LAYOUT.layer_dir(layer)
    except ValueError as exc:
        raise DerivedRunError(str(exc)) from None
    if layer == "ungraded" or (layer not in LAYOUT.base_layers and not store.exists(LAYOUT.committed(folder))):
        raise DerivedRunError(f"{store.url(folder)} is not a graded layer (a committed re-grade or 'graded')")
    found: dict[str, Sample] = {}
    for rel in store.find(folder, ".arrow"):
        try:
            samples = read_shard(store, rel)
        except ShardError:
            continue  # the run quarantines such a shard; nothing of it was trained
        for s in samples:
            key = s.identity() if by_identity else s.sample_id
            if key in wanted:
                found[key] = s
    missing = sorted(wanted - found.keys())
    if missing:
        raise DerivedRunError(
            f"{store.uri}: {len(missing)} trained samples are not in its layer {layer!r}, e.g. {missing[:3]}"
        )
    return found


def replay(run_uri: str, into: str, overrides: list[str] | None = None, layer: str = "graded") -> dict[str, Any]:
    """Replay the run at `run_uri` into the new root `into` with `overrides` (dotted key=value),
    its samples (rewards) taken from `layer`: the graded layer or a re-graded one; returns
    lineage/replay.json's content."""
    from areal_core.evaluate import greedy_accuracy
    from areal_core.prompts import load_prompts
    from areal_core.run.ownership import claim, hold, renew
    from areal_core.run.tracking import Tracker

    source = Store(run_uri)
    src_cfg = load_run_config(source)
    if read_fork(source) is not None:
        raise DerivedRunError(f"{source.uri} is a fork (it started from a checkpoint): replay its parent run")
    overrides = list(overrides or [])
    cfg = derived_config(src_cfg, overrides, into, FIXED, "a replay")
    request = {"replay": source.uri, "layer": layer, "overrides": overrides}
    store, state = fresh_root(into, source, request)
    if state == "finished":
        return store.read_json(LAYOUT.derived_result)
    records = load_records(source)[: cfg.train.steps]  # train.steps=N replays the first N steps
    ids = [i for rec in records for i in record_ids(rec)]
    lookup = graded_samples(source, set(ids), "sample_workers" in records[0], layer)
    if state == "new":
        begin(store, request)
    run_id = claim(store, cfg.lease, resume=state == "unfinished")  # a live earlier attempt is refused
    if state == "unfinished":  # an attempt that died: train again from the start
        for rel in (LAYOUT.trainer_dir, LAYOUT.final_model, LAYOUT.done, LAYOUT.events_dir, LAYOUT.status_dir):
            store.delete(rel, recursive=True)
    copy_base(source, store, cfg)
    head = {"source": source.uri, "layer": layer, "overrides": overrides, "steps": len(records), "samples": len(ids)}
    store.write_json(LAYOUT.replay_record, {**head, "state": "running"})
    set_threads(cfg.threads_per_role)
    evaluate = None
    if cfg.train.eval_every:
        prompts = load_prompts(store, "eval")[: cfg.eval.num_samples]

        def evaluate(model, tokenizer) -> float:
            return greedy_accuracy(model, tokenizer, prompts, cfg.eval.max_new_tokens, cfg.eval.batch_size)

    tracker = Tracker.create(store, cfg)
    tracker.set_tag("areal.replay.source", source.uri)
    with hold(store, cfg.lease, renew=True, run_id=run_id) as lease:
        result = train_recorded(store, cfg, records, lookup, evaluate=evaluate, tracker=tracker, guard=lease.check)
        renew(store, run_id, "done", lease.claim)
    tracker.finish()
    record = {**head, "state": "done", "source_trainer": source_trainer_time(source), **result}
    store.write_json(LAYOUT.replay_record, record)
    store.write_json(LAYOUT.derived_result, record)  # last: the replay is complete
    log.info(
        "replayed %d steps of %s into %s: max rel diff %s", len(records), source.uri, store.uri, result["max_rel_diff"]
    )
    return record


def source_trainer_time(source: Store) -> dict[str, float]:
    """The run's own trainer time: the sum of its steps' train_s (trainer/metrics.jsonl) and its
    trainer's wall time to the last step (the trainer heartbeat's elapsed_s)."""
    rows = (
        [json.loads(line) for line in source.read_text(LAYOUT.metrics).splitlines() if line]
        if source.exists(LAYOUT.metrics)
        else []
    )
    status = source.read_json(LAYOUT.status("trainer", "0")) if source.exists(LAYOUT.status("trainer", "0")) else {}
    return {"train_s": sum(r.get("train_s", 0.0) for r in rows), "elapsed_s": float(status.get("elapsed_s", 0.0))}


def replay_task(run_uri: str, into: str, overrides: str, layer: str = "graded") -> dict[str, Any]:
    """What the Flyte task returns: the new root and the comparison (overrides shell-split)."""
    from areal_core.run.pipeline import parse_overrides

    record = replay(run_uri, into, parse_overrides(overrides), layer)
    worst = record["max_rel_diff"]
    return {
        "run_uri": Store(into).uri,
        "steps": len(record["per_step"]),
        "max_loss_rel_diff": -1.0 if worst["loss"] is None else worst["loss"],
        "max_grad_norm_rel_diff": -1.0 if worst["grad_norm"] is None else worst["grad_norm"],
    }


def main(argv: list[str] | None = None) -> int:
    from areal_core.logs import setup_logging

    parser = argparse.ArgumentParser(prog="python -m areal_core.run.replay", description=__doc__.split("\n")[0])
    parser.add_argument("run_uri", help="the run root to replay")
    parser.add_argument("--into", required=True, help="a new, empty run root for the replay")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeat)")
    parser.add_argument("--layer", default="graded", help="the samples' rewards: 'graded' or a re-graded layer")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        record = replay(args.run_uri, args.into, args.set, args.layer)
    except (DerivedRunError, FileNotFoundError) as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    print(
        json.dumps(
            {k: record[k] for k in ("source", "steps", "skipped", "max_rel_diff", "train_s", "wall_s")}
            | {"into": args.into},
            default=str,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
