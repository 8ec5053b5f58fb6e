"""The three roles as Flyte 2 tasks, and `run_roles`, which runs them at once: the rollout pool,
the reward pool and the trainer are concurrent async tasks awaited with `asyncio.gather` inside
the job's own task. They share nothing but the run root; each stops when the trainer writes DONE.

- `rollout_worker`, `reward_worker` (async; environments `areal_rollout`, `areal_reward`: warm
  pools through ReusePolicy, interruptible): each starts its role in a process of its own through
  the single-machine launcher (areal_core/run/launcher.py: `start_role(..., task=True)`, which runs
  `roles.rollout_task` / `roles.reward_task`, as the flytekit tasks do) and awaits it without
  holding the event loop. A process per call
  also keeps a reused container clean: a role's process-wide state (a fenced store, torch
  threads, caches) never reaches the next run that container serves.
- `trainer` (sync; environment `areal_trainer`, flyteplugins-pytorch Elastic): in a pod every
  torchrun rank runs `roles.trainer_task` in-process, as the flytekit Elastic task does. The
  plugin runs the function once, unlaunched, in a local run: there it starts the trainer as its
  own process, under torchrun when `train.nproc_per_node` > 1 (as the single-machine launcher does).

A role that fails stops the others: `run_roles` cancels the pool tasks (which stop their
processes) and signals the local trainer to stop its own. Each role resumes from the store when
Flyte retries it (areal_core/run/roles.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from dataclasses import dataclass, field

import flyte

from areal_core.run.launcher import Progress, RoleFailed, start_role, stop_all, wait_role
from areal_core.store import Store
from flyte2.envs import CLUSTER, REWARD, ROLLOUT, TRAINER, task_settings

POLL_S = 0.5
STOP_WAIT_S = 60.0  # how long a failing local run waits for its trainer process to be stopped


@dataclass
class LocalTrainer:
    """How `run_roles` stops a local trainer, which the Elastic plugin runs synchronously on a loop
    thread (a cancelled await cannot interrupt it): `stop` asks it to stop its process; `idle` is
    set while no trainer process of the run is alive."""

    stop: threading.Event = field(default_factory=threading.Event)
    idle: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.idle.set()


_LOCAL_TRAINERS: dict[str, LocalTrainer] = {}  # run URI -> its local trainer's controls


async def run_role(role: str, run_uri: str, index: int) -> object:
    """Start the role's process and await its exit without holding the event loop; when this is
    cancelled (another role failed, the run was aborted), stop the process and its children."""
    started = start_role(role, run_uri, index, task=True)
    try:
        while started.proc.poll() is None:
            await asyncio.sleep(POLL_S)
    except BaseException:
        await asyncio.to_thread(stop_all, [started])
        raise
    return wait_role(started, Store(run_uri))


def run_role_blocking(role: str, run_uri: str, nproc: int, local: LocalTrainer) -> object:
    """`run_role` for a sync task: wait in this thread; stop the process when `local.stop` is set."""
    local.idle.clear()  # before the check: run_roles, once it set `stop`, waits for this to be set again
    try:
        if local.stop.is_set():
            raise RoleFailed(f"role {role}-0 not started: another role of the run failed")
        started = start_role(role, run_uri, 0, nproc=nproc, task=True)
        try:
            while started.proc.poll() is None:
                if local.stop.wait(POLL_S):
                    raise RoleFailed(f"role {started.name} stopped: another role of the run failed")
        finally:
            if started.proc.poll() is None:
                stop_all([started])
    finally:
        local.idle.set()
    return wait_role(started, Store(run_uri))


@ROLLOUT.task(**task_settings(CLUSTER.rollout))
async def rollout_worker(run_uri: str, index: int = 0) -> int:
    """Rollout worker `index` (its own process); returns the groups it started."""
    return int(await run_role("rollout", run_uri, index))


@REWARD.task(**task_settings(CLUSTER.reward))
async def reward_worker(run_uri: str, index: int = 0) -> int:
    """Reward worker `index` (its own process); returns the samples it graded."""
    return int(await run_role("reward", run_uri, index))


@TRAINER.task(**task_settings(CLUSTER.trainer))
def trainer(run_uri: str) -> str:
    """The trainer; returns the final model's URI. In a pod: every torchrun rank of the Elastic task
    runs it here. In a local run: its own process (torchrun ranks when train.nproc_per_node > 1)."""
    from areal_core.run import roles

    if flyte.ctx().mode != "local":
        return roles.trainer_task(run_uri)
    from areal_core.context import load_run_config

    nproc = load_run_config(Store(run_uri)).train.nproc_per_node
    local = _LOCAL_TRAINERS.get(Store(run_uri).uri) or LocalTrainer()  # run_roles's, when it started it
    return str(run_role_blocking("trainer", run_uri, nproc, local))


async def _progress(run_uri: str, enabled: bool) -> None:
    """The launcher's one-line progress of the trainer's heartbeat (areal_core/run/launcher.py)."""
    bar = Progress(Store(run_uri), enabled)
    while enabled:
        await asyncio.to_thread(bar.update)
        await asyncio.sleep(1.0)


async def run_roles(
    run_uri: str, num_rollout: int, num_reward: int, timeout_s: float = 0, progress: bool = False
) -> str:
    """Every role of the run at once, as Flyte tasks, until the trainer writes DONE; returns the
    final model's URI. The first role to fail (or `timeout_s`, when > 0) stops the others."""
    uri = Store(run_uri).uri
    local = _LOCAL_TRAINERS.setdefault(uri, LocalTrainer())
    roles: list[Awaitable] = [trainer.aio(run_uri)]
    roles += [rollout_worker(run_uri, i) for i in range(num_rollout)]
    roles += [reward_worker(run_uri, i) for i in range(num_reward)]
    tasks = [asyncio.ensure_future(r) for r in roles]
    shown = asyncio.ensure_future(_progress(uri, progress))
    try:
        async with asyncio.timeout(timeout_s or None):
            results = await asyncio.gather(*tasks)
    except TimeoutError:
        raise RoleFailed(f"run did not finish within {timeout_s:.0f}s") from None
    finally:
        shown.cancel()
        if not all(t.done() for t in tasks):
            local.stop.set()  # kept set: a local retry of the trainer, already queued, stops at once too
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.to_thread(local.idle.wait, STOP_WAIT_S)  # no role process outlives the run
    _LOCAL_TRAINERS.pop(uri, None)
    if not Store(uri).done():
        raise RoleFailed("all roles finished but the trainer wrote no DONE")
    return results[0]
