"""Online retraining from live traffic: the proxy in front of a serving engine writes every
finished session to a store (online mode: `python -m areal_core.proxy --store URI`); a
scheduled run retrains on the sessions collected since the last run and registers the new
model in MLflow only when it beats the `champion` version, which it then becomes.

One run (`online_retrain`, or its two halves `retrain_candidate` then `publish_candidate`):
  1. plan: the graded session shards `trajectories/graded/{worker}/{seq}.arrow` of the sessions
     store past the cursor `online/cursor.json` ({worker: last consumed seq}; shard sequence
     numbers only grow per worker, so the cursor is a high-water mark per worker); of their rows,
     each sample once and none an earlier run trained on (by `Sample.identity()`, recorded per
     run in `online/consumed/{run}.txt.gz`: a shard copied under a new name is not retrained);
  2. start model: the `champion` version of `model_name`, else `model.path`;
  3. train: the run's one trainer (train/trainer.py) fed the rows as `SessionBatches`
     (online/session_batches.py: one pass in near-equal updates, rows regrouped by prompt,
     inadmissible rewards left out), with the run's loss (decoupled PPO by default), publishing
     nothing and raising on a non-finite parameter;
  4. evaluate the candidate and the current model on the task's held-out split with the same
     metric (`heldout_score`: agent success when `rollout.agent` is set, else greedy accuracy);
  5. register the candidate as a new version only if score_candidate > score_current + min_gain,
     and promote it to `champion` (the current model being the champion the run started from, or
     before the first registration the base model.path);
  6. move the cursor past the consumed shards and record the rows' identities (also when the
     candidate lost: those sessions were used). A run that dies before step 6 leaves the cursor
     alone, so the next run retrains on the same sessions again.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

from areal_core.layout import LAYOUT
from areal_core.logs import setup_logging
from areal_core.online.registry import aliased, download, register_if_better, store_files
from areal_core.online.session_batches import SessionBatches, admissible
from areal_core.protocol import Sample, decode_identities, encode_identities, read_shard_or_quarantine, unique
from areal_core.store import Store

log = logging.getLogger("areal.online")


# ---------------------------------------------------------------------------------------------
# The cursor
# ---------------------------------------------------------------------------------------------
def read_cursor(store: Store) -> dict[str, int]:
    """{worker id: last consumed shard sequence number}; empty before the first run."""
    return dict(store.read_json(LAYOUT.online_cursor)["workers"]) if store.exists(LAYOUT.online_cursor) else {}


def _worker_seq(rel: str) -> tuple[str, int | None]:
    return rel.rsplit("/", 2)[-2], LAYOUT.shard_seq(rel)


def new_shards(store: Store, cursor: dict[str, int]) -> list[str]:
    """Graded session shards past the cursor, oldest first per worker. A shard under a name no
    writer gives ('copy-of-1.arrow') has no position: it is read every time, and its rows that an
    earlier run trained are left out by identity (`consumed_identities`)."""
    out = []
    for rel in store.find(LAYOUT.graded_dir, ".arrow"):
        worker, seq = _worker_seq(rel)
        if seq is None or seq > cursor.get(worker, -1):
            out.append(rel)
    return sorted(out, key=lambda rel: (_worker_seq(rel)[0], _worker_seq(rel)[1] or -1, rel))


def advance(cursor: dict[str, int], shards: list[str]) -> dict[str, int]:
    out = dict(cursor)
    for rel in shards:
        worker, seq = _worker_seq(rel)
        if seq is not None:
            out[worker] = max(out.get(worker, -1), seq)
    return out


def consumed_identities(store: Store) -> set[str]:
    """The identities of every sample an earlier online run of this sessions store trained on."""
    return {
        key
        for rel in store.find(LAYOUT.online_consumed_dir, ".txt.gz")
        for key in decode_identities(store.read_bytes(rel))
    }


def write_cursor(store: Store, cursor: dict[str, int], run: str) -> None:
    prev = store.read_json(LAYOUT.online_cursor) if store.exists(LAYOUT.online_cursor) else {"runs": []}
    runs = (prev.get("runs") or [])[-99:] + [run]
    store.write_json(LAYOUT.online_cursor, {"workers": cursor, "runs": runs, "updated_at": run_stamp()})


def run_stamp(at: datetime.datetime | None = None) -> str:
    """A run id: the time `at` (default now, UTC) as YYYYmmddTHHMMSS."""
    return (at or datetime.datetime.now(datetime.UTC)).strftime("%Y%m%dT%H%M%S")


def train_candidate(start_path: str, samples: list[Sample], cfg: Any, run: Store, score: Any) -> dict[str, Any]:
    """The one trainer (train/trainer.py) on the model at `start_path`, fed `samples` as
    `SessionBatches`, publishing nothing, raising on a non-finite parameter; it writes the
    candidate to `run` (final_model/, DONE). `score(model, tokenizer)`: the held-out metric, taken
    before and after. Returns {updates, left_out, current_score, candidate_score}."""
    from areal_core.train.parts import load_parts
    from areal_core.train.sinks import NullSink
    from areal_core.train.trainer import Trainer

    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"eval_every": 0})})  # scored here
    parts = load_parts(start_path, cfg)
    source = SessionBatches(samples, cfg)
    current = score(parts.model.eval(), parts.tokenizer)
    trainer = Trainer(parts, source, NullSink(), run, cfg, check_finite=True)
    parts.model.train()
    trainer.fit()
    candidate = score(parts.model.eval(), parts.tokenizer)
    updates = trainer.state.step
    return {"updates": updates, "left_out": source.left_out, "current_score": current, "candidate_score": candidate}


# ---------------------------------------------------------------------------------------------
# The start model and the two halves of a run
# ---------------------------------------------------------------------------------------------
def _start_model(cfg: Any, model_name: str, tracking_uri: str) -> tuple[str, str]:
    """(local or fsspec path of the model to start from, its label): the champion of `model_name`
    (models:/name/N), else model.path."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    current = aliased(client, model_name) if cfg.tracking.enabled else None
    if current is not None:
        uri = f"models:/{model_name}/{current.version}"
        return download(uri, tracking_uri), uri
    if not cfg.model.path:
        raise ValueError(f"no registered version of {model_name!r} and no model.path to start online retraining from")
    return cfg.model.path, cfg.model.path


def retrain_candidate(
    config_path: str, overrides: str | list[str], sessions_uri: str, model_name: str, run_id: str = ""
) -> str:
    """Plan, train and evaluate (steps 1-4); returns the run root `<store>/online/<run_id>` that
    holds the candidate (final_model/) and online_plan.json. `sessions_uri` empty: `<store>/sessions`."""
    import torch

    from areal_core.config import load_config, to_yaml
    from areal_core.evaluate import heldout_score
    from areal_core.run.pipeline import parse_overrides
    from areal_core.run.tracking import tracking_uri as resolve_uri
    from areal_core.train.loss import check_algorithm

    cfg = load_config(config_path or None, parse_overrides(overrides))
    check_algorithm(cfg.algo)
    torch.set_num_threads(max(1, cfg.threads_per_role))
    run_id = run_id or run_stamp()
    run = Store(Store(cfg.store).url(LAYOUT.online_run(run_id)))
    sessions = Store(sessions_uri or Store(cfg.store).url(LAYOUT.sessions_dir))
    cursor = read_cursor(sessions)
    shards = new_shards(sessions, cursor)
    rows = [s for rel in shards for s in (read_shard_or_quarantine(sessions, rel) or []) if s.reward is not None]
    lo, hi = cfg.agent.reward_min, cfg.agent.reward_max
    samples = [s for s in unique(rows, consumed_identities(sessions)) if admissible(s, lo, hi)]
    uri = resolve_uri(cfg.tracking.uri)
    plan: dict[str, Any] = {
        "run_id": run_id,
        "sessions": sessions.uri,
        "model_name": model_name,
        "tracking_uri": uri if cfg.tracking.enabled else "",
        "experiment": cfg.tracking.experiment,
        "shards": shards,
        "rows": len(samples),
        "cursor_after": advance(cursor, shards),
        "trained": False,
    }
    run.write_text(LAYOUT.config, to_yaml(cfg))
    run.write_bytes(LAYOUT.online_samples, encode_identities([s.identity() for s in samples]))
    if len(samples) < 2:
        log.info("online run %s: %d new session rows, nothing to train", run_id, len(samples))
        run.write_json(LAYOUT.online_plan, plan)
        return run.uri
    start_path, start_label = _start_model(cfg, model_name, uri)
    from task_data import load_run_task

    _, held_out = load_run_task(cfg)
    records = held_out[: cfg.eval.num_samples]
    trained = train_candidate(start_path, samples, cfg, run, lambda model, tok: heldout_score(model, tok, cfg, records))
    plan.update(
        trained=True,
        start_model=start_label,
        updates=trained["updates"],
        reward_mean=sum(s.reward or 0.0 for s in samples) / len(samples),
        current_score=trained["current_score"],
        candidate_score=trained["candidate_score"],
    )
    run.write_json(LAYOUT.online_plan, plan)
    log.info(
        "online run %s: %d rows, %d updates, held-out %.4f -> %.4f",
        run_id,
        len(samples),
        trained["updates"],
        trained["current_score"],
        trained["candidate_score"],
    )
    return run.uri


def publish_candidate(run_uri: str, min_gain: float = 0.0) -> dict[str, Any]:
    """Register the candidate if it beats the current model (step 5), then move the cursor (6).
    Safe to retry: the registration is keyed by the run root, so a second call registers nothing new."""
    run = Store(run_uri)
    plan = run.read_json(LAYOUT.online_plan)
    out: dict[str, Any] = {
        "run_uri": run.uri,
        "rows": plan["rows"],
        "shards": len(plan["shards"]),
        "registered": False,
        "model_uri": "",
        "current_score": plan.get("current_score"),
        "candidate_score": plan.get("candidate_score"),
    }
    if plan["trained"] and plan["tracking_uri"]:
        reg = register_if_better(
            store_files(run, LAYOUT.final_model, drop=(LAYOUT.committed_name,)),
            plan["model_name"],
            plan["tracking_uri"],
            plan["candidate_score"],
            plan["current_score"],
            min_gain,
            experiment=plan["experiment"],
            run_name=f"online-{plan['run_id']}",
            params={"rows": plan["rows"], "shards": len(plan["shards"]), "start_model": plan["start_model"]},
            tags={"run_uri": run.uri, "sessions": plan["sessions"], "start_model": plan["start_model"]},
            key=run.uri,  # a retried task returns the version it registered before
            # the champion this run started from was scored here; any other is scored by its own tag
            score_current=lambda uri: plan["current_score"] if uri == plan["start_model"] else None,
        )
        out.update(registered=reg["registered"], model_uri=reg["model_uri"])
    if plan["shards"]:
        sessions = Store(plan["sessions"])
        sessions.write_bytes(LAYOUT.online_consumed(plan["run_id"]), run.read_bytes(LAYOUT.online_samples))
        write_cursor(sessions, plan["cursor_after"], plan["run_id"])
    run.write_json(LAYOUT.online_result, out)
    return out


def online_retrain(
    config_path: str,
    overrides: str | list[str],
    sessions_uri: str,
    model_name: str,
    run_id: str = "",
    min_gain: float = 0.0,
) -> dict[str, Any]:
    """A whole online retraining run: `retrain_candidate` then `publish_candidate`."""
    return publish_candidate(retrain_candidate(config_path, overrides, sessions_uri, model_name, run_id), min_gain)


def retrain_task(
    config_path: str, overrides: str, sessions_uri: str, model_name: str, kickoff_time: datetime.datetime | None
) -> str:
    """The `retrain_on_sessions` task: `retrain_candidate` with the schedule's kickoff time (else
    now) as the run id; returns the online run root."""
    setup_logging()
    return retrain_candidate(config_path, overrides, sessions_uri, model_name, run_stamp(kickoff_time))


def publish_task(run_uri: str, min_gain: float) -> dict[str, Any]:
    """The `register_if_better` task: `publish_candidate`, as {rows, registered, model_uri,
    current_score, candidate_score} with -1.0 for a score that was not computed."""
    setup_logging()
    out = publish_candidate(run_uri, min_gain)
    return {
        "rows": out["rows"],
        "registered": out["registered"],
        "model_uri": out["model_uri"],
        "current_score": float(out["current_score"] if out["current_score"] is not None else -1.0),
        "candidate_score": float(out["candidate_score"] if out["candidate_score"] is not None else -1.0),
    }
