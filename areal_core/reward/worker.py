"""Reward worker: grades ungraded shards and publishes graded ones under the same name.

Worker k of K owns the shards whose path hashes to k; a shard whose graded twin exists is
done, so a restarted worker picks up exactly where it stopped.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import Counter

from areal_core.context import load_run_config
from areal_core.events import EventLog
from areal_core.forks import image_roots
from areal_core.layout import LAYOUT
from areal_core.prompts import load_prompts
from areal_core.protocol import (
    DEFAULT_LIMITS,
    Sample,
    ShardLimits,
    read_shard_or_quarantine,
    shard_limits_for,
    write_shard,
)
from areal_core.reward.labels import apply_labels, load_labels
from areal_core.reward.pool import RewardPool, reward_function
from areal_core.reward.signatures import reward_job
from areal_core.shard_feed import ShardFeed
from areal_core.store import Store

log = logging.getLogger("areal.reward")


def owner(path: str, num_workers: int) -> int:
    return zlib.crc32(path.encode()) % num_workers


_ROOTS: dict[str, list[Store]] = {}  # a run's image roots (its fork and replay records do not change)


def _image_roots(store: Store) -> list[Store]:
    if store.uri not in _ROOTS:
        _ROOTS[store.uri] = image_roots(store)
    return _ROOTS[store.uri]


def grade_shard(
    store: Store,
    rel: str,
    pool: RewardPool,
    references: dict[str, dict],
    tokenizer,
    labels=None,
    events: EventLog | None = None,
    limits: ShardLimits = DEFAULT_LIMITS,
) -> int:
    """Grade one shard; returns the number of samples graded (0 if it was quarantined). `events`:
    the timeline ("io" reading and writing, "grade"), grades, sandbox failures, quarantine.
    `limits`: the policy's (protocol.shard_limits_for): an out-of-vocabulary token id is quarantined
    here, not decoded into a completion."""
    ev = events or EventLog(None, "reward", "0")
    ev.switch("io")
    samples = read_shard_or_quarantine(store, rel, ev, limits, image_roots=_image_roots(store))
    if samples is None:
        log.warning("quarantined %s", rel)
        return 0
    ev.switch("grade")
    grade_samples(samples, pool, references, tokenizer, labels, ev)
    ev.switch("io")
    write_shard(store, LAYOUT.graded_twin(rel), samples)
    return len(samples)


def grade_samples(
    samples: list[Sample],
    pool: RewardPool,
    references: dict[str, dict],
    tokenizer,
    labels=None,
    events: EventLog | None = None,
) -> None:
    """Grade, in place, the samples without a reward through the pool, then join the labels.
    The one grading path: the reward workers and a re-grade (reward/regrade.py) both call it.
    `events`: where the grades and the sandbox failures (by reason) are counted."""
    todo = [s for s in samples if s.reward is None]  # a reward the agent or workflow set is kept
    jobs = [
        reward_job(tokenizer.decode(s.response_ids(), skip_special_tokens=True), references.get(s.prompt_id), s)
        for s in todo
    ]
    results = pool.grade(jobs)
    for s, result in zip(todo, results):
        s.reward = result.reward
        s.token_rewards = result.token_rewards
        s.reward_info = {**result.info, "reward_source": "reward_worker"}
    if events is not None:
        for reason, n in failure_reasons([r.info for r in results]).items():
            events.emit("sandbox", reason=reason, n=n)
        events.count(grades=len(todo))
    if labels:
        apply_labels(samples, labels)


class RewardFunctionFailing(RuntimeError):
    """Every reward so far was a failed call: the run would train on zeros."""


def check_not_all_failed(pool: RewardPool, fn_path: str, after: int) -> None:
    """RewardFunctionFailing when at least `after` (> 0) results are in and every one of them was
    a failed call (the function raised, timed out or crashed): a run that could only train on
    zeros stops with the reason instead of running to DONE."""
    results, failed = pool.stats["results"], pool.stats["failed"]
    if after > 0 and results >= after and failed == results:
        raise RewardFunctionFailing(
            f"every one of the first {results} rewards failed in {fn_path} (reward.stop_after_failed_groups): "
            f"{pool.last_failure[:300]}"
        )


def failure_reasons(infos: list[dict]) -> Counter:
    """Reasons a grading failed, counted: the pool's `error` (timeout, crash, the function raised)
    and the sandbox's per-test `failures`, each cut to 120 characters."""
    out: Counter = Counter()
    for info in infos:
        if info.get("error"):
            out[str(info["error"])[:120]] += 1
        for reason in info.get("failures") or []:
            out[str(reason)[:120]] += 1
    return out


def _bad_labels(rel: str, exc: Exception, reported: set[str], events: EventLog) -> None:
    """A labels file that cannot be used is skipped, never the grading: reported once per reason."""
    key = f"{rel}: {exc}"
    if key not in reported:
        reported.add(key)
        log.warning("labels file skipped: %s", exc)
        events.emit("labels_skipped", path=rel, reason=str(exc)[:300])


IDLE_BACKOFF_AFTER_S = 1.0  # idle this long, the worker starts backing off
IDLE_SLEEP_CAP_S = 0.2


def idle_sleep_s(idle_for_s: float, base_s: float) -> float:
    """The next sleep while no shard waits, after `idle_for_s` seconds without one:

        base_s                                   while idle_for_s < 1 s
        min(0.2, base_s · 2^⌊idle_for_s / 1 s⌋)  after that (never below base_s)

    A running job's shards arrive every few tenths of a second, and the time a shard waits to be seen
    is on the trainer's path, so the worker keeps its poll interval between them; a rollout side that
    paused (an evaluation, a restart) costs few listings (LIST requests on S3)."""
    if idle_for_s < IDLE_BACKOFF_AFTER_S:
        return base_s
    doublings = min(int(idle_for_s / IDLE_BACKOFF_AFTER_S), 32)  # bounded: idle for days stays a float
    return max(base_s, min(IDLE_SLEEP_CAP_S, base_s * 2**doublings))


def run_reward_worker(run_uri: str, index: int = 0) -> dict:
    from areal_core.hf_load import load_config, load_tokenizer
    from areal_core.models import localize

    store = Store(run_uri)
    cfg = load_run_config(store)
    num_workers = cfg.reward.num_workers
    references = {r["prompt_id"]: r for r in load_prompts(store)}
    tokenizer = load_tokenizer(localize(store.url(LAYOUT.init_model)))
    limits = shard_limits_for(load_config(localize(store.url(LAYOUT.init_model))))
    done = {LAYOUT.ungraded_twin(p) for p in store.find(LAYOUT.graded_dir, ".arrow")}  # once, at the start
    feed = ShardFeed(store, LAYOUT.ungraded_dir, handled=done)
    graded = 0
    reported: set[str] = set()
    t0 = time.time()
    idle_since: float | None = None
    fn_path = reward_function(cfg)
    with (
        RewardPool(fn_path, cfg.reward.pool_size, cfg.reward.timeout_s, cfg.reward.retries) as pool,
        EventLog(store, "reward", str(index)) as ev,
    ):
        while True:
            finished = store.done()
            # the ungraded side from a cursor per worker (what is new); others' shards are not ours to grade
            todo = []
            for p in feed.poll():
                if p not in done and owner(p, num_workers) == index:
                    todo.append(p)
                else:
                    feed.handled(p)
            for p in [p for p in todo if store.exists(LAYOUT.graded_twin(p))]:  # graded by an earlier incarnation
                done.add(p)
                feed.handled(p)
                todo.remove(p)
            if todo:
                labels = load_labels(store, on_error=lambda rel, exc: _bad_labels(rel, exc, reported, ev))
                for rel in todo:
                    graded += grade_shard(store, rel, pool, references, tokenizer, labels, ev, limits)
                    done.add(rel)
                    feed.handled(rel)
                    check_not_all_failed(pool, fn_path, cfg.reward.stop_after_failed_groups * cfg.rollout.group_size)
                store.heartbeat(
                    "reward", str(index), graded=graded, grades_per_s=graded / max(time.time() - t0, 1e-9), **pool.stats
                )
                idle_since = None
            elif finished:
                break
            else:
                ev.switch("shards", "wait")
                now = time.monotonic()
                idle_since = now if idle_since is None else idle_since
                time.sleep(idle_sleep_s(now - idle_since, cfg.reward.poll_interval_s))
    return {"graded": graded}
