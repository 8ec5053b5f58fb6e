"""Replay task: one call into areal_core.run.replay (train again on a run's stored samples)."""

from __future__ import annotations

from typing import NamedTuple

from flytekit import task
from flytekit.types.directory import FlyteDirectory

from areal_core.layout import LAYOUT
from jobs import steps
from jobs.spec import doc_of
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
@doc_of(steps.replay)
def replay_run(run: str, into: str, overrides: str, layer: str = "graded") -> ReplayResult:
    bind_execution()
    out = steps.replay(run, into, overrides, layer)
    models = {name: model_dir(out["run_uri"], name) for name in (LAYOUT.init_model, LAYOUT.final_model)}
    return ReplayResult(**out, **models)
