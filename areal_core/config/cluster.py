"""The cluster topology of `grpo_cluster` (workflows/grpo.py): pods, replicas, accelerators and
the trainer's parallel layout. tasks/resources.py maps it to Flyte task arguments.

    cluster = load_cluster_config()   # $AREAL_CLUSTER_SPEC, else $AREAL_CLUSTER_CONFIG, else configs/cluster.yaml

The config travels with the registered entity: tasks/cluster.py writes `cluster_spec(cluster)`
into every cluster task's environment ($AREAL_CLUSTER_SPEC), so a pod, which imports the task's
module without $AREAL_CLUSTER_CONFIG or the file, rebuilds the very config it was registered with.

Every key is checked: an unknown key or a bad value is a one-line ConfigError naming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import BeforeValidator, Field, model_validator

from areal_core.config.base import PROJECT_ROOT, ConfigModel, Int, Invalid, Str, read_yaml_file
from areal_core.config.cron import cron_error
from areal_core.config.device import Device

CLUSTER_CONFIG_ENV = "AREAL_CLUSTER_CONFIG"
CLUSTER_SPEC_ENV = "AREAL_CLUSTER_SPEC"  # the config itself, as JSON: set in the registered task spec
DEFAULT_CLUSTER_CONFIG = PROJECT_ROOT / "configs" / "cluster.yaml"
QUANTITIES = ("cpu", "mem", "ephemeral_storage")


def _quantities(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or set(value) - set(QUANTITIES):
        raise ValueError(f"must map {'/'.join(QUANTITIES)} to quantities, got {value!r}")
    return {k: str(v) for k, v in value.items()}


Quantities = Annotated[dict[str, str], BeforeValidator(_quantities)]


class PodSpec(ConfigModel):
    requests: Quantities = Field(default_factory=lambda: {"cpu": "1", "mem": "2Gi"})
    limits: Quantities = Field(default_factory=dict)
    accelerators: Int = Field(0, ge=0)  # GPUs (cuda) or NPUs (npu) per pod
    accelerator_type: Str = ""  # cuda: a node-selector device name, e.g. nvidia-h100-80gb
    retries: Int = Field(2, ge=0)
    timeout_s: Int = Field(0, ge=0)  # 0: no timeout


def prepare_pod() -> PodSpec:
    """The prepare pod's default: the memory prepare needs for the largest checkpoint it loads
    (config/pod_memory.py: prepare_pod_memory; docs/cluster.md), one CPU."""
    from areal_core.config.pod_memory import prepare_pod_memory

    quantities = {"cpu": "1", "mem": prepare_pod_memory()}
    return PodSpec(requests=quantities, limits=dict(quantities))


class PoolSpec(PodSpec):
    replicas: Int = Field(1, ge=1)


class TrainerSpec(PodSpec):
    nnodes: Int = Field(1, ge=1)
    nproc_per_node: Int = Field(1, ge=1)
    max_restarts: Int = Field(0, ge=0)
    shared_memory: Str = ""
    backend: Literal["fsdp2", "megatron"] = "fsdp2"
    tensor_parallel: Int = Field(1, ge=1)
    pipeline_parallel: Int = Field(1, ge=1)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @model_validator(mode="after")
    def _layout(self) -> Self:
        if self.backend == "fsdp2":
            for key in ("tensor_parallel", "pipeline_parallel"):
                if getattr(self, key) != 1:
                    raise Invalid(key, "> 1 needs backend megatron")
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if self.world_size % model_parallel:
            raise Invalid(
                "nproc_per_node",
                f"gives world size {self.world_size} (nnodes x nproc_per_node), "
                f"not a multiple of tensor_parallel x pipeline_parallel = {model_parallel}",
            )
        return self


class ScheduleSpec(ConfigModel):
    cron: Str = "0 3 * * 1"
    config: Str = "configs/default.yaml"
    overrides: Str = ""
    model_name: Str = "areal-flyte-policy"
    # e-mailed when a scheduled run fails, times out or is aborted (a launch-plan notification)
    notify: list[Str] = Field(default_factory=lambda: ["areal-oncall@example.com"], min_length=1)

    @model_validator(mode="after")
    def _admin_accepts_cron(self) -> Self:
        if err := cron_error(self.cron):  # flytekit accepts more (croniter) than FlyteAdmin does
            raise Invalid("cron", f"is not a cron expression FlyteAdmin accepts ({err})")
        return self


class ClusterConfig(ConfigModel):
    error_label: ClassVar[str] = "cluster config"

    device: Device = "cpu"
    rollout: PoolSpec = Field(default_factory=PoolSpec)
    reward: PoolSpec = Field(default_factory=PoolSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    small: PodSpec = Field(default_factory=PodSpec)
    prepare: PodSpec = Field(default_factory=prepare_pod)  # prepare loads model.path for its checks
    single: PodSpec = Field(default_factory=PodSpec)  # SFT and evaluation
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)

    @property
    def world_size(self) -> int:
        return self.trainer.world_size

    @model_validator(mode="after")
    def _fits_device(self) -> Self:
        t = self.trainer
        if t.backend == "megatron" and self.device != "cuda":
            raise Invalid("trainer.backend", "megatron needs device cuda")
        for name in ("rollout", "reward", "trainer", "small", "prepare", "single"):
            if getattr(self, name).accelerators and self.device == "cpu":
                raise Invalid(f"{name}.accelerators", "must be 0 on device cpu")
        if self.device != "cpu" and t.accelerators and t.nproc_per_node != t.accelerators:
            raise Invalid("trainer.nproc_per_node", "must equal 'trainer.accelerators' (one process per device)")
        return self


def cluster_config_path() -> Path:
    return Path(os.environ.get(CLUSTER_CONFIG_ENV) or DEFAULT_CLUSTER_CONFIG)


def cluster_config_from_dict(data: Any) -> ClusterConfig:
    return ClusterConfig.from_data(data)


def cluster_spec(cluster: ClusterConfig) -> str:
    """The config as the one-line JSON a task spec carries in $AREAL_CLUSTER_SPEC."""
    return json.dumps(cluster.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def load_cluster_config(path: str | os.PathLike | None = None) -> ClusterConfig:
    """`path`; else the registered spec ($AREAL_CLUSTER_SPEC, set in a pod by its task spec); else
    the file named by $AREAL_CLUSTER_CONFIG; else configs/cluster.yaml."""
    if not path and os.environ.get(CLUSTER_SPEC_ENV):
        return cluster_config_from_dict(json.loads(os.environ[CLUSTER_SPEC_ENV]))
    p = Path(path) if path else cluster_config_path()
    return cluster_config_from_dict(read_yaml_file(p, "cluster config", f" (set ${CLUSTER_CONFIG_ENV})"))
