"""Replay task: one call into areal_core.run.replay (train again on a run's stored samples)."""

from __future__ import annotations

from typing import NamedTuple

from flytekit import task
from flytekit.types.directory import FlyteDirectory

from areal_core.layout import LAYOUT
from areal_core.run import replay as replay_lib
from tasks.deferred import ONE_MACHINE
from tasks.execution import bind_execution
from tasks.pipeline import model_dir
from tasks.resources import ROLE, SECRETS


class ReplayResult(NamedTuple):
    run_uri: str
    steps: int
    max_loss_rel_diff: float
    max_grad_norm_rel_diff: float
    init_model: FlyteDirectory
    final_model: FlyteDirectory


@task(task_config=ONE_MACHINE, requests=ROLE, secret_requests=SECRETS)
def replay_run(run: str, into: str, overrides: str, layer: str = "graded") -> ReplayResult:
    """Train on `run`'s samples (rewards from `layer`) in their recorded order into the new root `into`; the
    largest relative loss / grad-norm difference from the run's steps (-1: not recorded)."""
    bind_execution()
    out = replay_lib.replay_task(run, into, overrides, layer)
    models = {name: model_dir(out["run_uri"], name) for name in (LAYOUT.init_model, LAYOUT.final_model)}
    return ReplayResult(**out, **models)
