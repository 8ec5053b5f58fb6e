"""Re-grade a run's samples with a fixed or new reward, into a new layer beside the old one.

    report = regrade("s3://bucket/runs/job", reward="mypkg.rewards:strict", into="strict-v2")
    report.changed, report.changes[:3]   # how many rewards changed, and which (identity, old, new)

The samples of `source` (default the graded layer the trainer read) go through the reward pool
and its sandbox by the reward workers' own path (`worker.grade_samples`), and are written
under `trajectories/regraded/{into}/{worker}/{seq}.arrow` with the source shard's name. Nothing
of the source is written, moved or quarantined: a shard that does not parse is skipped and
named in the report. A reward the workflow or agent set itself (`reward_source` other than
the reward worker) is kept, as the reward workers keep it; labels (`labels/`) are joined again.

Publication: `REGRADE.json` holds the request first (a conditional write, so of two starts at
once one writes it); the shards follow; then `changes.parquet`, `REGRADE.json` with the summary,
and `COMMITTED` last. A layer that is committed is never written again; an unfinished one is
continued only by the same request (a retried task), so a layer is never overwritten.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from areal_core.config.base import ConfigError
from areal_core.context import load_run_config
from areal_core.layout import LAYOUT
from areal_core.prompts import load_prompts
from areal_core.protocol import Sample, ShardError, decode_shard, read_shard, write_shard
from areal_core.reward.labels import load_labels
from areal_core.reward.pool import RewardPool, reward_function
from areal_core.reward.signatures import load_functions
from areal_core.reward.worker import grade_samples
from areal_core.store import Store

GRADED_BY_POOL = "reward_worker"  # reward_info["reward_source"] of a reward the pool gave
BATCH_SAMPLES = 512  # samples graded per pool call: shards are small, the pool wants work queued


class RegradeError(ValueError):
    """A re-grade that must not run: the message says why (nothing was written)."""


@dataclass
class RegradeReport:
    layer: str
    source: str
    reward: str
    shards: int = 0
    samples: int = 0
    regraded: int = 0  # samples the pool graded again
    kept: int = 0  # workflow/agent rewards kept as they were
    changed: int = 0
    changes: list[dict[str, Any]] = field(default_factory=list)  # identity, worker_id, sample_id, old, new
    unreadable: list[str] = field(default_factory=list)  # source shards that did not parse (skipped)
    resumed_shards: int = 0  # shards an earlier attempt of this request had written
    seconds: float = 0.0  # end to end
    setup_seconds: float = 0.0  # config, prompts, tokenizer, labels, the pool's processes

    @property
    def samples_per_s(self) -> float:
        """End to end, setup included."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def grading_samples_per_s(self) -> float:
        """After setup: read, grade, write (what a larger run converges to)."""
        busy = self.seconds - self.setup_seconds
        return self.samples / busy if busy > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """Everything but the list of changes (that is in changes.parquet)."""
        out = {k: v for k, v in asdict(self).items() if k != "changes"}
        rates = {
            "samples_per_s": round(self.samples_per_s, 3),
            "grading_samples_per_s": round(self.grading_samples_per_s, 3),
        }
        return {**out, **rates}


def regrade(
    run: str | Store,
    reward: str | None = None,
    into: str = "",
    *,
    source: str = "graded",
    pool_size: int = 2,
    timeout_s: float | None = None,
    retries: int | None = None,
) -> RegradeReport:
    """Re-grade `source` of the run root `run` with the reward function `reward` (an import path
    "pkg.module:fn" as in `reward.function`; None: the run's own) into the new layer `into`.

    Refuses (RegradeError, before writing) `into` equal to `source` or to a layer of the run
    itself (`graded`, `ungraded`), a committed `into`, an unfinished `into` made by another
    request, a source layer that is missing or not committed, and a pool_size under 1. Returns the report; the
    changes (rewards that differ in float32) are also written to `changes.parquet`.
    """
    if pool_size < 1:
        raise RegradeError(f"pool_size={pool_size}: a re-grade needs at least one grading process")
    store = Store.of(run)
    t0 = time.monotonic()
    cfg = load_run_config(store)
    reward = reward or reward_function(cfg)
    _check_names(store, source, into)
    load_functions(reward)  # a reward that does not import claims no layer (a weighted spec: each of its functions)
    request = {"source": source, "reward": reward}
    resumed = _claim(store, into, request)
    sources = store.find(LAYOUT.layer_dir(source), ".arrow")
    if not sources:
        raise RegradeError(f"{store.url(LAYOUT.layer_dir(source))}: no shards to re-grade")
    report = RegradeReport(layer=into, source=source, reward=reward)
    references = {r["prompt_id"]: r for r in load_prompts(store)}
    tokenizer = _tokenizer(store)
    labels = load_labels(store)
    timeout = cfg.reward.timeout_s if timeout_s is None else timeout_s
    tries = cfg.reward.retries if retries is None else retries
    with RewardPool(reward, pool_size, timeout, tries) as pool:
        report.setup_seconds = time.monotonic() - t0
        batch: list[tuple[str, list[float | None], list[Sample]]] = []  # (target, old rewards, samples)
        for rel in sources:
            samples = _read(store, rel, report)
            if samples is None:
                continue
            report.shards += 1
            old = [s.reward for s in samples]
            target = LAYOUT.in_layer(rel, source, into)  # the source's own name, whatever it is
            if resumed and store.exists(target):  # written by an earlier attempt of this request
                report.resumed_shards += 1
                report.samples += len(samples)
                _compare(old, decode_shard(store.read_bytes(target)), report)
                continue
            batch.append((target, old, _reset(samples, report)))
            if sum(len(b[2]) for b in batch) >= BATCH_SAMPLES:
                _grade_and_write(store, batch, pool, references, tokenizer, labels, report)
                batch = []
        _grade_and_write(store, batch, pool, references, tokenizer, labels, report)
    report.seconds = time.monotonic() - t0
    _commit(store, into, request, report)
    return report


def _check_names(store: Store, source: str, into: str) -> None:
    try:
        src_dir = LAYOUT.layer_dir(source)
        LAYOUT.layer_dir(into)
    except ValueError as exc:
        raise RegradeError(str(exc)) from None
    if into == source:
        raise RegradeError(f"into={into!r} is the source layer: a re-grade never writes in place")
    if into in LAYOUT.base_layers:
        raise RegradeError(f"into={into!r} is a layer of the run itself; name a new layer")
    if source not in LAYOUT.base_layers and not store.exists(LAYOUT.committed(src_dir)):
        raise RegradeError(f"source layer {source!r} is missing or unfinished (no {LAYOUT.committed(src_dir)})")


def _claim(store: Store, into: str, request: dict[str, Any]) -> bool:
    """Write the request record of `into`, or find this same request unfinished there (a retry:
    True). RegradeError when the layer is committed or belongs to another request."""
    layer = LAYOUT.layer_dir(into)
    where = store.url(layer)
    if store.exists(LAYOUT.committed(layer)):
        raise RegradeError(f"{where} already exists (committed); re-grade into a new name")
    body = json.dumps({**request, "state": "running"}, sort_keys=True).encode()
    if not store.find(layer) and store.write_if(LAYOUT.regrade_record(into), body, None):
        return False
    found = store.read_versioned(LAYOUT.regrade_record(into))
    mine = found is not None and {k: json.loads(found[0]).get(k) for k in request} == request
    if not mine:
        raise RegradeError(
            f"{where} holds an unfinished layer of another request "
            f"({'no ' + LAYOUT.regrade_record_name if found is None else found[0][:200]!r}); "
            "re-grade into a new name or delete it"
        )
    return True


def _read(store: Store, rel: str, report: RegradeReport) -> list[Sample] | None:
    try:
        return read_shard(store, rel)
    except ShardError as exc:
        report.unreadable.append(f"{rel}: {exc}")
        return None


def _reset(samples: list[Sample], report: RegradeReport) -> list[Sample]:
    """Clear the rewards the pool gave (they are graded again); keep the workflow's own."""
    for s in samples:
        report.samples += 1
        if s.reward is None or s.reward_info.get("reward_source") == GRADED_BY_POOL:
            s.reward, s.token_rewards, s.reward_info = None, None, {}
            report.regraded += 1
        else:
            report.kept += 1
    return samples


def _grade_and_write(store, batch, pool, references, tokenizer, labels, report: RegradeReport) -> None:
    if not batch:
        return
    grade_samples([s for _, _, new in batch for s in new], pool, references, tokenizer, labels)
    for target, old, samples in batch:
        write_shard(store, target, samples)
        _compare(old, samples, report)


def _compare(old_rewards: list[float | None], new: list[Sample], report: RegradeReport) -> None:
    """Count (and list) the samples whose reward differs, compared as stored (float32)."""
    if len(old_rewards) != len(new):
        raise RegradeError(f"a re-graded shard holds {len(new)} samples, its source {len(old_rewards)}")
    for before, s in zip(old_rewards, new):
        old, now = _f32(before), _f32(s.reward)
        if old != now:
            report.changed += 1
            report.changes.append(
                {"identity": s.identity(), "worker_id": s.worker_id, "sample_id": s.sample_id, "old": old, "new": now}
            )


def _f32(x: float | None) -> float | None:
    return None if x is None else float(np.float32(x))


def _commit(store: Store, into: str, request: dict[str, Any], report: RegradeReport) -> None:
    schema = pa.schema(
        [
            ("identity", pa.string()),
            ("worker_id", pa.string()),
            ("sample_id", pa.string()),
            ("old", pa.float32()),
            ("new", pa.float32()),
        ]
    )
    table = pa.Table.from_pylist(report.changes, schema=schema)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    store.write_bytes(LAYOUT.regrade_changes(into), sink.getvalue().to_pybytes())
    store.write_json(LAYOUT.regrade_record(into), {**request, "state": "committed", **report.summary()})
    store.write_text(LAYOUT.committed(LAYOUT.layer_dir(into)), "")


def _tokenizer(store: Store):
    from areal_core.hf_load import load_tokenizer

    if store.local:  # no need for models.localize, whose import pulls in the model code (seconds)
        return load_tokenizer(str(store.local_path(LAYOUT.init_model)))
    from areal_core.models import localize

    return load_tokenizer(localize(store.url(LAYOUT.init_model)))


def main(argv: list[str] | None = None) -> None:
    """python -m areal_core.reward.regrade RUN --reward pkg.module:fn --into NAME: prints the summary."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m areal_core.reward.regrade", description=main.__doc__)
    ap.add_argument("run", help="run root: a local path or s3://...")
    ap.add_argument("--into", required=True, help="name of the new layer (trajectories/regraded/NAME)")
    ap.add_argument("--reward", default=None, help="reward function 'pkg.module:fn' (default: the run's own)")
    ap.add_argument("--source", default="graded", help="layer to re-grade (default: graded)")
    ap.add_argument("--pool-size", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        report = regrade(args.run, args.reward, args.into, source=args.source, pool_size=args.pool_size)
    except (RegradeError, ConfigError, FileNotFoundError) as exc:
        raise SystemExit(f"regrade: {exc}") from None
    print(json.dumps(report.summary(), indent=1))


if __name__ == "__main__":
    main()
