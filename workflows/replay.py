"""Replay a run: train again on its stored graded samples, in the order its trainer consumed
them, under its own config or another one (areal_core/run/replay.py), then evaluate.

    pyflyte run workflows/replay.py replay --run runs/default --into runs/replay-gspo --overrides "algo.loss=gspo"

With no overrides, the replay reproduces the run's per-step loss and grad-norm; the result
gives the largest relative difference. A run on S3 replays into an S3 root the same way.
"""

from __future__ import annotations

from typing import Any

from jobs.catalog import REPLAY
from jobs.spec import Given
from tasks.pipeline import evaluate
from tasks.replay import replay_run
from workflows.translate import workflow_of


def evaluated_replay(result: Any) -> Any:
    """A replay's outputs (jobs/catalog.py: REPLAYED): its comparison, then the held-out accuracy."""
    accuracy = evaluate(run_uri=result.run_uri, init_model=result.init_model, final_model=result.final_model)
    return result.steps, result.max_loss_rel_diff, result.max_grad_norm_rel_diff, accuracy.before, accuracy.after


def _replay(given: Given) -> Any:
    return evaluated_replay(replay_run(run=given.run, into=given.into, overrides=given.overrides, layer=given.layer))


replay = workflow_of(REPLAY, _replay)
