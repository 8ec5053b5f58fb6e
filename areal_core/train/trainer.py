"""The trainer role: consume graded shards, enforce the hard staleness bound, take decoupled
PPO steps, publish weights/v{N}, checkpoint, and write DONE at the end.

`Trainer.fit` is the data flow; one pass produces version v+1 from version v:
  1. read new graded shards into the group buffer (corrupt ones quarantined),
  2. drop buffered samples with a token older than v − η (counted), take the B oldest groups,
  3. one training step (`areal_core/train/step.py`): advantages, π_prox, minibatches, loss,
     backward, gradient clipping, optimizer,
  4. write the audit record trainer/trained/step-{N}.json,
  5. checkpoint every `checkpoint_every` steps, then publish v+1,
  6. metrics: MLflow (the injected tracker), heartbeat, trainer/metrics.jsonl; timing events
     (areal_core/events.py): spans of each phase, `trained`, `publish`, `backlog`, `drop`.

World size 1 is the ordinary case. Under torchrun every rank runs this trainer with the model
sharded by FSDP2 (`areal_core/train/distributed.py`): rank 0 alone reads and writes the store
(ingests shards, picks the batch and broadcasts it, writes the audit log, checkpoints,
publishes, heartbeats, DONE); every rank takes part in the step and in the collective gathers
of the full model and optimizer state.

The role entry point passes in the resolved config, the metrics tracker and the held-out
evaluation, so the trainer imports nothing from the run layer or the rollout engines.

A restart from a checkpoint older than the newest published version continues numbering
after it (`areal_core/train/lineage.py`), so no `weights/v{N}` is ever republished with
different weights.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from areal_core.config import RunConfig
from areal_core.events import EventLog
from areal_core.forks import read_fork, read_graded
from areal_core.layout import LAYOUT
from areal_core.models import load_pretrained, save_pretrained
from areal_core.protocol import Sample, unique
from areal_core.staleness import staleness_histogram
from areal_core.store import Store
from areal_core.train import checkpoint, lora
from areal_core.train.algorithm import required_inputs
from areal_core.train.backlog import BacklogRecorder
from areal_core.train.batch import GroupBuffer
from areal_core.train.distributed import (
    DistContext,
    env_ranks,
    full_optimizer_state_dict,
    full_state_dict,
    indexed_optimizer_state,
    init_distributed,
    load_full_optimizer_state_dict,
    shard_model,
    shutdown,
    state_dict_bytes_rank0,
)
from areal_core.train.lineage import holds_version_in, newest_published, resume_version
from areal_core.train.metrics_file import MetricsFile
from areal_core.train.schedule import lr_factor
from areal_core.train.step import train_step
from areal_core.train.value_head import Critic
from areal_core.weights.publisher import WeightPublisher, hf_side_files, prune, state_dict_bytes

log = logging.getLogger("areal.trainer")

Batch = tuple[list[Sample] | None, list[Sample], list[Sample]]  # (samples, dropped, abandoned)
Evaluate = Callable[[torch.nn.Module, Any], float]  # (model, tokenizer) -> held-out score


class MetricsTracker(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...


class Trainer:
    """`cfg`: the run's resolved config (the store's config.yaml). `evaluate(model, tokenizer)`:
    the held-out score, called on rank 0 every `train.eval_every` steps. `tracker`: where rank 0
    logs each step's metrics (MLflow in a run). `guard()`: raises when the run no longer owns its
    root (called before the final model and DONE are written). `events`: the role's timing
    records (areal_core/events.py; the caller closes it)."""

    def __init__(
        self,
        run_uri: str,
        cfg: RunConfig,
        *,
        evaluate: Evaluate | None = None,
        tracker: MetricsTracker | None = None,
        guard: Callable[[], None] | None = None,
        events: EventLog | None = None,
    ):
        self.ev = events or EventLog(None, "trainer", "0")
        if cfg.train.eval_every and evaluate is None:
            raise ValueError("train.eval_every is set but the trainer was given no evaluate callable")
        self.store = Store(run_uri)
        self.cfg = cfg
        self.dist = init_distributed(self.cfg.device)
        main = self.dist.is_main
        torch.manual_seed(self.cfg.seed)
        self.model, self.tokenizer = load_pretrained(self.store.url(LAYOUT.init_model), self.cfg.device)
        self.side_files = hf_side_files(self.model, self.tokenizer)
        self.model, self.lora = lora.with_lora(self.model, self.cfg.train, self.dist.distributed)
        self.optimizer = self._make_optimizer()
        tc = self.cfg.train
        self.publisher = WeightPublisher(self.store, self.side_files, tc.weight_delta, tc.weight_full_every)
        self.ref_model = None
        if "ref_logp" in required_inputs(self.cfg.algo):
            self.ref_model, _ = load_pretrained(self.store.url(LAYOUT.init_model), self.cfg.device)
            self.ref_model.eval().requires_grad_(False)
        # PPO with GAE: a critic (value head on its own body; one process only), checkpointed, never published
        self.critic = (
            Critic.from_pretrained(self.store.url(LAYOUT.init_model), self.cfg)
            if "values" in required_inputs(self.cfg.algo)
            else None
        )
        self.buffer, self.fork = GroupBuffer(), read_fork(self.store)  # a fork reads its parent's shards (forks.py)
        self._unaudited: tuple[list[Sample], list[Sample]] = ([], [])  # drops while waiting: in the next record
        self.tracker = tracker if main else None
        self._evaluate = evaluate
        self._guard = guard
        self._full_copy: torch.nn.Module | None = None  # rank 0's unsharded model for eval / final_model
        # every rank restores the full model and optimizer (nothing writes checkpoints meanwhile)
        restored = checkpoint.restore(self.store, self.model, self.optimizer)
        if restored:
            self.state, pending = restored
            self.buffer.add(pending)
            if self.critic is not None:
                self.critic.restore(self.store, self.state.step)
            log.info(
                "resumed at step %d (version %d, %d pending samples)", self.state.step, self.state.version, len(pending)
            )
        else:
            self.state = checkpoint.TrainerState(
                counters={"dropped_samples": 0, "quarantined_shards": 0, "trained_samples": 0}
            )
        if self.dist.distributed:
            # shard the restored full model, then move the optimizer state into the sharded optimizer
            osd = full_optimizer_state_dict(self.model, self.optimizer, DistContext()) if restored else None
            self.model = shard_model(self.model, self.dist)
            self.optimizer = self._make_optimizer()
            if osd is not None:
                load_full_optimizer_state_dict(self.model, self.optimizer, osd, self.dist)
            if self.ref_model is not None:
                self.ref_model = shard_model(self.ref_model, self.dist)
        self.consumed = set(self.state.consumed)  # shard paths read (so a shard is read once)
        self.seen = set(self.state.seen)  # sample identities consumed (so a sample is used once)
        self._backlog, self._batch_times = BacklogRecorder(self.store, self.ev), (0.0, 0.0, 0.0)
        self.metrics_file = MetricsFile(self.store, self.state.step) if main else None
        self._resume_versions()

    def _make_optimizer(self) -> torch.optim.Optimizer:
        tc = self.cfg.train
        fused = not self.dist.distributed  # one kernel for all parameters (3x less CPU than per tensor)
        return torch.optim.AdamW(
            self.model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.99), fused=fused
        )

    def _resume_versions(self) -> None:
        """Publish the starting weights under a number no other weights ever had (train/lineage.py)."""
        decision = None
        if self.dist.is_main:
            decision = resume_version(self.state.version, newest_published(self.store), self.store.latest_version())
        decision = self.dist.broadcast_object(decision)
        if decision.abandoned is not None:
            lo, hi = decision.abandoned
            log.warning(
                "checkpoint version %d is older than published v%d: publishing it as v%d; v%d..v%d abandoned",
                self.state.version,
                hi,
                decision.version,
                lo,
                hi,
            )
            self.state.abandoned.append([lo, hi])
        self.state.version = decision.version
        if decision.publish:
            blob = self._weights_bytes()  # collective
            if self.dist.is_main:
                self._publish(blob)

    def _weights_bytes(self) -> bytes | None:
        """safetensors bytes of the full model (rank 0; None on other ranks). Collective."""
        if not self.dist.distributed:
            return state_dict_bytes(self.model)
        return state_dict_bytes_rank0(self.model, self.dist)

    def ingest(self) -> int:
        """Read the graded shards not read yet into the buffer; samples already consumed under
        another shard name (a copied shard) are skipped and counted as duplicate_samples."""
        graded = self.store.find(LAYOUT.graded_dir, ".arrow")
        new = [p for p in graded if p not in self.consumed]
        self._backlog(graded, len(new), len(self.buffer))
        for rel in (self.fork.unread(self.consumed) if self.fork else []) + new:
            samples = read_graded(self.store, rel, self.fork, self.ev)
            if samples is None:
                self.state.counters["quarantined_shards"] += 1
                log.warning("quarantined corrupt shard %s", rel)
            else:
                fresh = unique(samples, self.seen)
                if len(fresh) < len(samples):
                    counters = self.state.counters
                    counters["duplicate_samples"] = counters.get("duplicate_samples", 0) + len(samples) - len(fresh)
                    self.ev.emit("drop", reason="duplicate", n=len(samples) - len(fresh))
                    log.warning("shard %s: %d samples already consumed, skipped", rel, len(samples) - len(fresh))
                self.buffer.add(fresh)
            self.consumed.add(rel)
        return len(new)

    def next_batch(self) -> Batch:
        """Rank 0: ingest, drop abandoned-version and stale samples, take B groups (None if too few)."""
        cfg, st = self.cfg, self.state
        t0 = time.time()
        self.ingest()
        t1 = time.time()
        abandoned = self.buffer.drop_where(lambda s: holds_version_in(s, st.abandoned)) if st.abandoned else []
        dropped = self.buffer.drop_stale(st.version, cfg.train.eta)
        filtered = self.buffer.drop_uninformative() if cfg.algo.dynamic_sampling else []
        if filtered:
            groups = len({s.group_id for s in filtered})
            st.counters["filtered_groups"] = st.counters.get("filtered_groups", 0) + groups
            self.ev.emit("drop", reason="uninformative", n=len(filtered), groups=groups)
        self._give_back_admission(abandoned + dropped + filtered)
        batch = self.buffer.take(cfg.train.batch_groups), dropped, abandoned
        self._batch_times = (t0, t1, time.time())
        return batch

    def _give_back_admission(self, discarded: list[Sample]) -> None:
        """Count the groups that left the buffer untrained and publish the total for admission."""
        gone = {s.group_id for s in discarded} - set(self.buffer.groups)
        if not gone:
            return
        counters = self.state.counters
        counters["discarded_groups"] = counters.get("discarded_groups", 0) + len(gone)
        self.store.write_json(LAYOUT.discarded_groups, {"groups": counters["discarded_groups"]})

    def _count_drops(self, dropped: list[Sample], abandoned: list[Sample]) -> None:
        st = self.state
        st.counters["dropped_samples"] += len(dropped)
        if dropped:
            self.ev.emit("drop", reason="stale", n=len(dropped))
        if abandoned:
            st.counters["abandoned_samples"] = st.counters.get("abandoned_samples", 0) + len(abandoned)
            self.ev.emit("drop", reason="abandoned_version", n=len(abandoned))

    def step(
        self, samples: list[Sample], dropped: list[Sample], abandoned: list[Sample] | None = None
    ) -> dict[str, float]:
        """Train on `samples` (the same on every rank), then audit, checkpoint, publish; returns
        the step's metrics. Collective."""
        cfg, st = self.cfg, self.state
        abandoned = abandoned or []
        lr = self._set_lr()
        t0 = time.perf_counter()
        with self.ev.span("train"), torch.autocast(cfg.device, torch.bfloat16, enabled=cfg.train.bf16_autocast):
            metrics = train_step(
                self.model,
                self.optimizer,
                samples,
                cfg,
                self.tokenizer.pad_token_id,
                ctx=self.dist,
                ref_model=self.ref_model,
                critic=self.critic,
                phase=self.ev.add,
            )
        t_train = time.perf_counter() - t0
        trained_versions = [v for s in samples for v, m in zip(s.versions, s.loss_mask) if m]
        if self.dist.is_main:
            with self.ev.span("metrics"):
                self._write_audit(samples, dropped, abandoned, metrics)
        st.step += 1
        st.version += 1
        self._count_drops(dropped, abandoned)
        st.counters["trained_samples"] += len(samples)
        publish_s = self._checkpoint_and_publish()
        staleness = [st.version - 1 - v for v in trained_versions]
        metrics.update(
            staleness_mean=sum(staleness) / max(len(staleness), 1),
            staleness_max=max(staleness, default=0),
            dropped_samples=st.counters["dropped_samples"],
            filtered_groups=st.counters.get("filtered_groups", 0),
            quarantined_shards=st.counters["quarantined_shards"],
            lr=lr,
            train_s=t_train,
            publish_s=publish_s,
            tokens_per_s=metrics["response_tokens"] / max(t_train, 1e-9),
        )
        if st.counters.get("abandoned_samples"):
            metrics["abandoned_samples"] = st.counters["abandoned_samples"]
        if cfg.train.eval_every and st.step % cfg.train.eval_every == 0:
            t_eval, cpu_eval = time.perf_counter(), time.process_time()
            with self.ev.span("eval"):
                metrics["eval_accuracy"] = self.evaluate()
            metrics.update(eval_s=time.perf_counter() - t_eval, eval_cpu_s=time.process_time() - cpu_eval)
        return metrics

    def _set_lr(self) -> float:
        """This step's learning rate from the schedule (train/schedule.py), set on the optimizer."""
        tc, step = self.cfg.train, self.state.step
        lr = tc.lr * lr_factor(step, tc.steps, tc.lr_warmup_steps, tc.lr_schedule, tc.lr_min_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _write_audit(self, samples: list[Sample], dropped: list[Sample], abandoned: list[Sample], stats: dict) -> None:
        """trainer/trained/step-{N}.json (rank 0): the samples trained, in order, the metrics, the drops (with
        those made while waiting); `*_workers` complete each identity. The counts go to a `trained` event."""
        st = self.state
        hist = staleness_histogram([v for s in samples for v, m in zip(s.versions, s.loss_mask) if m], st.version)
        dropped, abandoned = self._unaudited[0] + dropped, self._unaudited[1] + abandoned
        self._unaudited = ([], [])
        record = {
            "step": st.step,
            "trainer_version": st.version,
            "eta": self.cfg.train.eta,
            "samples": [[s.sample_id, s.min_version()] for s in samples],
            "sample_workers": [s.worker_id for s in samples],
            "metrics": {k: float(v) for k, v in stats.items()},
            "dropped": [[s.sample_id, s.min_version()] for s in dropped],
            "dropped_workers": [s.worker_id for s in dropped],
            "staleness_histogram": hist,
        }
        if st.abandoned or abandoned:
            record["abandoned"] = [[s.sample_id, s.min_version()] for s in abandoned]
            record["abandoned_workers"] = [s.worker_id for s in abandoned]
            record["abandoned_versions"] = st.abandoned
        self.store.write_json(LAYOUT.trained_record(st.step), record)
        n = {"samples": len(samples), "dropped": len(dropped), "abandoned": len(abandoned)}
        self.ev.emit("trained", step=st.step, staleness=hist, **n)

    def _checkpoint_and_publish(self) -> float:
        """Checkpoint (every `checkpoint_every` steps and at the end), then publish the new version
        (rank 0); returns the publish time. Checkpoint before publishing: a restart then
        republishes identical weights under the same number (or, from an older checkpoint,
        continues after the newest published one). Collective."""
        cfg, st = self.cfg, self.state
        with self.ev.span("publish"):
            blob = self._weights_bytes()  # collective: every rank
        if st.step % cfg.train.checkpoint_every == 0 or st.step == cfg.train.steps:
            with self.ev.span("checkpoint"):
                self.save_checkpoint(blob, gathered=True)
        if not self.dist.is_main:
            return 0.0
        with self.ev.span("publish"):
            publish_s = self._publish(blob)
            prune(self.store, st.version - max(8, 2 * cfg.train.eta + 2))
        return publish_s

    def _publish(self, blob: bytes) -> float:
        """Publish the current version (rank 0; under LoRA the adapter alone) and its `publish` record."""
        seconds = self.publisher.publish(self.state.version, lora.adapter_files(self.model) if self.lora else blob)
        self.ev.emit("publish", version=self.state.version, bytes=self.publisher.last_weights_bytes, seconds=seconds)
        return seconds

    def _full_model(self) -> torch.nn.Module | None:
        """The model with every parameter in one process: the trainer's own model when not sharded;
        otherwise rank 0's unsharded copy refreshed from the shards (collective; None off rank 0)."""
        if not self.dist.distributed and not self.lora:
            return self.model  # under LoRA: a plain copy holding base + adapter
        state = lora.merged_state_dict(self.model) if self.lora else full_state_dict(self.model, self.dist)
        if not self.dist.is_main:
            return None
        if self._full_copy is None:
            self._full_copy, _ = load_pretrained(self.store.url(LAYOUT.init_model), self.cfg.device)
        self._full_copy.load_state_dict(state)
        return self._full_copy

    def evaluate(self) -> float:
        """The injected held-out score (rank 0 evaluates alone on the gathered model; 0.0 elsewhere)."""
        model = self._full_model()  # collective
        if model is None:
            return 0.0
        return self._evaluate(model, self.tokenizer)

    def save_checkpoint(self, model_bytes: bytes | None = None, gathered: bool = False) -> None:
        """Checkpoint (rank 0 writes). Collective. `gathered`: `model_bytes` already holds
        `_weights_bytes()` of this step (None off rank 0), so the model is not gathered again."""
        if not gathered:
            model_bytes = self._weights_bytes()
        osd = indexed_optimizer_state(self.model, self.optimizer, self.dist) if self.dist.distributed else None
        if self.dist.is_main:
            self.state.consumed = sorted(self.consumed)
            self.state.seen = sorted(self.seen)
            if self.critic is not None:  # before checkpoint.save writes COMMITTED
                self.critic.save(self.store, self.state.step)
            checkpoint.save(
                self.store,
                self.state,
                self.model,
                self.optimizer,
                self.buffer.samples(),
                keep=self.cfg.train.keep_checkpoints,
                model_bytes=model_bytes,
                optimizer_state=osd,
            )

    def fit(self) -> dict[str, float]:
        """Train until `train.steps`: graded shards -> buffer -> staleness drop -> step ->
        checkpoint -> publish -> metrics; then the final model and DONE. Returns the last
        step's metrics."""
        cfg, st, main = self.cfg, self.state, self.dist.is_main
        t_start, last = time.time(), {}
        idle_s = cfg.train.poll_interval_s
        while st.step < cfg.train.steps:
            polled = time.time()
            batch = self.next_batch() if main else None  # rank 0 alone reads the store
            samples, dropped, abandoned = self.dist.broadcast_object(batch)
            if samples is None:
                self._count_drops(dropped, abandoned)
                self._unaudited[0].extend(dropped)
                self._unaudited[1].extend(abandoned)
                self.ev.switch("batch", "wait", at=polled)
                time.sleep(idle_s)
                idle_s = min(idle_s * 1.5, 0.05)
                continue
            idle_s, step = cfg.train.poll_interval_s, st.step
            self._record_batch_spans(polled)
            if cfg.train.slow_step_s:
                with self.ev.span("train"):
                    time.sleep(cfg.train.slow_step_s)
            last = self.step(samples, dropped, abandoned)
            last.update({f"phase_{k}_s": v for k, v in self.ev.end_step(step).items()})  # the profile
            if main:
                with self.ev.span("metrics"):
                    self._log_metrics(last, time.time() - t_start)
        self.finish()
        return last

    def _record_batch_spans(self, polled: float) -> None:
        """The wait for a batch (the polls that found none) ends; then the successful poll's shard
        read and batch build (rank 0; other ranks waited on rank 0 meanwhile)."""
        self.ev.switch(None, at=polled)
        if self.dist.is_main:
            t0, t1, t2 = self._batch_times
            self.ev.record_span("read", t0, t1)
            self.ev.record_span("batch_build", t1, t2)

    def _log_metrics(self, metrics: dict[str, float], elapsed_s: float) -> None:
        """Rank 0: the tracker, the heartbeat and trainer/metrics.jsonl."""
        st = self.state
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, st.step)
        rounded = {k: round(v, 4) for k, v in metrics.items()}
        self.store.heartbeat(
            "trainer",
            "0",
            step=st.step,
            version=st.version,
            steps=self.cfg.train.steps,
            world_size=self.dist.world_size,
            elapsed_s=elapsed_s,
            **rounded,
        )
        tc = self.cfg.train
        must = "eval_accuracy" in metrics or st.step % tc.checkpoint_every == 0 or st.step >= tc.steps
        self.metrics_file.append({"step": st.step, **rounded}, must_write=must)

    def finish(self) -> None:
        model = self._full_model()  # collective
        if model is None:
            return
        if self._guard is not None:
            self._guard()
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(model, self.tokenizer, tmp)
            self.store.put_dir(tmp, LAYOUT.final_model)
        self.store.write_json(
            LAYOUT.committed(LAYOUT.final_model), {"step": self.state.step, "version": self.state.version}
        )
        self.store.write_json(
            LAYOUT.done,
            {
                "step": self.state.step,
                "version": self.state.version,
                "counters": self.state.counters,
                "world_size": self.dist.world_size,
            },
        )
        log.info("DONE at step %d", self.state.step)


def run_trainer(
    run_uri: str,
    cfg: RunConfig,
    *,
    evaluate: Evaluate | None = None,
    tracker: MetricsTracker | None = None,
    guard: Callable[[], None] | None = None,
) -> dict[str, float]:
    """The trainer role on this process: one process, or every rank of a torchrun group (FSDP2)."""
    with EventLog(Store(run_uri), "trainer", str(env_ranks()[0])) as events:
        trainer = Trainer(run_uri, cfg, evaluate=evaluate, tracker=tracker, guard=guard, events=events)
        try:
            return trainer.fit()
        finally:
            shutdown(trainer.dist)
