"""The trainer: takes batches from a `BatchSource`, trains, and hands each new version to a `Sink`.

    source.next_batch ──► step: train_step (train/step.py) ──► audit record ──► sink.after_step
       (train/sources.py)     advantages, π_prox, loss, optimizer     trainer/trained/     (train/sinks.py)
                                                                      step-{N}.json        publish, checkpoint

One trainer serves every use; what differs is the parts it is given: a run or a fork,
GradedShards + PublishingSink (train/run_trainer.py); replay, RecordedBatches + NullSink
(run/replay.py); online retraining, SessionBatches + NullSink (online/retrain.py).

The constructor writes nothing; `start()` tells the sink the trainer begins (a run publishes its
resumed version there), `fit()` trains until `train.steps` or the source is exhausted, then writes
the final model and DONE. Under torchrun every rank runs it with the model sharded by FSDP2
(train/distributed.py): rank 0 alone reads batches and writes the store.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from areal_core.config import RunConfig
from areal_core.config.device import use_bf16
from areal_core.events import EventLog
from areal_core.forks import image_roots
from areal_core.layout import LAYOUT
from areal_core.models import config_dtype, load_pretrained, save_pretrained
from areal_core.protocol import Sample
from areal_core.reward.signatures import per_function_means
from areal_core.staleness import staleness_histogram
from areal_core.store import Store
from areal_core.train import checkpoint, lora
from areal_core.train.audit import audit_record
from areal_core.train.borrowed_threads import BorrowedThreads
from areal_core.train.compiled_step import CompiledDecoder, step_eager_reason
from areal_core.train.distributed import full_state_dict, indexed_optimizer_state, state_dict_bytes_rank0
from areal_core.train.drops import discard_after
from areal_core.train.metrics_file import MetricsFile
from areal_core.train.parts import TrainerParts
from areal_core.train.schedule import set_lr
from areal_core.train.sinks import Sink
from areal_core.train.sources import Batch, BatchSource
from areal_core.train.step import train_step
from areal_core.vlm.images import ImageCache
from areal_core.vlm.inputs import MultimodalRows
from areal_core.vlm_processor import VisionProcessor
from areal_core.weights.publisher import state_dict_bytes

log = logging.getLogger("areal.trainer")

Evaluate = Callable[[torch.nn.Module, Any], float]  # (model, tokenizer) -> held-out score
OnStep = Callable[[Batch, dict[str, float]], None]


class MetricsTracker(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...


class Trainer:
    """`store`: the root it writes its audit records, metrics, final model and DONE to.
    `evaluate(model, tokenizer)`: the held-out score every `train.eval_every` steps (rank 0).
    `tracker`: where rank 0 logs each step's metrics. `guard()`: raises when the run no longer
    owns its root (before the final model and DONE). `check_finite`: raise when a step leaves a
    non-finite parameter. `on_step(batch, metrics)`: called after every trained step."""

    def __init__(
        self,
        parts: TrainerParts,
        source: BatchSource,
        sink: Sink,
        store: Store,
        cfg: RunConfig,
        *,
        evaluate: Evaluate | None = None,
        tracker: MetricsTracker | None = None,
        guard: Callable[[], None] | None = None,
        events: EventLog | None = None,
        check_finite: bool = False,
        on_step: OnStep | None = None,
    ):
        if cfg.train.eval_every and evaluate is None:
            raise ValueError("train.eval_every is set but the trainer was given no evaluate callable")
        self.parts, self.source, self.sink, self.store, self.cfg = parts, source, sink, store, cfg
        self.model, self.optimizer, self.tokenizer = parts.model, parts.optimizer, parts.tokenizer
        self.dist, self.lora, self.state = parts.dist, parts.lora, parts.state
        self.ev = events or EventLog(None, "trainer", "0")
        self.tracker = tracker if self.dist.is_main else None
        self._evaluate, self._guard, self._check_finite, self._on_step = evaluate, guard, check_finite, on_step
        self._bf16 = use_bf16(cfg.train.bf16_autocast, cfg.device)  # "auto": only where bf16 is fast
        # train.compile: the decoder compiled for the step (train/compiled_step.py); its choice and reason logged
        self.compiled = CompiledDecoder.for_run(self.model, cfg.train.compile, cfg.device, self.dist.distributed)
        # train.borrow_idle_cores: more torch threads while the machine's cores are idle (train/borrowed_threads.py)
        self.threads = BorrowedThreads.for_run(
            self.model, cfg.threads_per_role, cfg.train.borrow_idle_cores, self._no_borrowing()
        )
        self._unaudited: tuple[list[Sample], list[Sample]] = ([], [])  # drops while waiting: in the next record
        self._full_copy: torch.nn.Module | None = None  # rank 0's unsharded model for eval / final_model
        self.metrics_file = MetricsFile(store, self.state.step) if self.dist.is_main else None
        self._started = False
        self._images: ImageCache | None = None  # a VLM's decoded images by id

    def _no_borrowing(self) -> str | None:
        """Why this trainer's step may not borrow idle cores (None: it may)."""
        if self.cfg.device != "cpu":
            return f"device {self.cfg.device}"
        if self.dist.distributed:
            return "FSDP2 ranks share the machine's cores"
        return "the decoder is compiled" if self.compiled.on else None

    def _follow_threads(self, record: dict) -> None:
        """Replay: the record's thread counts (train.borrow_idle_cores), or `threads_per_role` for every pass of a
        record without them; a run that borrowed is followed even where this config would not borrow."""
        trace = record.get("threads")
        if self.threads is None and trace and any(n != self.cfg.threads_per_role for n in trace):
            if self.compiled.on:
                log.warning("replay: the decoder is compiled, so the run's recorded thread counts cannot be followed")
                return
            self.threads = BorrowedThreads(self.cfg.threads_per_role, 0).hooked(self.model)
        if self.threads is not None:
            self.threads.follow(trace if trace is not None else [])

    def start(self) -> None:
        """Tell the sink the trainer begins, once (a run publishes its resumed version). Collective.
        Drop records of checkpoints after the resumed one are deleted: their drops are made again."""
        if not self._started:
            if self.dist.is_main:
                discard_after(self.store, self.state.step)
            self.sink.start(self)
        self._started = True

    # -- what sinks ask of the trainer --------------------------------------------------------
    def weights_bytes(self) -> bytes | None:
        """safetensors bytes of the full model (rank 0; None on other ranks). Collective."""
        if not self.dist.distributed:
            return state_dict_bytes(self.model)
        return state_dict_bytes_rank0(self.model, self.dist)

    def adapter_files(self) -> dict[str, bytes]:
        return lora.adapter_files(self.model)

    def save_checkpoint(self, model_bytes: bytes | None = None, gathered: bool = False) -> None:
        """Checkpoint (rank 0 writes). Collective. `gathered`: `model_bytes` already holds this
        step's `weights_bytes()` (None off rank 0), so the model is not gathered again (under LoRA
        the adapter is saved instead)."""
        if not gathered and not self.lora:
            model_bytes = self.weights_bytes()
        osd = indexed_optimizer_state(self.model, self.optimizer, self.dist) if self.dist.distributed else None
        if not self.dist.is_main:
            return
        self.sink.drain(self)  # the versions before this checkpoint are in the store (train.background_publish)
        self.source.save_into(self.state)
        if self.parts.critic is not None:  # before checkpoint.save writes COMMITTED
            self.parts.critic.save(self.store, self.state.step)
        checkpoint.save(
            self.store,
            self.state,
            self.model,
            self.optimizer,
            self.source.pending(),
            keep=self.cfg.train.keep_checkpoints,
            model_bytes=model_bytes,
            optimizer_state=osd,
            adapter=self.lora,
        )

    # -- the loop ------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train until `train.steps` or the source is exhausted, then the final model and DONE.
        Returns the last step's metrics."""
        cfg, st, main = self.cfg, self.state, self.dist.is_main
        self.start()
        t_start, last = time.time(), {}
        idle_s = cfg.train.poll_interval_s
        while st.step < cfg.train.steps:
            polled = time.time()
            batch = self.dist.broadcast_object(self.source.next_batch(st) if main else None)
            if batch is None:
                break  # the source is exhausted
            if batch.samples == []:  # nothing of this step survived screening: skipped
                self._count_drops(batch.dropped, batch.abandoned)
                st.step += 1
                continue
            if batch.samples is None:  # too few groups yet: wait
                self._count_drops(batch.dropped, batch.abandoned)
                self._unaudited[0].extend(batch.dropped)
                self._unaudited[1].extend(batch.abandoned)
                self.ev.switch("batch", "wait", at=polled)
                self.sink.while_waiting(self)  # a version its readers cannot load: repaired, or the run stops
                time.sleep(idle_s)
                idle_s = min(idle_s * 1.5, 0.05)
                continue
            idle_s, step = cfg.train.poll_interval_s, st.step
            self._record_batch_spans(polled, batch)
            if batch.version is not None:
                st.version = batch.version
            if cfg.train.slow_step_s:
                with self.ev.span("train"):
                    time.sleep(cfg.train.slow_step_s)
            if batch.record is not None:  # a replay runs each layer pass at the run's recorded thread count
                self._follow_threads(batch.record)
            last = self.step(batch.samples, batch.dropped, batch.abandoned)
            last.update({f"phase_{k}_s": v for k, v in self.ev.end_step(step).items()})  # the profile
            if main:
                with self.ev.span("metrics"):
                    self._log_metrics(last, time.time() - t_start)
            if self._on_step is not None:
                self._on_step(batch, last)
        self.finish()
        return last

    def step(self, samples: list[Sample], dropped: list[Sample], abandoned: list[Sample] | None = None) -> dict:
        """Train on `samples` (the same on every rank), then audit and hand the version to the sink;
        returns the step's metrics. Collective."""
        cfg, st, counters = self.cfg, self.state, self.state.counters
        abandoned = abandoned or []
        lr = set_lr(self.optimizer, cfg.train, st.step)
        t0 = time.perf_counter()
        mm = self.images_of(samples)
        eager_reason = step_eager_reason(mm, any(s.routes is not None for s in samples))
        with (
            self.ev.span("train"),
            torch.autocast(cfg.device, torch.bfloat16, enabled=self._bf16),
            self.compiled.active(eager_reason),
            self.threads.step() if self.threads is not None else contextlib.nullcontext(),
        ):
            metrics = train_step(
                self.model,
                self.optimizer,
                samples,
                cfg,
                self.tokenizer.pad_token_id,
                ctx=self.dist,
                ref_model=self.parts.ref_model,
                critic=self.parts.critic,
                teacher_model=self.parts.teacher_model,
                mm=mm,
                phase=self.ev.add,
            )
        t_train = time.perf_counter() - t0
        if self.threads is not None:
            metrics["borrowed_share"] = self.threads.borrowed_share()
        if self.dist.is_main:
            for key, what in (("nonfinite_grad_frac", "gradient"), ("critic_nonfinite_grad_frac", "critic's gradient")):
                if metrics.get(key, 0.0) > 0:
                    log.warning("step %d: %s norm not finite; the update was skipped", st.step, what)
        if self._check_finite and (bad := [n for n, p in self.model.named_parameters() if not p.isfinite().all()]):
            raise FloatingPointError(f"step {st.step} made {len(bad)} parameters non-finite (first: {bad[0]})")
        trained_versions = [v for s in samples for v, m in zip(s.versions, s.loss_mask) if m]
        if self.dist.is_main:
            with self.ev.span("metrics"):
                self._write_audit(samples, dropped, abandoned, metrics)
        st.step += 1
        st.version += 1
        self._count_drops(dropped, abandoned)
        counters.trained_samples += len(samples)
        publish_s = self.sink.after_step(self)
        staleness = [st.version - 1 - v for v in trained_versions]
        metrics.update(
            # share of the step's samples whose reward was a failed call (raised, timed out, crashed)
            reward_error_frac=sum(bool((s.reward_info or {}).get("failed")) for s in samples) / max(len(samples), 1),
            staleness_mean=sum(staleness) / max(len(staleness), 1),
            staleness_max=max(staleness, default=0),
            dropped_samples=counters.dropped_samples,
            filtered_groups=counters.filtered_groups,
            skipped_samples=counters.skipped_samples,
            **per_function_means([s.reward_info for s in samples]),
            quarantined_shards=counters.quarantined_shards,
            lr=lr,
            train_s=t_train,
            publish_s=publish_s,
            tokens_per_s=metrics["response_tokens"] / max(t_train, 1e-9),
        )
        if counters.abandoned_samples:
            metrics["abandoned_samples"] = counters.abandoned_samples
        if cfg.train.eval_every and st.step % cfg.train.eval_every == 0:
            t_eval, cpu_eval = time.perf_counter(), time.process_time()
            with self.ev.span("eval"):
                metrics["eval_accuracy"] = self.evaluate()
            metrics.update(eval_s=time.perf_counter() - t_eval, eval_cpu_s=time.process_time() - cpu_eval)
        return metrics

    def images_of(self, samples: list[Sample]) -> MultimodalRows | None:
        """The batch's images as model inputs (rows naming `image_ids`), read from the run's image
        roots (a fork's parents, a replay's source) and checked against their ids; None for text."""
        if not any(s.image_ids for s in samples):
            return None
        if not isinstance(self.tokenizer, VisionProcessor):
            raise ValueError("the samples name images but the policy is a text model (model.kind vlm)")
        if self._images is None:
            self._images = ImageCache(image_roots(self.store), capacity=1024)
        with self.ev.span("images"):
            return MultimodalRows.from_samples(samples, self.tokenizer, self._images)

    def _count_drops(self, dropped: list[Sample], abandoned: list[Sample]) -> None:
        counters = self.state.counters
        counters.dropped_samples += len(dropped)
        if dropped:
            self.ev.emit("drop", reason="stale", n=len(dropped))
        if abandoned:
            counters.abandoned_samples += len(abandoned)
            self.ev.emit("drop", reason="abandoned_version", n=len(abandoned))

    def _write_audit(self, samples: list[Sample], dropped: list[Sample], abandoned: list[Sample], stats: dict) -> None:
        """The step's audit record (rank 0), with the drops made while waiting; its counts in a `trained` event."""
        st = self.state
        hist = staleness_histogram([v for s in samples for v, m in zip(s.versions, s.loss_mask) if m], st.version)
        dropped, abandoned = self._unaudited[0] + dropped, self._unaudited[1] + abandoned
        self._unaudited = ([], [])
        args = (st.step, st.version, self.cfg.train.eta, samples, stats, dropped, abandoned, st.abandoned, hist)
        threads = self.threads.trace if self.threads is not None else None
        self.store.write_json(LAYOUT.trained_record(st.step), audit_record(*args, threads=threads))
        n = {"samples": len(samples), "dropped": len(dropped), "abandoned": len(abandoned)}
        self.ev.emit("trained", step=st.step, staleness=hist, **n)

    def _record_batch_spans(self, polled: float, batch: Batch) -> None:
        """End the wait for a batch; record the successful poll's read and batch build (rank 0)."""
        self.ev.switch(None, at=polled)
        if self.dist.is_main and batch.times is not None:
            t0, t1, t2 = batch.times
            self.ev.record_span("read", t0, t1)
            self.ev.record_span("batch_build", t1, t2)

    def _log_metrics(self, metrics: dict[str, float], elapsed_s: float) -> None:
        """Rank 0: the tracker, the heartbeat and trainer/metrics.jsonl."""
        st, tc = self.state, self.cfg.train
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, st.step)
        rounded = {k: round(v, 4) for k, v in metrics.items()}
        extra = {"steps": tc.steps, "world_size": self.dist.world_size, "elapsed_s": elapsed_s}
        self.store.heartbeat("trainer", "0", step=st.step, version=st.version, **extra, **rounded)
        must = "eval_accuracy" in metrics or st.step % tc.checkpoint_every == 0 or st.step >= tc.steps
        self.metrics_file.append({"step": st.step, **rounded}, must_write=must)

    # -- the model in one piece ----------------------------------------------------------------
    def full_model(self) -> torch.nn.Module | None:
        """The model with every parameter in one process: the trainer's own model when not sharded;
        otherwise rank 0's unsharded copy refreshed from the shards (collective; None off rank 0)."""
        if not self.dist.distributed and not self.lora:
            return self.model  # under LoRA: a plain copy holding base + adapter
        state = lora.merged_state_dict(self.model) if self.lora else full_state_dict(self.model, self.dist)
        if not self.dist.is_main:
            return None
        if self._full_copy is None:
            self._full_copy, _ = load_pretrained(self.parts.model_url, self.cfg.device)
        self._full_copy.load_state_dict(state)
        return self._full_copy

    def evaluate(self) -> float:
        """The injected held-out score (rank 0 evaluates alone on the gathered model; 0.0 elsewhere)."""
        model = self.full_model()  # collective
        if model is None:
            return 0.0
        return self.score(model)

    def score(self, model: torch.nn.Module) -> float:
        """The injected held-out score of `model` (an unsharded model on rank 0; not collective)."""
        return self._evaluate(model, self.tokenizer)

    def finish(self) -> None:
        """The final model (final_model/, committed) and DONE (rank 0). Collective."""
        self.sink.finish(self)  # the last version in the store before DONE
        model = self.full_model()  # collective
        if model is None:
            return
        if self._guard is not None:
            self._guard()
        st = self.state
        # in init_model's dtype: a user's bfloat16 checkpoint is written back in bfloat16 (a run
        # without init_model/ in its root, online retraining's, keeps float32)
        config = LAYOUT.init_config
        dtype = config_dtype(self.store.read_json(config)) if self.store.exists(config) else None
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(model, self.tokenizer, tmp, dtype)
            self.store.put_dir(tmp, LAYOUT.final_model)
        self.store.write_json(LAYOUT.committed(LAYOUT.final_model), {"step": st.step, "version": st.version})
        st.drops.commit(self.store, st.step)  # the drops after the last checkpoint (a source exhausted early)
        done = {"step": st.step, "version": st.version, "counters": st.counters.to_json()}
        self.store.write_json(LAYOUT.done, {**done, "world_size": self.dist.world_size})
        log.info("DONE at step %d", st.step)
