"""Each role as a Flyte task, defined once: `grpo_cluster` maps the rollout and reward workers
over their pools and runs the trainer under torchrun (workflows/grpo.py), and
`pyflyte run tasks/roles.py <role> --run_uri ...` starts one as a local process (how tests run
the topology on one machine). Their pods are the cluster config's `rollout`, `reward` and
`trainer` pods, read at registration (tasks/deferred.py); a local run ignores them."""

from __future__ import annotations

from flytekit import task
from flytekit.types.directory import FlyteDirectory

from areal_core.layout import LAYOUT
from areal_core.run import roles
from tasks.deferred import Pod, Torchrun
from tasks.pipeline import model_dir
from tasks.resources import SECRETS


# Rollout and reward workers resume after a SIGKILL (sequence numbers, graded twins in the
# store), so they may run on preemptible capacity.
@task(task_config=Pod("rollout"), interruptible=True, secret_requests=SECRETS)
def rollout_worker(run_uri: str, index: int = 0) -> int:
    """Rollout worker `index`; returns the groups it started."""
    return roles.rollout_task(run_uri, index)


@task(task_config=Pod("reward"), interruptible=True, secret_requests=SECRETS)
def reward_worker(run_uri: str, index: int = 0) -> int:
    """Reward worker `index`; returns the samples it graded."""
    return roles.reward_task(run_uri, index)


@task(task_config=Torchrun(), secret_requests=SECRETS)
def trainer(run_uri: str) -> FlyteDirectory:
    """Every torchrun rank runs this; rank 0's return value is the task's: the final model."""
    roles.trainer_task(run_uri)
    return model_dir(run_uri, LAYOUT.final_model)
