"""Each role alone as a Flyte task: how the cluster topology runs them (and how tests start
them as separate `pyflyte run` processes here)."""

from __future__ import annotations

from flytekit import task

from areal_core.run import roles
from tasks.resources import IMAGE, ROLE


@task(container_image=IMAGE, requests=ROLE, retries=3)
def rollout_worker(run_uri: str, index: int = 0) -> int:
    return roles.rollout_task(run_uri, index)


@task(container_image=IMAGE, requests=ROLE, retries=3)
def reward_worker(run_uri: str, index: int = 0) -> int:
    return roles.reward_task(run_uri, index)


@task(container_image=IMAGE, requests=ROLE, retries=3)
def trainer(run_uri: str) -> str:
    return roles.trainer_task(run_uri)
