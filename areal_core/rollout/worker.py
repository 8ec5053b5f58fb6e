"""The rollout worker: runs the run's `RolloutWorkflow` one group at a time under admission and
writes ungraded shards, until DONE.

The engine (`rollout.engine`) is built once and handed to the workflow as an `AsyncEngine`;
groups start while `Admission` allows and fewer than the workflow's `max_concurrent_groups`
are in flight; the groups that finish together become one shard
(`LAYOUT.ungraded_shard(worker, seq)`). Restart-safe: the sequence number and the
groups written are recovered from the worker's own shards (`admission.recover_progress`), and
prompt choice is a pure function of (worker, group index).

A group whose prompt record is bad input (the workflow raised `BadPrompt`: an image missing or
altered, a prompt the processor refuses) is dropped with its reason counted (a `drop` event
naming the prompt, the heartbeat's `dropped_groups`) and its admission given back; the worker
goes on. A restarted worker starts that group again and drops it again: never a crash loop.
Only when `max_bad_in_a_row` groups in a row are bad (the prompt set or images/ is damaged as a
whole, not one record) does it stop, with `BadPromptSet`.

A worker that cannot load a version which verifies in the store (weights/faults.py) restarts its
loader once, cache cleared; if the trainer then retires it, it stops starting groups, finishes
and writes those in flight, records the groups it holds (the live workers share the rest of the
admission) and exits 0: the run goes on without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from areal_core.config import RunConfig
from areal_core.context import load_run_config, set_threads, wait_for_version
from areal_core.events import EventLog
from areal_core.forks import image_roots
from areal_core.layout import LAYOUT
from areal_core.prompts import load_prompts
from areal_core.protocol import Sample, write_shard
from areal_core.rollout.admission import Admission, group_id, read_retired_workers, recover_progress
from areal_core.rollout.async_engine import AsyncEngine
from areal_core.rollout.factory import build_engine
from areal_core.rollout.workflow import BadPrompt, RolloutWorkflow, WorkflowContext, load_workflow
from areal_core.store import Store
from areal_core.vlm.images import ImageCache
from areal_core.weights import WeightsError
from areal_core.weights.faults import Reporter
from areal_core.weights.reader import forget
from areal_core.weights.watcher import WeightWatcher

log = logging.getLogger("areal.rollout")


class RolloutEngineFailed(RuntimeError):
    """The engine raised while generating; names the worker, groups, shard and version."""


class BadPromptSet(RuntimeError):
    """Every one of the last `max_bad_in_a_row` groups was a bad prompt record: not one record."""


class RolloutLoop:
    """Starts groups of `workflow` on `tasks` while `admission` allows; writes finished groups."""

    def __init__(
        self,
        workflow: RolloutWorkflow,
        engine: AsyncEngine,
        tasks: list[dict[str, Any]],
        admission: Admission,
        store: Store,
        worker_id: str,
        *,
        next_seq: int = 0,
        max_in_flight: int = 8,
        poll_interval_s: float = 0.02,
        engine_name: str = "",
        status_id: str | None = None,
        check: Callable[[], None] | None = None,
        events: EventLog | None = None,
    ):
        self.workflow, self.engine, self.tasks, self.admission = workflow, engine, tasks, admission
        self.store, self.worker_id, self.seq = store, worker_id, next_seq
        self.max_in_flight = max(1, max_in_flight)
        self.poll_interval_s, self.engine_name = poll_interval_s, engine_name
        self.status_id, self.check = status_id, check
        self.produced = 0
        self.dropped: Counter[str] = Counter()  # groups dropped for bad input, by reason
        self.bad_in_a_row, self.max_bad_in_a_row = 0, 64
        self.t0 = time.time()
        self.ev = events or EventLog(None, "rollout", worker_id.rsplit("-", 1)[-1])

    async def run(self, stop: Callable[[], bool] | None = None, num_groups: int | None = None) -> dict[str, Any]:
        """Until `stop()` (checked at most every 5 polls) or `num_groups` more groups started; the
        groups in flight then finish and are written."""
        in_flight: dict[asyncio.Task, tuple[int, int]] = {}
        first = self.admission.started
        stop_checked = 0.0
        loop, new_version = asyncio.get_running_loop(), asyncio.Event()
        listen = getattr(self.engine, "on_new_version", None)
        unlisten = listen(lambda: loop.call_soon_threadsafe(new_version.set)) if listen is not None else None
        try:
            while True:
                new_version.clear()  # before reading the version: one installed after this wakes the wait below
                if self.check is not None:
                    self.check()
                if num_groups is not None and self.admission.started - first >= num_groups:
                    break
                if stop is not None and time.monotonic() - stop_checked >= 5 * self.poll_interval_s:
                    stop_checked = time.monotonic()
                    if stop():
                        break
                free = self.max_in_flight - len(in_flight)
                if num_groups is not None:
                    free = min(free, num_groups - (self.admission.started - first))
                room = self.admission.room(self.engine.version) if free > 0 else 0
                for _ in range(min(free, room)):
                    g, p = self.admission.start()
                    in_flight[asyncio.create_task(self.workflow.arun_episode(self.engine, self.tasks[p]))] = (g, p)
                # the timeline: generating while any group is in flight, else blocked by admission
                self.ev.switch("generate" if in_flight else "admission", "busy" if in_flight else "wait")
                if not in_flight:  # blocked by admission: until the next version is installed, or a poll
                    try:
                        await asyncio.wait_for(new_version.wait(), self.poll_interval_s)
                    except TimeoutError:
                        pass
                    continue
                done, _ = await asyncio.wait(in_flight, timeout=self.poll_interval_s, return_when="FIRST_COMPLETED")
                if done:
                    await self._finish({t: in_flight.pop(t) for t in done})
            while in_flight:
                done, _ = await asyncio.wait(in_flight, return_when="FIRST_COMPLETED")
                await self._finish({t: in_flight.pop(t) for t in done})
        finally:
            if unlisten is not None:
                unlisten()
            self.ev.switch(None)
            for t in in_flight:
                t.cancel()
        log.info("%s done: %d shards, %d groups", self.worker_id, self.seq, self.admission.started)
        return {"worker": self.worker_id, "shards": self.seq, "groups": self.admission.started}

    async def _finish(self, done: dict[asyncio.Task, tuple[int, int]]) -> None:
        """Write the groups that finished together as one shard; drop (and count) those whose
        prompt was bad input; raise if any of them failed otherwise."""
        rows: list[Sample] = []
        failed: list[tuple[int, BaseException]] = []
        bad = 0
        for task, (g, p) in sorted(done.items(), key=lambda kv: kv[1][0]):
            exc = task.exception()
            if isinstance(exc, BadPrompt):  # bad input, not the engine: dropped and counted, the worker goes on
                self._drop(exc.reason, g, self.tasks[p], str(exc))
                bad += 1
                continue
            if exc is not None:
                failed.append((g, exc))
                continue
            named = self._named(task.result(), g, self.tasks[p])
            if not named:
                self._drop("empty_group", g, self.tasks[p])
                continue
            self.bad_in_a_row = 0
            rows += named
        if rows:
            with self.ev.span("shard_write"):
                shard = LAYOUT.ungraded_shard(self.worker_id, self.seq)
                await asyncio.to_thread(write_shard, self.store, shard, rows)
            self.ev.count(completions=len(rows), tokens=sum(sum(s.loss_mask) for s in rows))
            self.seq += 1
            self.produced += len(rows)
        if rows or bad:
            self._heartbeat()
        if self.bad_in_a_row >= self.max_bad_in_a_row:
            raise BadPromptSet(
                f"{self.worker_id}: the last {self.bad_in_a_row} groups' prompt records were all bad input "
                f"({dict(self.dropped)}): the prompt set or its images are damaged, not one record"
            )
        if failed:
            self.ev.emit("drop", reason="engine_failed", n=len(failed), unit="groups")
            (a, exc), (b, _) = failed[0], failed[-1]
            raise RolloutEngineFailed(
                f"{self.worker_id}: engine '{self.engine_name}' failed generating groups {a}...{b} "
                f"(shard {self.seq}, version {self.engine.version}): {exc}; a restarted worker "
                f"resumes from shard {self.seq}"
            ) from exc

    def _drop(self, reason: str, g: int, task: dict[str, Any], error: str = "") -> None:
        """Group `g` never reaches the trainer: count it by `reason` and give its admission back.
        An empty group (the workflow chose to drop it, e.g. every agent episode failed) is counted
        as an event only, as before; a bad prompt record also in the heartbeat, and logged."""
        prompt_id = str(task.get("prompt_id", ""))
        self.admission.give_back(1)
        if reason == "empty_group":
            self.ev.emit("drop", reason=reason, n=1, unit="groups")
            return
        self.dropped[reason] += 1
        if g >= self.admission.first_new:  # a restart redoes every earlier drop first: not a damaged set
            self.bad_in_a_row += 1
        gid = group_id(self.worker_id, g)
        self.ev.emit("drop", reason=reason, n=1, unit="groups", group=gid, prompt_id=prompt_id, error=error[:500])
        log.warning("%s: group %d dropped (%s): %s", self.worker_id, g, reason, error[:500])

    def _named(self, samples: list[Sample], g: int, task: dict[str, Any]) -> list[Sample]:
        """The worker names a group's rows and gives them the record's dataset columns (`meta.columns`); a
        reward the workflow set is kept and marked as its own."""
        gid = group_id(self.worker_id, g)
        columns = (task.get("meta") or {}).get("columns")  # the record's other dataset columns travel with it
        for i, s in enumerate(samples):
            s.group_id, s.worker_id, s.sample_id = gid, self.worker_id, f"{gid}-{i}"
            s.prompt_id = s.prompt_id or str(task.get("prompt_id", ""))
            if columns and "columns" not in s.meta:
                s.meta = {**s.meta, "columns": columns}
            if s.reward is not None:
                s.reward_info = {"reward_source": "workflow", **(s.reward_info or {})}
        return samples

    def _heartbeat(self) -> None:
        if self.status_id is None:
            return
        self.store.heartbeat(
            "rollout",
            self.status_id,
            seq=self.seq,
            groups_started=self.admission.started,
            version=self.engine.version,
            swaps=self.engine.engine.swaps,
            samples_per_s=self.produced / max(time.time() - self.t0, 1e-9),
            dropped_groups=dict(self.dropped),
            **self.workflow.stats(),
        )


def _first_engine(
    cfg: RunConfig, store: Store, index: int, ev: EventLog, faults: Reporter
) -> tuple[Any, Any, int] | None:
    """(engine, tokenizer, version) on the newest version that loads (None: the run ended first). A
    version that fails its checks is retried (a newer one when published) and reported to the
    trainer (weights/faults.py), which republishes it or stops the run: the worker never dies of a
    damaged version."""
    failing = (-1, 0)
    while True:
        with ev.span("weights", "wait"):
            version = wait_for_version(store)
        t0 = time.time()
        try:
            engine, tokenizer = build_engine(cfg, store, version, index)
        except WeightsError as exc:
            n = failing[1] + 1  # in a row, across versions (a broken delta chain fails every newer one)
            failing = (version, n)
            if n & (n - 1) == 0:
                log.warning("rollout-%d: weights v%d failed to load (%d in a row): %s", index, version, n, exc)
            faults.failed(version, n, exc)
            if faults.retired is not None or store.done():  # out of the run, or the run ended: nothing to do
                return None
            time.sleep(cfg.rollout.poll_interval_s)
            continue
        ev.emit("load", version=version, seconds=round(time.time() - t0, 4))
        faults.loaded()  # never raises
        return engine, tokenizer, version


def restart_loader(store: Store, engine: Any | None) -> None:
    """A reader's restart (weights/faults.py): drop the weights this process keeps of `store` and
    the versions the engine's server has staged; the next load reads everything from the store."""
    forget(store)
    clear = getattr(engine, "clear_weight_cache", None)
    if clear is not None:
        clear()


def run_rollout_worker(run_uri: str, index: int = 0) -> dict:
    store = Store(run_uri)
    with EventLog(store, "rollout", str(index)) as ev:
        return _run(store, index, ev)


def _run(store: Store, index: int, ev: EventLog) -> dict:
    cfg = load_run_config(store)
    set_threads(cfg.threads_per_role)
    worker_id = f"rollout-{index}"
    tasks = load_prompts(store, "train")
    ro = cfg.rollout
    engines: list[Any] = []
    faults = Reporter(store, worker_id, restart=lambda: restart_loader(store, engines[0] if engines else None))
    first = _first_engine(cfg, store, index, ev, faults)
    if first is None and faults.retired is not None:
        faults.retire(len(recover_progress(store, worker_id).groups))
        return {"worker": worker_id, "retired": faults.retired}
    if first is None:
        return {"worker": worker_id, "stopped": "the run ended before a version loaded"}
    engine, tokenizer, version = first
    engines.append(engine)
    if getattr(engine, "choice", None) is not None:  # which engine rollout.engine chose, and why (the report's)
        ev.emit("engine", **engine.choice.fields())

    aengine = AsyncEngine(engine, max(256, ro.max_batch_groups * ro.group_size), ro.poll_interval_s)

    def receive(v: int) -> None:
        t = time.time()
        engine.receive(store, v)
        ev.emit("load", version=v, seconds=round(time.time() - t, 4))
        faults.loaded()
        aengine.wake()  # installed now if the engine is idle: admission may be waiting on it

    watcher = WeightWatcher(store, receive, ro.poll_interval_s, version=version, on_failure=faults.failed).start()

    def check() -> None:
        if watcher.error is not None:
            raise RolloutEngineFailed(f"{worker_id}: loading a new version failed: {watcher.error}") from watcher.error

    workflow = None
    try:
        images = ImageCache(image_roots(store)) if cfg.model.kind == "vlm" else None  # a record's meta.image_ids
        workflow = load_workflow(WorkflowContext(cfg, tokenizer, worker_id, index, images))
        progress = recover_progress(store, worker_id)
        admission = Admission(
            num_prompts=len(tasks),
            seed=cfg.seed,
            batch_groups=cfg.train.batch_groups,
            eta=cfg.train.eta,
            worker_index=index,
            num_workers=ro.num_workers,
            enabled=ro.admission,
            progress=progress,
            read_discarded=store.discarded_groups,
            read_retired=lambda: read_retired_workers(store),
            reread_every_s=5 * ro.poll_interval_s,
        )
        log.info("%s starting at seq=%d groups=%d version=%d", worker_id, progress.next_seq, admission.started, version)
        loop = RolloutLoop(
            workflow,
            aengine,
            tasks,
            admission,
            store,
            worker_id,
            next_seq=progress.next_seq,
            max_in_flight=workflow.max_concurrent_groups or ro.max_batch_groups,
            poll_interval_s=ro.poll_interval_s,
            engine_name=ro.engine,
            status_id=str(index),
            check=check,
            events=ev,
        )
        out = asyncio.run(loop.run(stop=lambda: faults.retired is not None or store.done()))
        if faults.retired is not None:  # the groups in flight are written: what it holds is final
            faults.retire(admission.started - admission.given_back)
            out["retired"] = faults.retired
        return out
    finally:
        if workflow is not None:
            workflow.close()
        aengine.close()
        watcher.stop()
        engine.close()  # a remote engine stops the server it started
