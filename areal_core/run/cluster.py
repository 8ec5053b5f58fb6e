"""A cluster run without Flyte: what `grpo_cluster`'s tasks decide, as plain functions
(tasks/cluster.py, tasks/register.py and tasks/deferred.py call them; nothing here imports flytekit).

- The cluster config of this process, read on first use and never at import (`registered_cluster`):
  in a pod the one it was registered with ($AREAL_CLUSTER_SPEC, which every cluster task's spec
  carries), when registering the file of $AREAL_CLUSTER_CONFIG, else configs/cluster.yaml.
- The run config a cluster run trains with: the cluster forces its worker counts and device
  (admission shares and reward-shard ownership must match the pods), the trainer backend's
  constraints are checked before any work, a scheduled run gets its own run root.
- What every cluster task's pod carries (`pod_env`) and the device and image a task reports
  (`pod_identity`); the trainer's torchrun layout (`trainer_layout`).
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from areal_core.config import RunConfig, load_config
from areal_core.config.cluster import CLUSTER_SPEC_ENV, ClusterConfig, cluster_spec, load_cluster_config
from areal_core.config.run import DEFAULT_VLLM_PYTHON

IMAGE_ENV = "AREAL_IMAGE"  # the registered image's full name, in every cluster task's environment
DEVICE_ENV = "AREAL_DEVICE"
POOLS = ("rollout", "reward")  # the roles that run as a pool of replicas (map tasks)
# The kickoff_time default of a workflow that a schedule also launches: a manual run. FlyteAdmin
# accepts a schedule only when its kickoff input is a plain datetime (not Optional), so "not
# scheduled" is this value rather than None.
UNSCHEDULED = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


@functools.cache
def registered_cluster() -> ClusterConfig:
    """This process's cluster config, read once, when first asked for: the registered spec in a
    pod ($AREAL_CLUSTER_SPEC), else $AREAL_CLUSTER_CONFIG, else configs/cluster.yaml."""
    return load_cluster_config()


# -- a scheduled run ------------------------------------------------------------------------------
def scheduled(kickoff_time: datetime.datetime) -> datetime.datetime | None:
    """The schedule's kickoff time, or None for a manual run (UNSCHEDULED)."""
    same = kickoff_time.replace(tzinfo=kickoff_time.tzinfo or datetime.UTC) == UNSCHEDULED
    return None if same else kickoff_time


def kickoff_suffix(kickoff_time: datetime.datetime) -> str:
    """A scheduled run's own run root under the configured store: <kickoff time>; '' for a manual run."""
    at = scheduled(kickoff_time)
    return at.strftime("%Y%m%dT%H%M%SZ") if at else ""


# -- the run config of a cluster run --------------------------------------------------------------
def cluster_overrides(
    overrides: str | list[str],
    cluster: ClusterConfig,
    store_suffix: str = "",
    config: str = "",
    typed: RunConfig | None = None,
) -> list[str]:
    """The user's overrides plus what the cluster fixes: worker counts (admission shares and reward
    shard ownership must match the pods) and the device; `store_suffix` gives each scheduled run
    its own run root under the configured one. The vLLM server's interpreter defaults to the
    image's own python (the pods run in one image; the local default, the project's .venv-vllm,
    is in no image); an override or a typed value of `rollout.server.python` wins."""
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


def check_backend(run_cfg: RunConfig, cluster: ClusterConfig) -> None:
    """The trainer backend's constraints on the model, checked before any work."""
    if cluster.trainer.backend == "megatron":
        from areal_core.megatron.checks import check_megatron_config
        from areal_core.megatron.shapes import MegatronParallel

        check_megatron_config(
            run_cfg,
            MegatronParallel(
                tensor=cluster.trainer.tensor_parallel,
                pipeline=cluster.trainer.pipeline_parallel,
                world_size=cluster.world_size,
            ),
        )


def cluster_config(
    config: str,
    overrides: str | list[str],
    cluster: ClusterConfig,
    store_suffix: str = "",
    typed: RunConfig | None = None,
) -> tuple[RunConfig, list[str]]:
    """The run config a cluster run trains with, and the overrides that give it."""
    full = cluster_overrides(overrides, cluster, store_suffix, config, typed)
    return load_config(config or None, full, typed), full


def prepare_for_cluster(
    config: str,
    overrides: str | list[str],
    resume: bool,
    cluster: ClusterConfig,
    store_suffix: str = "",
    typed: RunConfig | None = None,
) -> tuple[str, str]:
    """Validate the run config with the cluster's worker counts, device and backend, then write the
    run root; (run URI, SFT key) as `pipeline.prepare`."""
    from areal_core.run import pipeline

    cfg, full = cluster_config(config, overrides, cluster, store_suffix, typed)
    check_backend(cfg, cluster)
    return pipeline.prepare(config, full, resume, typed)


def prepare_task(
    typed: RunConfig,
    config: str,
    overrides: str,
    resume: bool,
    kickoff_time: datetime.datetime,
    cluster: ClusterConfig | None = None,
) -> tuple[str, str]:
    """What `prepare_cluster` does: `prepare_for_cluster` with this process's cluster config; a
    scheduled execution gets its own run root <store>/<kickoff time>."""
    cluster = cluster or registered_cluster()
    return prepare_for_cluster(config, overrides, resume, cluster, kickoff_suffix(kickoff_time), typed)


def mark_failed_task(
    typed: RunConfig,
    config: str,
    overrides: str,
    kickoff_time: datetime.datetime,
    cluster: ClusterConfig | None = None,
) -> bool:
    """What the failure node does: find the run root from the workflow's inputs, the way
    `prepare_task` chose it, and mark its MLflow run (if one was opened) FAILED."""
    from areal_core.run import pipeline

    cluster = cluster or registered_cluster()
    run_cfg, _ = cluster_config(config, overrides, cluster, kickoff_suffix(kickoff_time), typed)
    return pipeline.mark_failed(run_cfg.store)


# -- what a cluster task's pod carries ------------------------------------------------------------
def pod_env(cluster: ClusterConfig, image: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every cluster task is registered with: the cluster config itself (a pod
    has no config file; `registered_cluster` reads it back), the device and the image's name."""
    return {
        CLUSTER_SPEC_ENV: cluster_spec(cluster),
        DEVICE_ENV: cluster.device,
        IMAGE_ENV: image,
        "PYTHONUNBUFFERED": "1",
        **(extra or {}),
    }


def pod_identity(default_image: Callable[[], str], cluster: ClusterConfig | None = None) -> dict[str, str]:
    """The device and image a cluster task runs in (MLflow tags): in a pod the registered ones,
    else (a local call) the cluster config's device and `default_image()`."""
    cluster = cluster or registered_cluster()
    registered = os.environ.get(IMAGE_ENV, "") if os.environ.get(CLUSTER_SPEC_ENV) else ""
    return {"device": cluster.device, "image": registered or default_image()}


def pool_indices(cluster: ClusterConfig, role: str) -> list[int]:
    """The worker indices of a pool: one map-task element (one pod) per replica."""
    if role not in POOLS:
        raise ValueError(f"{role!r} is not a pool; expected one of {POOLS}")
    return list(range(getattr(cluster, role).replicas))


@dataclass(frozen=True)
class TorchrunLayout:
    """The trainer's torchrun layout: nnodes > 1 is a PyTorchJob of that many pods, each running
    nproc_per_node ranks; max_restarts restarts of the worker group inside one attempt."""

    nnodes: int = 1
    nproc_per_node: int = 1
    max_restarts: int = 0
    # pods of a PyTorchJob may start minutes apart (image pulls, node scale-up)
    rendezvous_timeout_s: int = 1200

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def trainer_layout(cluster: ClusterConfig) -> TorchrunLayout:
    t = cluster.trainer
    return TorchrunLayout(t.nnodes, t.nproc_per_node, t.max_restarts)
