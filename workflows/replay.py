"""Replay a run: train again on its stored graded samples, in the order its trainer consumed
them, under its own config or another one (areal_core/run/replay.py), then evaluate.

    pyflyte run workflows/replay.py replay --run runs/default --into runs/replay-gspo --overrides "algo.loss=gspo"

With no overrides, the replay reproduces the run's per-step loss and grad-norm; the result
gives the largest relative difference. A run on S3 replays into an S3 root the same way.
"""

from __future__ import annotations

from typing import NamedTuple

from flytekit import workflow

from tasks.pipeline import evaluate
from tasks.replay import replay_run


class Replayed(NamedTuple):
    steps: int
    max_loss_rel_diff: float
    max_grad_norm_rel_diff: float
    before: float
    after: float


@workflow
def replay(run: str, into: str, overrides: str = "", layer: str = "graded") -> Replayed:
    """Train on a run's stored samples in their recorded order into a new run root, then evaluate.

    :param run: the run root to replay (a local path or s3://...)
    :param into: a new, empty run root for the replay
    :param overrides: dotted key=value settings over the run's config (algo.*, train.*, seed ...), split as a shell does
    :param layer: the samples' rewards: 'graded' (the run's) or a committed re-graded layer (workflows/regrade.py)
    """
    result = replay_run(run=run, into=into, overrides=overrides, layer=layer)
    accuracy = evaluate(run_uri=result.run_uri, init_model=result.init_model, final_model=result.final_model)
    return result.steps, result.max_loss_rel_diff, result.max_grad_norm_rel_diff, accuracy.before, accuracy.after
