"""The trainer role: consume graded shards, enforce the hard staleness bound, take decoupled
PPO steps, publish weights/v{N}, checkpoint, and write DONE at the end.

One step, producing version v+1 from version v:
  1. drop buffered samples with a token older than v − η (counted),
  2. take the B oldest groups, compute GRPO advantages,
  3. π_prox = the current parameters (one no-grad pass, or the same forward when there is
     a single minibatch), loss = decoupled PPO, AdamW step,
  4. checkpoint every `checkpoint_every` steps, then publish v+1, log metrics.

Under torchrun (WORLD_SIZE > 1) every rank runs this trainer with the model sharded by FSDP2
(`areal_core.distributed`): rank 0 alone reads and writes the store (ingests shards, picks the
batch and broadcasts it, writes the audit log, checkpoints, publishes, heartbeats, DONE); every
rank takes part in the step (`distributed_ppo_step`) and in the collective gathers of the full
model and optimizer state. One process is the plain single-process path.

A restart from a checkpoint older than the newest published version continues numbering
after it (`areal_core/train/lineage.py`), so no `weights/v{N}` is ever republished with
different weights.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time

import torch

from areal_core.config import RunConfig
from areal_core.distributed import (
    DistContext,
    full_optimizer_state_dict,
    full_state_dict,
    indexed_optimizer_state,
    init_distributed,
    load_full_optimizer_state_dict,
    shard_model,
    shutdown,
    state_dict_bytes_rank0,
)
from areal_core.evaluate import greedy_accuracy
from areal_core.models import load_pretrained, save_pretrained
from areal_core.prompts import load_prompts
from areal_core.protocol import Sample, read_shard_or_quarantine
from areal_core.run.context import load_run_config, set_threads
from areal_core.run.tracking import Tracker
from areal_core.staleness import staleness_histogram
from areal_core.store import DISCARDED_GROUPS, FINAL_MODEL, INIT_MODEL, Store
from areal_core.train import checkpoint
from areal_core.train.algorithm import compute_advantages, compute_loss, required_inputs
from areal_core.train.batch import GroupBuffer, TrainBatch, collate
from areal_core.train.distributed_step import distributed_ppo_step
from areal_core.train.entropy import token_logprobs_and_entropy
from areal_core.train.lineage import holds_version_in, newest_published, resume_version
from areal_core.train.logprobs import token_logprobs
from areal_core.train.packing import packed_token_logprobs
from areal_core.train.schedule import lr_factor
from areal_core.train.value_head import Critic
from areal_core.weights.publisher import WeightPublisher, hf_side_files, prune, state_dict_bytes

log = logging.getLogger("areal.trainer")

# Every torchrun rank runs the trainer (FSDP2); rank 0 alone reads and writes the store.
SUPPORTS_DISTRIBUTED = True

Batch = tuple[list[Sample] | None, list[Sample], list[Sample]]  # (samples, dropped, abandoned)


def policy_logprobs(
    model, batch: TrainBatch, rows: torch.Tensor | None, cfg: RunConfig, pad_id: int, entropy: bool = False
):
    """Per-token log-probs (and entropy) of `rows` of the batch, packed without padding when configured."""
    ids, attn = batch.input_ids, batch.attention_mask
    if rows is not None:
        ids, attn = ids[rows], attn[rows]
    temperature = cfg.rollout.temperature or 1.0
    if cfg.train.packing:
        return packed_token_logprobs(model, ids, attn, temperature, pad_id=pad_id, with_entropy=entropy)
    if entropy:
        return token_logprobs_and_entropy(model, ids, attn, temperature)
    return token_logprobs(model, ids, attn, temperature)


def ppo_update(
    model, optimizer, samples: list[Sample], cfg: RunConfig, pad_id: int, ref_model=None, critic: Critic | None = None
) -> dict[str, float]:
    """One training step on complete groups: the configured advantage estimator and loss
    (decoupled PPO by default), `train.ppo_minibatches` optimizer steps; returns metrics.
    `critic` (needed for adv_estimator=gae) gets its values before the update for GAE and is
    trained on the same loss (its value term) with its own optimizer."""
    algo, n_mb = cfg.algo, cfg.train.ppo_minibatches
    batch = collate(samples, pad_id)
    need = required_inputs(algo)
    prox_all = ref_all = None
    with torch.no_grad():
        if n_mb > 1 or algo.kl_as_reward:
            prox_all = policy_logprobs(model, batch, None, cfg, pad_id)
        if "ref_logp" in need:
            if ref_model is None:
                raise ValueError("this algorithm needs a reference model")
            ref_all = policy_logprobs(ref_model, batch, None, cfg, pad_id)
    if "values" in need and critic is None:
        raise ValueError("algo.adv_estimator=gae needs a critic (areal_core/train/value_head.py)")
    vkw = {"packing": cfg.train.packing, "pad_id": pad_id}
    old_v = critic.token_values(batch.input_ids, batch.attention_mask, grad=False, **vkw) if "values" in need else None
    adv, returns, stats = compute_advantages(
        algo, batch.rewards, batch.group_index, batch.loss_mask, prox_logp=prox_all, ref_logp=ref_all, old_values=old_v
    )
    for mb in range(n_mb):
        rows = (batch.group_index % n_mb) == mb
        out = policy_logprobs(model, batch, rows, cfg, pad_id, entropy="entropy" in need)
        logp, ent = out if isinstance(out, tuple) else (out, None)
        # π_prox: the parameters before this update; with one minibatch that is this very forward pass
        prox = logp.detach() if prox_all is None else prox_all[rows]
        values = None
        if old_v is not None:  # the critic's values of these rows, with gradient
            values = critic.token_values(batch.input_ids[rows], batch.attention_mask[rows], **vkw)
        loss, mb_stats = compute_loss(
            algo,
            logp,
            prox,
            batch.behav_logprobs[rows],
            batch.rewards[rows],
            batch.group_index[rows],
            batch.loss_mask[rows],
            ref_logp=None if ref_all is None else ref_all[rows],
            entropy=ent,
            advantages=adv[rows],
            returns=None if returns is None else returns[rows],
            values=values,
            old_values=None if old_v is None else old_v[rows],
        )
        optimizer.zero_grad(set_to_none=True)
        if old_v is not None:
            critic.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip or float("inf"))
        optimizer.step()
        if old_v is not None:
            mb_stats["critic_grad_norm"] = critic.step()
        for k, v in {**mb_stats, "loss": loss.item(), "grad_norm": float(grad_norm)}.items():
            stats[k] = stats.get(k, 0.0) + v / n_mb
    stats["reward_mean"] = batch.rewards.mean().item()
    stats["response_tokens"] = batch.loss_mask.sum().item()
    return stats


class Trainer:
    def __init__(self, run_uri: str):
        self.store = Store(run_uri)
        self.cfg = load_run_config(self.store)
        self.dist = init_distributed(self.cfg.device)
        main = self.dist.is_main
        set_threads(self.cfg.threads_per_role)
        torch.manual_seed(self.cfg.seed)
        self.model, self.tokenizer = load_pretrained(self.store.url(INIT_MODEL), self.cfg.device)
        self.model.train()
        self.optimizer = self._make_optimizer()
        self.side_files = hf_side_files(self.model, self.tokenizer)
        tc = self.cfg.train
        self.publisher = WeightPublisher(self.store, self.side_files, tc.weight_delta, tc.weight_full_every)
        self.ref_model = None
        if "ref_logp" in required_inputs(self.cfg.algo):
            self.ref_model, _ = load_pretrained(self.store.url(INIT_MODEL), self.cfg.device)
            self.ref_model.eval().requires_grad_(False)
        # PPO with GAE: a critic (value head on its own body; one process only), checkpointed, never published
        self.critic = (
            Critic.from_pretrained(self.store.url(INIT_MODEL), self.cfg)
            if "values" in required_inputs(self.cfg.algo)
            else None
        )
        self.buffer = GroupBuffer()
        self.tracker = Tracker.attach(self.store) if main else Tracker(None, "")
        self.eval_records = load_prompts(self.store, "eval")[: self.cfg.eval.num_samples] if main else []
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
        self.consumed = set(self.state.consumed)
        self._metrics_lines: list[str] = []
        if main and self.store.exists("trainer/metrics.jsonl"):
            old = self.store.read_text("trainer/metrics.jsonl").splitlines()
            self._metrics_lines = [line for line in old if line and json.loads(line)["step"] <= self.state.step]
        self._resume_versions()

    def _make_optimizer(self) -> torch.optim.Optimizer:
        tc = self.cfg.train
        return torch.optim.AdamW(self.model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.99))

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
                self.publisher.publish(self.state.version, blob)

    def _weights_bytes(self) -> bytes | None:
        """safetensors bytes of the full model (rank 0; None on other ranks). Collective."""
        if not self.dist.distributed:
            return state_dict_bytes(self.model)
        return state_dict_bytes_rank0(self.model, self.dist)

    def ingest(self) -> int:
        new = [p for p in self.store.find("trajectories/graded", ".arrow") if p not in self.consumed]
        for rel in new:
            samples = read_shard_or_quarantine(self.store, rel)
            if samples is None:
                self.state.counters["quarantined_shards"] += 1
                log.warning("quarantined corrupt shard %s", rel)
            else:
                self.buffer.add(samples)
            self.consumed.add(rel)
        return len(new)

    def next_batch(self) -> Batch:
        """Rank 0: ingest, drop abandoned-version and stale samples, take B groups (None if too few)."""
        cfg, st = self.cfg, self.state
        self.ingest()
        abandoned = self.buffer.drop_where(lambda s: holds_version_in(s, st.abandoned)) if st.abandoned else []
        dropped = self.buffer.drop_stale(st.version, cfg.train.eta)
        filtered = self.buffer.drop_uninformative() if cfg.algo.dynamic_sampling else []
        if filtered:
            st.counters["filtered_groups"] = st.counters.get("filtered_groups", 0) + len({s.group_id for s in filtered})
        self._give_back_admission(abandoned + dropped + filtered)
        return self.buffer.take(cfg.train.batch_groups), dropped, abandoned

    def _give_back_admission(self, discarded: list[Sample]) -> None:
        """Count the groups that left the buffer untrained and publish the total for admission."""
        gone = {s.group_id for s in discarded} - set(self.buffer.groups)
        if not gone:
            return
        counters = self.state.counters
        counters["discarded_groups"] = counters.get("discarded_groups", 0) + len(gone)
        self.store.write_json(DISCARDED_GROUPS, {"groups": counters["discarded_groups"]})

    def _count_drops(self, dropped: list[Sample], abandoned: list[Sample]) -> None:
        st = self.state
        st.counters["dropped_samples"] += len(dropped)
        if abandoned:
            st.counters["abandoned_samples"] = st.counters.get("abandoned_samples", 0) + len(abandoned)

    def step(
        self, samples: list[Sample], dropped: list[Sample], abandoned: list[Sample] | None = None
    ) -> dict[str, float]:
        cfg, st, main = self.cfg, self.state, self.dist.is_main
        abandoned = abandoned or []
        lr = cfg.train.lr * lr_factor(
            st.step, cfg.train.steps, cfg.train.lr_warmup_steps, cfg.train.lr_schedule, cfg.train.lr_min_ratio
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        if self.dist.distributed:
            metrics = distributed_ppo_step(
                self.model, self.optimizer, samples, cfg, self.tokenizer.pad_token_id, self.dist, self.ref_model
            )
        else:
            metrics = ppo_update(
                self.model, self.optimizer, samples, cfg, self.tokenizer.pad_token_id, self.ref_model, self.critic
            )
        t_train = time.perf_counter() - t0
        trained_versions = [v for s in samples for v, m in zip(s.versions, s.loss_mask) if m]
        hist = staleness_histogram(trained_versions, st.version)
        if main:
            record = {
                "step": st.step,
                "trainer_version": st.version,
                "eta": cfg.train.eta,
                "samples": [[s.sample_id, s.min_version()] for s in samples],
                "dropped": [[s.sample_id, s.min_version()] for s in dropped],
                "staleness_histogram": hist,
            }
            if st.abandoned:
                record["abandoned"] = [[s.sample_id, s.min_version()] for s in abandoned]
                record["abandoned_versions"] = st.abandoned
            self.store.write_json(f"trainer/trained/step-{st.step:06d}.json", record)
        st.step += 1
        st.version += 1
        self._count_drops(dropped, abandoned)
        st.counters["trained_samples"] += len(samples)
        blob = self._weights_bytes()  # collective: every rank
        # Checkpoint before publishing: a restart then republishes identical weights under the
        # same number (or, from an older checkpoint, continues after the newest published one).
        if st.step % cfg.train.checkpoint_every == 0 or st.step == cfg.train.steps:
            self.save_checkpoint(blob, gathered=True)
        publish_s = 0.0
        if main:
            publish_s = self.publisher.publish(st.version, blob)
            prune(self.store, st.version - max(8, 2 * cfg.train.eta + 2))
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
            metrics["eval_accuracy"] = self.evaluate()
        return metrics

    def _full_model(self) -> torch.nn.Module | None:
        """The model with every parameter in one process: the trainer's own model when not sharded;
        otherwise rank 0's unsharded copy refreshed from the shards (collective; None off rank 0)."""
        if not self.dist.distributed:
            return self.model
        state = full_state_dict(self.model, self.dist)
        if not self.dist.is_main:
            return None
        if self._full_copy is None:
            self._full_copy, _ = load_pretrained(self.store.url(INIT_MODEL), self.cfg.device)
        self._full_copy.load_state_dict(state)
        return self._full_copy

    def evaluate(self) -> float:
        """Held-out greedy accuracy (rank 0 generates alone on the gathered model; 0.0 elsewhere)."""
        e = self.cfg.eval
        model = self._full_model()
        if model is None:
            return 0.0
        return greedy_accuracy(model, self.tokenizer, self.eval_records, e.max_new_tokens, e.batch_size)

    def save_checkpoint(self, model_bytes: bytes | None = None, gathered: bool = False) -> None:
        """Checkpoint (rank 0 writes). Collective. `gathered`: `model_bytes` already holds
        `_weights_bytes()` of this step (None off rank 0), so the model is not gathered again."""
        if not gathered:
            model_bytes = self._weights_bytes()
        osd = indexed_optimizer_state(self.model, self.optimizer, self.dist) if self.dist.distributed else None
        if self.dist.is_main:
            self.state.consumed = sorted(self.consumed)
            if self.critic is not None:  # before checkpoint.save writes COMMITTED
                self.critic.save(self.store, self.state.step)
            checkpoint.save(
                self.store,
                self.state,
                self.model,
                self.optimizer,
                self.buffer.samples(),
                model_bytes=model_bytes,
                optimizer_state=osd,
            )

    def run(self) -> dict[str, float]:
        cfg, st, main = self.cfg, self.state, self.dist.is_main
        t_start, last = time.time(), {}
        idle_s = cfg.train.poll_interval_s
        while st.step < cfg.train.steps:
            batch = self.next_batch() if main else None  # rank 0 alone reads the store
            samples, dropped, abandoned = self.dist.broadcast_object(batch)
            if samples is None:
                self._count_drops(dropped, abandoned)
                time.sleep(idle_s)
                idle_s = min(idle_s * 1.5, 0.05)
                continue
            idle_s = cfg.train.poll_interval_s
            if cfg.train.slow_step_s:
                time.sleep(cfg.train.slow_step_s)
            last = self.step(samples, dropped, abandoned)
            if not main:
                continue
            self.tracker.log_metrics(last, st.step)
            with_metrics = {k: round(v, 4) for k, v in last.items()}
            self.store.heartbeat(
                "trainer",
                "0",
                step=st.step,
                version=st.version,
                steps=cfg.train.steps,
                world_size=self.dist.world_size,
                elapsed_s=time.time() - t_start,
                **with_metrics,
            )
            self._append_metrics({"step": st.step, **with_metrics})
        self.finish()
        return last

    def _append_metrics(self, row: dict) -> None:
        self._metrics_lines.append(json.dumps(row))
        self.store.write_text("trainer/metrics.jsonl", "\n".join(self._metrics_lines) + "\n")

    def finish(self) -> None:
        model = self._full_model()  # collective
        if model is None:
            return
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(model, self.tokenizer, tmp)
            self.store.put_dir(tmp, FINAL_MODEL)
        self.store.write_json(f"{FINAL_MODEL}/COMMITTED", {"step": self.state.step, "version": self.state.version})
        self.store.write_json(
            "DONE",
            {
                "step": self.state.step,
                "version": self.state.version,
                "counters": self.state.counters,
                "world_size": self.dist.world_size,
            },
        )
        log.info("DONE at step %d", self.state.step)


def run_trainer(run_uri: str) -> dict[str, float]:
    """The trainer role: one process, or every rank of a torchrun group (FSDP2)."""
    trainer = Trainer(run_uri)
    try:
        return trainer.run()
    finally:
        shutdown(trainer.dist)
