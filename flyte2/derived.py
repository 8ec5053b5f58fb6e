"""Runs derived from a run, with the Flyte 2 SDK: the jobs replay, fork, regrade and regrade_and_replay
of the job spec (jobs/catalog.py; flyte2/translate.py), each step one call of jobs/steps.py (as
tasks/replay.py, fork.py, regrade.py).

    flyte run --local flyte2/derived.py replay --run runs/default --into runs/replay-gspo --overrides "algo.loss=gspo"
    flyte run --local flyte2/derived.py fork --run runs/default --step 100 --into runs/fork --overrides "train.lr=1e-4"
    flyte run --local flyte2/derived.py regrade --run runs/default --layer strict-v2 --reward mypkg.rewards:strict
    flyte run --local flyte2/derived.py regrade_and_replay --run runs/default --layer strict-v2 --into runs/strict

A fork continues with its roles at once as Flyte tasks (flyte2/roles.py), as `grpo` does.
"""

from __future__ import annotations

from typing import Any

from flyte2.envs import DRIVER, ONE_MACHINE
from flyte2.grpo import Accuracy, failed_on_error, roles_and_evaluate
from flyte2.steps import bind_execution, evaluate
from flyte2.translate import job_task
from jobs import steps
from jobs.catalog import FORK, REGRADE, REGRADE_AND_REPLAY, REGRADED, REPLAY, REPLAYED
from jobs.spec import Given, doc_of

Replayed = REPLAYED.dataclass()
Regraded = REGRADED.dataclass()


@ONE_MACHINE.task
@doc_of(steps.replay)
def replay_run(run: str, into: str, overrides: str, layer: str = "graded") -> tuple[str, int, float, float]:
    bind_execution()
    out = steps.replay(run, into, overrides, layer)
    return out["run_uri"], out["steps"], out["max_loss_rel_diff"], out["max_grad_norm_rel_diff"]


@ONE_MACHINE.task
@doc_of(steps.fork)
def fork_run(run: str, step: int, into: str, overrides: str) -> tuple[str, str]:
    bind_execution()
    out = steps.fork(run, step, into, overrides)
    return out["run_uri"], out["sft_checkpoint"]


@ONE_MACHINE.task(retries=steps.RETRIES["regrade"])
@doc_of(steps.regrade)
def regrade_run(run: str, layer: str, reward: str, pool_size: int) -> Regraded:
    return Regraded(**steps.regrade(run, layer, reward, pool_size))


async def evaluated_replay(run: str, into: str, overrides: str, layer: str) -> Any:
    """A replay, then the held-out accuracy of what it trained (jobs/catalog.py: REPLAYED)."""
    root, steps_done, loss_diff, grad_diff = await replay_run.aio(run=run, into=into, overrides=overrides, layer=layer)
    before, after = await evaluate.aio(run_uri=root)
    return Replayed(steps_done, loss_diff, grad_diff, before, after)


async def _replay(given: Given) -> Any:
    return await evaluated_replay(given.run, given.into, given.overrides, given.layer)


async def _fork(given: Given) -> Any:
    child, checkpoint = await fork_run.aio(run=given.run, step=given.step, into=given.into, overrides=given.overrides)
    async with failed_on_error(child):
        return Accuracy(*await roles_and_evaluate(child, checkpoint, None, local=True))


async def _regrade(given: Given) -> Any:
    return await regrade_run.aio(run=given.run, layer=given.layer, reward=given.reward, pool_size=given.pool_size)


async def _regrade_and_replay(given: Given) -> Any:
    graded = await regrade_run.aio(run=given.run, layer=given.layer, reward=given.reward, pool_size=given.pool_size)
    return await evaluated_replay(given.run, given.into, given.overrides, graded.layer)


replay = job_task(DRIVER, REPLAY, _replay)
fork = job_task(DRIVER, FORK, _fork)
regrade = job_task(DRIVER, REGRADE, _regrade)
regrade_and_replay = job_task(DRIVER, REGRADE_AND_REPLAY, _regrade_and_replay)
