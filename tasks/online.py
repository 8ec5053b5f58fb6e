"""Online tasks: one call each into areal_core.online: retrain, then register if better (nightly), and
continuous online RL (online/continuous.py)."""

from __future__ import annotations

import datetime
from typing import NamedTuple

from flytekit import task

from areal_core.online import continuous, retrain
from areal_core.run.cluster import scheduled
from tasks.deferred import ONE_MACHINE
from tasks.execution import bind_execution
from tasks.resources import ROLE, SECRETS, SMALL


class OnlineResult(NamedTuple):
    rows: int
    registered: bool
    model_uri: str
    current_score: float
    candidate_score: float


@task(task_config=ONE_MACHINE, requests=ROLE, retries=1, secret_requests=SECRETS)
def retrain_on_sessions(
    config: str, overrides: str, sessions: str, model_name: str, kickoff_time: datetime.datetime
) -> str:
    """Train a candidate on the sessions past the cursor and score it against the current model;
    returns the online run root."""
    return retrain.retrain_task(config, overrides, sessions, model_name, scheduled(kickoff_time))


@task(task_config=ONE_MACHINE, requests=SMALL, retries=2, secret_requests=SECRETS)
def register_if_better(run_uri: str, min_gain: float) -> OnlineResult:
    """Register the candidate only when it beats the champion (then promoted), then move the cursor."""
    bind_execution()
    return OnlineResult(**retrain.publish_task(run_uri, min_gain))


@task(task_config=ONE_MACHINE, requests=ROLE, retries=2, secret_requests=SECRETS)
def continuous_rl(run_uri: str, sft_checkpoint: str) -> str:
    """The reward pool and the trainer over the sessions the serving proxy writes into the run root,
    until train.steps; returns the final model's URI. Retried: the trainer resumes from its checkpoint."""
    bind_execution()
    return continuous.continuous_task(run_uri, sft_checkpoint)
