"""Runs derived from a run, with the Flyte 2 SDK: the jobs of workflows/replay.py, fork.py and
regrade.py, each step one call into areal_core (as tasks/replay.py, fork.py, regrade.py).

    flyte run --local flyte2/derived.py replay --run runs/default --into runs/replay-gspo --overrides "algo.loss=gspo"
    flyte run --local flyte2/derived.py fork --run runs/default --step 100 --into runs/fork --overrides "train.lr=1e-4"
    flyte run --local flyte2/derived.py regrade --run runs/default --layer strict-v2 --reward mypkg.rewards:strict
    flyte run --local flyte2/derived.py regrade_and_replay --run runs/default --layer strict-v2 --into runs/strict

A fork continues with its roles at once as Flyte tasks (flyte2/roles.py), as `grpo` does.
"""

from __future__ import annotations

import asyncio
import dataclasses

from areal_core.context import load_run_config
from areal_core.reward.regrade import regrade as regrade_lib
from areal_core.run import fork as fork_lib
from areal_core.run import replay as replay_lib
from areal_core.store import Store
from flyte2.envs import DRIVER, ONE_MACHINE
from flyte2.grpo import train
from flyte2.steps import bind_execution, evaluate, mark_failed, start_run


@dataclasses.dataclass
class Replayed:
    steps: int
    max_loss_rel_diff: float
    max_grad_norm_rel_diff: float
    before: float
    after: float


@dataclasses.dataclass
class Regraded:
    layer: str
    samples: int
    changed: int
    samples_per_s: float


@ONE_MACHINE.task
def replay_run(run: str, into: str, overrides: str, layer: str = "graded") -> tuple[str, int, float, float]:
    """Train on `run`'s samples (rewards from `layer`) in their recorded order into the new root `into`;
    (root, steps, largest relative loss / grad-norm difference from the run's steps, -1: not recorded)."""
    bind_execution()
    out = replay_lib.replay_task(run, into, overrides, layer)
    return out["run_uri"], out["steps"], out["max_loss_rel_diff"], out["max_grad_norm_rel_diff"]


@ONE_MACHINE.task
def fork_run(run: str, step: int, into: str, overrides: str) -> tuple[str, str]:
    """Make the child root `into` from `run`'s checkpoint at `step`; (its root, its initial model)."""
    bind_execution()
    out = fork_lib.fork_task(run, step, into, overrides)
    return out["run_uri"], out["sft_checkpoint"]


@ONE_MACHINE.task(retries=2)
def regrade_run(run: str, layer: str, reward: str, pool_size: int) -> Regraded:
    """Re-grade `run`'s graded samples with `reward` ('' = the run's own) into the layer `layer`."""
    summary = regrade_lib(run, reward or None, layer, pool_size=pool_size).summary()
    return Regraded(layer, summary["samples"], summary["changed"], summary["samples_per_s"])


async def _replay_and_evaluate(run: str, into: str, overrides: str, layer: str) -> Replayed:
    root, steps, loss_diff, grad_diff = await replay_run.aio(run=run, into=into, overrides=overrides, layer=layer)
    before, after = await evaluate.aio(run_uri=root)
    return Replayed(steps, loss_diff, grad_diff, before, after)


@DRIVER.task
async def replay(run: str, into: str, overrides: str = "", layer: str = "graded") -> Replayed:
    """Train on a run's stored samples in their recorded order into a new run root, then evaluate.

    :param run: the run root to replay (a local path or s3://...)
    :param into: a new, empty run root for the replay
    :param overrides: dotted key=value settings over the run's config (algo.*, train.*, seed ...), split as a shell does
    :param layer: the samples' rewards: 'graded' (the run's) or a committed re-graded layer
    """
    return await _replay_and_evaluate(run, into, overrides, layer)


@DRIVER.task
async def fork(run: str, step: int, into: str, overrides: str = "") -> tuple[float, float]:
    """Continue a run from its checkpoint at `step` in a new run root under new settings, to DONE; then evaluate.

    :param run: the run root to fork (a local path or s3://...)
    :param step: a step with a committed checkpoint (trainer/checkpoints/step-N)
    :param into: a new, empty run root for the child
    :param overrides: dotted key=value settings over the parent's config (train.*, algo.*, ...; not model, sft, seed)
    """
    child, checkpoint = await fork_run.aio(run=run, step=step, into=into, overrides=overrides)
    try:
        await start_run.aio(run_uri=child, sft_checkpoint=checkpoint)
        cfg = load_run_config(Store(child))
        await train(child, cfg.rollout.num_workers, cfg.reward.num_workers, local=True)
        return await evaluate.aio(run_uri=child)
    except BaseException:
        await asyncio.to_thread(mark_failed, child)
        raise


@DRIVER.task
async def regrade(run: str, layer: str, reward: str = "", pool_size: int = 2) -> Regraded:
    """Re-grade a run's graded samples into a new layer beside the old one.

    :param run: the run root (a local path or s3://...)
    :param layer: the new layer's name (letters, digits, '.', '_', '-')
    :param reward: the reward function, 'pkg.module:function'; empty: the run's own
    :param pool_size: grading processes
    """
    return await regrade_run.aio(run=run, layer=layer, reward=reward, pool_size=pool_size)


@DRIVER.task
async def regrade_and_replay(
    run: str, layer: str, into: str, reward: str = "", pool_size: int = 2, overrides: str = ""
) -> Replayed:
    """Re-grade a run into a new layer, retrain on its samples with the new rewards in their recorded order; evaluate.

    :param run: the run root (a local path or s3://...)
    :param layer: the new layer's name (letters, digits, '.', '_', '-')
    :param into: a new, empty run root for the retraining
    :param reward: the reward function, 'pkg.module:function'; empty: the run's own
    :param pool_size: grading processes
    :param overrides: dotted key=value settings over the run's config for the retraining (algo.*, train.* ...)
    """
    graded = await regrade_run.aio(run=run, layer=layer, reward=reward, pool_size=pool_size)
    return await _replay_and_evaluate(run, into, overrides, graded.layer)
