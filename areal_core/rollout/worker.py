"""Rollout worker: generates groups under the admission rule and writes ungraded shards.

Restart-safe: the sequence number and the count of started groups are recovered from the
worker's own shards, and prompt choice is a pure function of (worker, group index).
"""

from __future__ import annotations

import logging
import random
import time

from areal_core.config import RunConfig
from areal_core.models import chat_prompt
from areal_core.prompts import load_prompts
from areal_core.protocol import Sample, decode_shard, write_shard
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.factory import build_engine
from areal_core.run.context import load_run_config, set_threads, wait_for_version
from areal_core.staleness import groups_admissible
from areal_core.store import Store, shard_name
from areal_core.weights.watcher import WeightWatcher

log = logging.getLogger("areal.rollout")


class RolloutEngineFailed(RuntimeError):
    """The engine raised while generating; names the worker, groups, shard and version."""


def recover_progress(store: Store, worker_id: str) -> tuple[int, int]:
    """(next sequence number, groups started) from this worker's existing shards."""
    names = store.find(f"trajectories/ungraded/{worker_id}", ".arrow")
    groups = 0
    for name in names:
        try:
            groups += len({s.group_id for s in decode_shard(store.read_bytes(name))})
        except Exception:  # a torn shard of ours is rewritten under the same name
            names = names[: names.index(name)]
            break
    seq = int(names[-1].rsplit("/", 1)[-1].split(".")[0]) + 1 if names else 0
    return seq, groups


def run_rollout_worker(run_uri: str, index: int = 0) -> dict:
    store = Store(run_uri)
    cfg: RunConfig = load_run_config(store)
    set_threads(cfg.threads_per_role)
    worker_id = f"rollout-{index}"
    prompts = load_prompts(store, "train")
    order = list(range(len(prompts)))
    random.Random(cfg.seed * 1000 + 7).shuffle(order)

    version = wait_for_version(store)
    engine, tokenizer = build_engine(cfg, store, version, index)
    watcher = WeightWatcher(store, lambda v: engine.receive(store, v), cfg.rollout.poll_interval_s, version=version)
    watcher.start()
    try:
        return _generate_loop(cfg, store, index, worker_id, prompts, order, engine, tokenizer, watcher)
    finally:
        watcher.stop()
        engine.close()  # a remote engine stops the server it started


def _generate_loop(cfg, store, index, worker_id, prompts, order, engine, tokenizer, watcher) -> dict:
    num_workers = cfg.rollout.num_workers
    params = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
    )
    seq, started = recover_progress(store, worker_id)
    prompt_cache: dict[int, list[int]] = {}
    produced = 0
    t_start = time.time()
    discarded = store.discarded_groups()
    log.info("%s starting at seq=%d groups=%d version=%d", worker_id, seq, started, engine.version)
    while not store.done():
        if watcher.error is not None:
            raise RolloutEngineFailed(f"{worker_id}: loading a new version failed: {watcher.error}") from watcher.error
        engine.load_version(engine.version)  # install any staged version before deciding admission
        room = cfg.rollout.max_batch_groups
        if cfg.rollout.admission:
            args = (started, engine.version, cfg.train.eta, cfg.train.batch_groups, index, num_workers)
            if groups_admissible(*args, discarded) == 0:  # blocked: the trainer may have given admission back
                discarded = store.discarded_groups()
            room = min(room, groups_admissible(*args, discarded))
        if room == 0:
            watcher.wait(cfg.rollout.poll_interval_s * 5)
            continue
        group_indices = list(range(started, started + room))
        batch_prompts, meta = [], []
        for g in group_indices:
            p = order[(g * num_workers + index) % len(order)]
            if p not in prompt_cache:
                prompt_cache[p] = chat_prompt(tokenizer, prompts[p]["prompt"])
            for k in range(cfg.rollout.group_size):
                batch_prompts.append(prompt_cache[p])
                meta.append((g, p, k))
        try:
            gens = engine.generate(batch_prompts, params)
        except Exception as exc:
            raise RolloutEngineFailed(
                f"{worker_id}: engine '{cfg.rollout.engine}' failed generating groups {group_indices[0]}..."
                f"{group_indices[-1]} (shard {seq}, version {engine.version}): {exc}; a restarted worker "
                f"resumes from shard {seq}"
            ) from exc
        samples = []
        for (g, p, k), prompt_ids, gen in zip(meta, batch_prompts, gens):
            n_p, n_r = len(prompt_ids), len(gen.token_ids)
            samples.append(
                Sample(
                    sample_id=f"{worker_id}-g{g:07d}-{k}",
                    group_id=f"{worker_id}-g{g:07d}",
                    prompt_id=prompts[p]["prompt_id"],
                    worker_id=worker_id,
                    input_ids=prompt_ids + gen.token_ids,
                    prompt_len=n_p,
                    loss_mask=[0] * n_p + [1] * n_r,
                    behav_logprobs=[0.0] * n_p + gen.logprobs,
                    versions=[-1] * n_p + gen.versions,
                    finish_reason=gen.finish_reason,
                )
            )
        write_shard(store, shard_name("ungraded", worker_id, seq), samples)
        seq += 1
        started += len(group_indices)
        produced += len(samples)
        store.heartbeat(
            "rollout",
            str(index),
            seq=seq,
            groups_started=started,
            version=engine.version,
            swaps=engine.swaps,
            samples_per_s=produced / max(time.time() - t_start, 1e-9),
        )
    log.info("%s done: %d shards, %d groups", worker_id, seq, started)
    return {"worker": worker_id, "shards": seq, "groups": started}
