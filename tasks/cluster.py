"""The cluster topology's own tasks and nodes: the steps around the roles (prepare_cluster,
start_run, the failure node mark_failed), the rollout and reward pools as map tasks of the role
tasks (tasks/roles.py), and the `single` pod that SFT and evaluation move to. Each task is one
call into areal_core/run/cluster.py; what the cluster config decides (images, resources,
replicas, the trainer's layout) is read when the workflow is serialized, not at import
(tasks/deferred.py).

The pools and the trainer share nothing but the run root: each stops when the trainer writes
DONE, and each resumes from the store when Flyte retries it (rollout workers continue their
sequence numbers, reward workers skip shards whose graded twin exists, the trainer restores its
newest committed checkpoint). These nodes must run concurrently, which flytekit's local executor
cannot do (it runs nodes one at a time): `grpo_cluster` is for `pyflyte run --remote`. Locally,
start the roles as separate processes (`pyflyte run tasks/roles.py rollout_worker --run_uri ...`),
or use `grpo`.
"""

from __future__ import annotations

import datetime
from typing import Any, NamedTuple

from flytekit import Email, WorkflowExecutionPhase, task
from flytekit.core.array_node_map_task import map_task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.error import FlyteError

from areal_core.config import ConfigError, RunConfig
from areal_core.layout import LAYOUT
from areal_core.run import cluster, pipeline
from tasks.deferred import Pod, cluster_image, pod_settings
from tasks.execution import bind_execution, refuse_local_workflow
from tasks.pipeline import Prepared, model_dir
from tasks.resources import SECRETS, image_name
from tasks.roles import reward_worker, rollout_worker

SMALL_POD = Pod("small")


@task(task_config=SMALL_POD, secret_requests=SECRETS)
def prepare_cluster(
    cfg: RunConfig, config: str, overrides: str, resume_run: bool, kickoff_time: datetime.datetime
) -> Prepared:
    """Validate the config with the cluster's worker counts and device, then write the run root.
    A scheduled execution gets its own run root: <store>/<kickoff time>."""
    refuse_local_workflow("grpo_cluster")
    try:
        return Prepared(*cluster.prepare_task(cfg, config, overrides, resume_run, kickoff_time))
    except ConfigError as exc:  # one frame under the message, not the stack
        raise ConfigError(str(exc)) from None


class Started(NamedTuple):
    run_uri: str
    init_model: FlyteDirectory


def registered_image() -> str:
    return image_name(cluster_image())


@task(task_config=SMALL_POD, secret_requests=SECRETS)
def start_run(run_uri: str, sft_checkpoint: str) -> Started:
    """Put the SFT checkpoint in the run root (a cache hit is copied, a vanished one recomputed)
    and open the run's MLflow run, tagged with the device and image."""
    bind_execution()
    uri = pipeline.start_run(run_uri, sft_checkpoint, cluster.pod_identity(registered_image))
    return Started(run_uri=uri, init_model=model_dir(uri, LAYOUT.init_model))


@task(task_config=SMALL_POD, secret_requests=SECRETS)
def mark_failed(
    cfg: RunConfig,
    config: str,
    overrides: str,
    resume_run: bool,
    model_name: str,
    kickoff_time: datetime.datetime,
    err: FlyteError | None = None,
) -> None:
    """grpo_cluster's failure node: the run's MLflow run (if one was opened) is marked FAILED.
    Its inputs are the workflow's, so it finds the run root the way prepare_cluster chose it."""
    cluster.mark_failed_task(cfg, config, overrides, kickoff_time)


# -- nodes of the workflow, made when it is compiled (serialization), from the cluster config -----
def _pool(worker, role: str, run_uri: Any) -> Any:
    """Every replica at once (concurrency = replicas), all must succeed: a missing rollout worker's
    admission share or a missing reward worker's shards would starve the trainer."""
    indices = cluster.pool_indices(cluster.registered_cluster(), role)
    return map_task(worker, concurrency=len(indices), bound_inputs={"run_uri"})(run_uri=run_uri, index=indices)


def rollout_pool(run_uri: Any) -> Any:
    return _pool(rollout_worker, "rollout", run_uri)


def reward_pool(run_uri: Any) -> Any:
    return _pool(reward_worker, "reward", run_uri)


def single_pod() -> dict[str, Any]:
    """`with_overrides` arguments that move a single-machine task (SFT, evaluation) to the cluster's
    image and its `single` pod."""
    pod = pod_settings("single")
    out = {
        "container_image": image_name(pod["container_image"]),
        "requests": pod["requests"],
        "limits": pod["limits"] or pod["requests"],
        "retries": pod["retries"],
    }
    return out | {k: pod[k] for k in ("accelerator", "pod_template") if k in pod}


def failure_notifications() -> list[Email]:
    """The scheduled launch plans e-mail `schedule.notify` when a run fails, times out or is aborted."""
    return [
        Email(
            phases=[WorkflowExecutionPhase.FAILED, WorkflowExecutionPhase.TIMED_OUT, WorkflowExecutionPhase.ABORTED],
            recipients_email=list(cluster.registered_cluster().schedule.notify),
        )
    ]
