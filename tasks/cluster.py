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

from flytekit import task
from flytekit.core.array_node_map_task import map_task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.error import FlyteError

from areal_core.config import RunConfig
from areal_core.layout import LAYOUT
from areal_core.run import cluster
from jobs import steps
from jobs.catalog import GRPO_CLUSTER
from jobs.spec import Given, Input, doc_of, function
from tasks.deferred import Pod, cluster_image, pod_settings
from tasks.execution import bind_execution, refuse_local_workflow
from tasks.pipeline import Prepared, model_dir
from tasks.resources import SECRETS, image_name
from tasks.roles import reward_worker, rollout_worker

SMALL_POD = Pod("small")
PREPARE_POD = Pod("prepare")  # the preflight loads model.path: sized by run/prepare_memory.py


@task(task_config=PREPARE_POD, secret_requests=SECRETS)
@doc_of(steps.prepare_cluster)
def prepare_cluster(
    cfg: RunConfig, config: str, overrides: str, resume_run: bool, kickoff_time: datetime.datetime
) -> Prepared:
    refuse_local_workflow("grpo_cluster")
    return Prepared(*steps.prepare_cluster(cfg, config, overrides, resume_run, kickoff_time))


class Started(NamedTuple):
    run_uri: str
    init_model: FlyteDirectory


def registered_image() -> str:
    return image_name(cluster_image())


@task(task_config=SMALL_POD, secret_requests=SECRETS)
@doc_of(steps.start_run)
def start_run(run_uri: str, sft_checkpoint: str) -> Started:
    bind_execution()
    uri = steps.start_run(run_uri, sft_checkpoint, registered_image)
    return Started(run_uri=uri, init_model=model_dir(uri, LAYOUT.init_model))


def _mark_failed(given: Given) -> None:
    cluster.mark_failed_task(given.cfg, given.config, given.overrides, given.kickoff_time)


# grpo_cluster's failure node: flytekit requires its inputs to be the workflow's (and `err`), so its
# signature is generated from the job spec with the workflow's
mark_failed = task(task_config=SMALL_POD, secret_requests=SECRETS)(
    function(
        GRPO_CLUSTER,
        _mark_failed,
        None,
        (Input("err", FlyteError | None, "the error the workflow failed with", None),),
        name="mark_failed",
        doc="grpo_cluster's failure node: the run's MLflow run (if one was opened) is marked FAILED; it finds "
        "the run root from the workflow's inputs, the way prepare_cluster chose it.",
    )
)


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
