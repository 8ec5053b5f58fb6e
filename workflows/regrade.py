"""Re-grade a run with a fixed or new reward, without generating again (areal_core/reward/regrade.py),
and optionally retrain on the re-graded samples (areal_core/run/replay.py).

    pyflyte run workflows/regrade.py regrade --run s3://bucket/runs/job --layer strict-v2 --reward mypkg.rewards:strict
    pyflyte run workflows/regrade.py regrade_and_replay --run runs/default --layer strict-v2 \\
        --reward mypkg.rewards:strict --into runs/default-strict

The new layer is written beside the old one (trajectories/regraded/{layer}/ in the run root),
never in place; its summary says how many rewards changed (which: changes.parquet).
"""

from __future__ import annotations

from flytekit import workflow

from tasks.pipeline import evaluate
from tasks.regrade import Regraded, regrade_run
from tasks.replay import replay_run
from workflows.replay import Replayed


@workflow
def regrade(run: str, layer: str, reward: str = "", pool_size: int = 2) -> Regraded:
    """Re-grade a run's graded samples into a new layer beside the old one.

    :param run: the run root (a local path or s3://...)
    :param layer: the new layer's name (letters, digits, '.', '_', '-')
    :param reward: the reward function, 'pkg.module:function'; empty: the run's own
    :param pool_size: grading processes
    """
    return regrade_run(run=run, layer=layer, reward=reward, pool_size=pool_size)


@workflow
def regrade_and_replay(
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
    graded = regrade_run(run=run, layer=layer, reward=reward, pool_size=pool_size)
    result = replay_run(run=run, into=into, overrides=overrides, layer=graded.layer)
    accuracy = evaluate(run_uri=result.run_uri, init_model=result.init_model, final_model=result.final_model)
    return result.steps, result.max_loss_rel_diff, result.max_grad_norm_rel_diff, accuracy.before, accuracy.after
