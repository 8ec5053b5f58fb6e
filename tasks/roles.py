"""Each role alone as a Flyte task: how the cluster topology runs them (and how tests start
them as separate `pyflyte run` processes here)."""

from __future__ import annotations

from flytekit import task

from areal_core.logs import setup_logging
from areal_core.run.roles import run_role
from tasks.resources import IMAGE, ROLE


@task(container_image=IMAGE, requests=ROLE, retries=3)
def rollout_worker(run_uri: str, index: int = 0) -> int:
    setup_logging()
    return int(run_role("rollout", run_uri, index)["groups"])


@task(container_image=IMAGE, requests=ROLE, retries=3)
def reward_worker(run_uri: str, index: int = 0) -> int:
    setup_logging()
    return int(run_role("reward", run_uri, index)["graded"])


@task(container_image=IMAGE, requests=ROLE, retries=3)
def trainer(run_uri: str) -> str:
    setup_logging()
    run_role("trainer", run_uri)
    return f"{run_uri.rstrip('/')}/final_model"
