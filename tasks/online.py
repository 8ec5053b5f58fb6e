"""Online tasks: one call each into areal_core.online: retrain, then register if better (nightly), and
continuous online RL (online/continuous.py)."""

from __future__ import annotations

import datetime

from flytekit import task

from jobs import steps
from jobs.catalog import ONLINE_RESULT
from jobs.spec import doc_of
from tasks.deferred import ONE_MACHINE
from tasks.execution import bind_execution
from tasks.resources import ROLE, SECRETS, SMALL

OnlineResult = ONLINE_RESULT.named_tuple()


@task(task_config=ONE_MACHINE, requests=ROLE, retries=steps.RETRIES["retrain"], secret_requests=SECRETS)
@doc_of(steps.retrain)
def retrain_on_sessions(
    config: str, overrides: str, sessions: str, model_name: str, kickoff_time: datetime.datetime
) -> str:
    return steps.retrain(config, overrides, sessions, model_name, kickoff_time)


@task(task_config=ONE_MACHINE, requests=SMALL, retries=steps.RETRIES["publish"], secret_requests=SECRETS)
@doc_of(steps.publish)
def register_if_better(run_uri: str, min_gain: float) -> OnlineResult:
    bind_execution()
    return OnlineResult(**steps.publish(run_uri, min_gain))


@task(task_config=ONE_MACHINE, requests=ROLE, retries=steps.RETRIES["continuous"], secret_requests=SECRETS)
@doc_of(steps.continuous)
def continuous_rl(run_uri: str, sft_checkpoint: str) -> str:
    bind_execution()
    return steps.continuous(run_uri, sft_checkpoint)
