"""The cluster topology's tasks: rollout and reward pools as map tasks, the trainer as a kfpytorch
`Elastic` task (torchrun; a PyTorchJob when nnodes > 1), plus the steps around them.

Images, resources, accelerators, retries, timeouts and replica counts come from the cluster
config read at import (areal_core/config/cluster.py: $AREAL_CLUSTER_CONFIG, default
configs/cluster.yaml), because Flyte fixes them at registration. The config travels with the
registered tasks: every task's environment carries it ($AREAL_CLUSTER_SPEC) with the image name,
so a pod, which imports this module without the file, rebuilds the registered config (replicas,
device, nproc_per_node of the Elastic trainer) and tags MLflow with the registered device and
image. The pools and the trainer share nothing but the run root: each stops when the trainer writes DONE, and each resumes from the store when Flyte
retries it (rollout workers continue their sequence numbers, reward workers skip shards whose
graded twin exists, the trainer restores its newest committed checkpoint).

These nodes must run concurrently, which flytekit's local executor cannot do (it runs nodes one
at a time): `grpo_cluster` is for `pyflyte run --remote`. Locally, start the roles as separate
processes (`pyflyte run tasks/roles.py rollout_worker --run_uri ...`), or use `grpo`.
"""

from __future__ import annotations

import datetime
import os
from typing import NamedTuple

from flytekit import Email, WorkflowExecutionPhase, task
from flytekit.core.array_node_map_task import map_task
from flytekit.core.context_manager import ExecutionState, FlyteContextManager
from flytekit.types.directory import FlyteDirectory
from flytekit.types.error import FlyteError
from flytekitplugins.kfpytorch import Elastic

from areal_core.config import RunConfig
from areal_core.config.cluster import CLUSTER_SPEC_ENV, ClusterConfig, cluster_spec, load_cluster_config
from areal_core.layout import LAYOUT
from images.specs import image_for
from tasks.execution import bind_execution, console_env
from tasks.pipeline import Prepared, model_dir
from tasks.resources import SECRETS, scheduled, task_kwargs

CLUSTER: ClusterConfig = load_cluster_config()
DEVICE = CLUSTER.device
IMAGE = image_for(DEVICE)


def image_name(spec) -> str:
    """The fully qualified name the image will be pushed under (recorded with registered models)."""
    try:
        return spec.image_name()
    except Exception:  # no builder available: the spec's own name
        return f"{spec.registry}/{spec.name}"


IMAGE_ENV = "AREAL_IMAGE"
# in a pod (the registered spec is in the environment) the registered image name, not a recomputed one
IMAGE_NAME = (os.environ.get(IMAGE_ENV, "") if os.environ.get(CLUSTER_SPEC_ENV) else "") or image_name(IMAGE)
# the scheduled launch plans e-mail `schedule.notify` when a run fails, times out or is aborted
FAILURE_NOTIFICATIONS = [
    Email(
        phases=[WorkflowExecutionPhase.FAILED, WorkflowExecutionPhase.TIMED_OUT, WorkflowExecutionPhase.ABORTED],
        recipients_email=list(CLUSTER.schedule.notify),
    )
]
# every cluster task carries the registered config, device and image (the registry tags use them)
ENV = {
    CLUSTER_SPEC_ENV: cluster_spec(CLUSTER),
    "AREAL_DEVICE": DEVICE,
    IMAGE_ENV: IMAGE_NAME,
    "PYTHONUNBUFFERED": "1",
    **console_env(),
}


def cluster_overrides(
    overrides: str, cluster: ClusterConfig, store_suffix: str = "", config: str = "", typed: RunConfig | None = None
) -> list[str]:
    """The user's overrides plus what the cluster fixes: worker counts (admission shares and reward
    shard ownership must match the pods) and the device; `store_suffix` gives each scheduled run
    its own run root under the configured one. The vLLM server's interpreter defaults to the
    image's own python (the pods run in one image; the local default, the project's .venv-vllm,
    is in no image); an override or a typed value of `rollout.server.python` wins."""
    import sys

    from areal_core.config import load_config
    from areal_core.config.run import DEFAULT_VLLM_PYTHON
    from areal_core.run.pipeline import parse_overrides

    user = parse_overrides(overrides)
    typed_python = typed is not None and typed.rollout.server.python != DEFAULT_VLLM_PYTHON
    image_python = [] if typed_python else [f"rollout.server.python={sys.executable}"]
    out = [
        *image_python,
        *user,
        f"rollout.num_workers={cluster.rollout.replicas}",
        f"reward.num_workers={cluster.reward.replicas}",
        f"device={cluster.device}",
    ]
    if store_suffix:
        base = load_config(config or None, out, typed).store.rstrip("/")
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


def cluster_config(
    config: str, overrides: str, cluster: ClusterConfig, store_suffix: str = "", typed: RunConfig | None = None
) -> tuple[RunConfig, list[str]]:
    """The run config a cluster run trains with, and the overrides that give it."""
    from areal_core.config import load_config

    full = cluster_overrides(overrides, cluster, store_suffix, config, typed)
    return load_config(config or None, full, typed), full


def prepare_for_cluster(
    config: str,
    overrides: str,
    resume: bool,
    cluster: ClusterConfig,
    store_suffix: str = "",
    typed: RunConfig | None = None,
) -> tuple[str, str]:
    from areal_core.run import pipeline

    cfg, full = cluster_config(config, overrides, cluster, store_suffix, typed)
    check_backend(cfg, cluster)
    return pipeline.prepare(config, full, resume, typed)


def kickoff_suffix(kickoff_time: datetime.datetime) -> str:
    """A scheduled run's own run root under the configured store: <kickoff time>; '' for a manual run."""
    at = scheduled(kickoff_time)
    return at.strftime("%Y%m%dT%H%M%SZ") if at else ""


def _refuse_local_workflow() -> None:
    state = FlyteContextManager.current_context().execution_state
    if state is not None and state.mode == ExecutionState.Mode.LOCAL_WORKFLOW_EXECUTION:
        raise RuntimeError(
            "grpo_cluster runs its rollout pool, reward pool and trainer concurrently, which flytekit's local "
            "executor cannot do (it runs nodes one at a time). Use `pyflyte run --remote --copy all workflows/grpo.py "
            "grpo_cluster`, or `workflows/grpo.py grpo` on one machine, or start each role with "
            "`pyflyte run tasks/roles.py <role> --run_uri ...` as separate processes."
        )


@task(container_image=IMAGE, environment=ENV, secret_requests=SECRETS, **task_kwargs(CLUSTER.small, DEVICE))
def prepare_cluster(
    cfg: RunConfig, config: str, overrides: str, resume_run: bool, kickoff_time: datetime.datetime
) -> Prepared:
    """Validate the config with the cluster's worker counts and device, then write the run root.
    A scheduled execution gets its own run root: <store>/<kickoff time>."""
    _refuse_local_workflow()
    run_uri, key = prepare_for_cluster(config, overrides, resume_run, CLUSTER, kickoff_suffix(kickoff_time), cfg)
    return Prepared(run_uri=run_uri, sft_key=key)


class Started(NamedTuple):
    run_uri: str
    init_model: FlyteDirectory


@task(container_image=IMAGE, environment=ENV, secret_requests=SECRETS, **task_kwargs(CLUSTER.small, DEVICE))
def start_run(run_uri: str, sft_checkpoint: str) -> Started:
    """Put the SFT checkpoint in the run root (a cache hit is copied, a vanished one recomputed)
    and open the run's MLflow run, tagged with the device and image."""
    from areal_core.run import pipeline

    bind_execution()
    uri = pipeline.start_run(run_uri, sft_checkpoint, {"device": DEVICE, "image": IMAGE_NAME})
    return Started(run_uri=uri, init_model=model_dir(uri, LAYOUT.init_model))


@task(container_image=IMAGE, environment=ENV, secret_requests=SECRETS, **task_kwargs(CLUSTER.small, DEVICE))
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
    from areal_core.run import pipeline

    run_cfg, _ = cluster_config(config, overrides, CLUSTER, kickoff_suffix(kickoff_time), cfg)
    pipeline.mark_failed(run_cfg.store)


# Rollout and reward workers resume after a SIGKILL (sequence numbers, graded twins in the
# store), so they may run on preemptible capacity.
@task(
    container_image=IMAGE,
    environment=ENV,
    interruptible=True,
    secret_requests=SECRETS,
    **task_kwargs(CLUSTER.rollout, DEVICE),
)
def rollout_pool_worker(run_uri: str, index: int) -> int:
    """Rollout worker `index` of the pool; returns the groups it started."""
    from areal_core.run.roles import rollout_task

    return rollout_task(run_uri, index)


@task(
    container_image=IMAGE,
    environment=ENV,
    interruptible=True,
    secret_requests=SECRETS,
    **task_kwargs(CLUSTER.reward, DEVICE),
)
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


@task(task_config=ELASTIC, container_image=IMAGE, environment=ENV, secret_requests=SECRETS, **_trainer_kwargs)
def trainer_elastic(run_uri: str) -> FlyteDirectory:
    """Every torchrun rank runs this; rank 0's return value is the task's: the final model."""
    from areal_core.run.roles import trainer_task

    trainer_task(run_uri)
    return model_dir(run_uri, LAYOUT.final_model)


# The pools: every replica at once (concurrency = replicas), all must succeed (a missing rollout
# worker's admission share or a missing reward worker's shards would starve the trainer).
rollout_pool = map_task(rollout_pool_worker, concurrency=CLUSTER.rollout.replicas, bound_inputs={"run_uri"})
reward_pool = map_task(reward_pool_worker, concurrency=CLUSTER.reward.replicas, bound_inputs={"run_uri"})
ROLLOUT_INDICES = list(range(CLUSTER.rollout.replicas))
REWARD_INDICES = list(range(CLUSTER.reward.replicas))
