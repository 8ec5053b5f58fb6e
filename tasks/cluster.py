"""The cluster topology's tasks: rollout and reward pools as map tasks, the trainer as a kfpytorch
`Elastic` task (torchrun; a PyTorchJob when nnodes > 1), plus the steps around them.

Images, resources, accelerators, retries, timeouts and replica counts come from the cluster
config read at import (areal_core/config/cluster.py: $AREAL_CLUSTER_CONFIG, default
configs/cluster.yaml), because Flyte fixes them at registration. The pools and the trainer share nothing but the run
root: each stops when the trainer writes DONE, and each resumes from the store when Flyte
retries it (rollout workers continue their sequence numbers, reward workers skip shards whose
graded twin exists, the trainer restores its newest committed checkpoint).

These nodes must run concurrently, which flytekit's local executor cannot do (it runs nodes one
at a time): `grpo_cluster` is for `pyflyte run --remote`. Locally, start the roles as separate
processes (`pyflyte run tasks/roles.py rollout_worker --run_uri ...`), or use `grpo`.
"""

from __future__ import annotations

import datetime

from flytekit import task
from flytekit.core.array_node_map_task import map_task
from flytekit.core.context_manager import ExecutionState, FlyteContextManager
from flytekitplugins.kfpytorch import Elastic

from areal_core.config.cluster import ClusterConfig, load_cluster_config
from images.specs import image_for
from tasks.execution import bind_execution, console_env
from tasks.pipeline import Prepared
from tasks.resources import task_kwargs

CLUSTER: ClusterConfig = load_cluster_config()
DEVICE = CLUSTER.device
IMAGE = image_for(DEVICE)


def image_name(spec) -> str:
    """The fully qualified name the image will be pushed under (recorded with registered models)."""
    try:
        return spec.image_name()
    except Exception:  # no builder available: the spec's own name
        return f"{spec.registry}/{spec.name}"


IMAGE_NAME = image_name(IMAGE)
# every cluster task knows the device and image it runs in (the registry tags use them)
ENV = {"AREAL_DEVICE": DEVICE, "AREAL_IMAGE": IMAGE_NAME, "PYTHONUNBUFFERED": "1", **console_env()}


def cluster_overrides(overrides: str, cluster: ClusterConfig, store_suffix: str = "", config: str = "") -> list[str]:
    """The user's overrides plus what the cluster fixes: worker counts (admission shares and reward
    shard ownership must match the pods) and the device; `store_suffix` gives each scheduled run
    its own run root under the configured one."""
    from areal_core.config import load_config
    from areal_core.run.pipeline import parse_overrides

    out = [
        *parse_overrides(overrides),
        f"rollout.num_workers={cluster.rollout.replicas}",
        f"reward.num_workers={cluster.reward.replicas}",
        f"device={cluster.device}",
    ]
    if store_suffix:
        base = load_config(config or None, out).store.rstrip("/")
        out.append(f"store={base}/{store_suffix}")
    return out


def check_backend(run_cfg, cluster: ClusterConfig) -> None:
    """The trainer backend's constraints on the model, checked before any work."""
    if cluster.trainer.backend == "megatron":
        from areal_core.megatron_backend import MegatronParallel, check_megatron_config

        check_megatron_config(
            run_cfg,
            MegatronParallel(
                tensor=cluster.trainer.tensor_parallel,
                pipeline=cluster.trainer.pipeline_parallel,
                world_size=cluster.world_size,
            ),
        )


def prepare_for_cluster(
    config: str, overrides: str, resume: bool, cluster: ClusterConfig, store_suffix: str = ""
) -> tuple[str, str]:
    from areal_core.config import load_config
    from areal_core.run import pipeline

    full = cluster_overrides(overrides, cluster, store_suffix, config)
    check_backend(load_config(config or None, full), cluster)
    return pipeline.prepare(config, full, resume)


def _refuse_local_workflow() -> None:
    state = FlyteContextManager.current_context().execution_state
    if state is not None and state.mode == ExecutionState.Mode.LOCAL_WORKFLOW_EXECUTION:
        raise RuntimeError(
            "grpo_cluster runs its rollout pool, reward pool and trainer concurrently, which flytekit's local "
            "executor cannot do (it runs nodes one at a time). Use `pyflyte run --remote workflows/grpo.py "
            "grpo_cluster`, or `workflows/grpo.py grpo` on one machine, or start each role with "
            "`pyflyte run tasks/roles.py <role> --run_uri ...` as separate processes."
        )


@task(container_image=IMAGE, environment=ENV, **task_kwargs(CLUSTER.small, DEVICE))
def prepare_cluster(
    config: str, overrides: str, resume_run: bool, kickoff_time: datetime.datetime | None = None
) -> Prepared:
    """Validate the config with the cluster's worker counts and device, then write the run root.
    A scheduled execution (kickoff_time set) gets its own run root: <store>/<kickoff time>."""
    _refuse_local_workflow()
    suffix = kickoff_time.strftime("%Y%m%dT%H%M%SZ") if kickoff_time else ""
    run_uri, key = prepare_for_cluster(config, overrides, resume_run, CLUSTER, suffix)
    return Prepared(run_uri=run_uri, sft_key=key)


@task(container_image=IMAGE, environment=ENV, **task_kwargs(CLUSTER.small, DEVICE))
def start_run(run_uri: str, init_model: str) -> str:
    """Copy a cached SFT result into the run root and open the run's MLflow run, tagged with the
    device and image."""
    from areal_core.run import pipeline

    bind_execution()
    return pipeline.start_run(run_uri, init_model, {"device": DEVICE, "image": IMAGE_NAME})


@task(container_image=IMAGE, environment=ENV, **task_kwargs(CLUSTER.rollout, DEVICE))
def rollout_pool_worker(run_uri: str, index: int) -> int:
    """Rollout worker `index` of the pool; returns the groups it started."""
    from areal_core.run.roles import rollout_task

    return rollout_task(run_uri, index)


@task(container_image=IMAGE, environment=ENV, **task_kwargs(CLUSTER.reward, DEVICE))
def reward_pool_worker(run_uri: str, index: int) -> int:
    """Reward worker `index` of the pool; returns the samples it graded."""
    from areal_core.run.roles import reward_task

    return reward_task(run_uri, index)


ELASTIC = Elastic(
    nnodes=CLUSTER.trainer.nnodes,
    nproc_per_node=CLUSTER.trainer.nproc_per_node,
    max_restarts=CLUSTER.trainer.max_restarts,
    start_method="spawn",
    # pods of a PyTorchJob may start minutes apart (image pulls, node scale-up)
    rdzv_configs={"timeout": 1200, "join_timeout": 1200, "read_timeout": 1200},
    increase_shared_mem=not CLUSTER.trainer.shared_memory,
)
_trainer_kwargs = task_kwargs(CLUSTER.trainer, DEVICE)
if CLUSTER.trainer.shared_memory:
    _trainer_kwargs["shared_memory"] = CLUSTER.trainer.shared_memory


@task(task_config=ELASTIC, container_image=IMAGE, environment=ENV, **_trainer_kwargs)
def trainer_elastic(run_uri: str) -> str:
    """Every torchrun rank runs this; rank 0's return value is the task's: the final model's URI."""
    from areal_core.run.roles import trainer_task

    return trainer_task(run_uri)


# The pools: every replica at once (concurrency = replicas), all must succeed (a missing rollout
# worker's admission share or a missing reward worker's shards would starve the trainer).
rollout_pool = map_task(rollout_pool_worker, concurrency=CLUSTER.rollout.replicas, bound_inputs={"run_uri"})
reward_pool = map_task(reward_pool_worker, concurrency=CLUSTER.reward.replicas, bound_inputs={"run_uri"})
ROLLOUT_INDICES = list(range(CLUSTER.rollout.replicas))
REWARD_INDICES = list(range(CLUSTER.reward.replicas))
