"""Images and resources the tasks request (cluster values; the local executor ignores them).

Single-machine tasks (tasks/pipeline.py, tasks/roles.py) use IMAGE, SMALL and ROLE. The cluster
workflow (tasks/cluster.py, workflows/grpo.py: grpo_cluster) reads its topology from a YAML file
AT IMPORT, because Flyte fixes resources, images and replica counts when a workflow is
registered:

    AREAL_CLUSTER_CONFIG=configs/my-cluster.yaml pyflyte run --remote workflows/grpo.py grpo_cluster

Default: configs/cluster.yaml next to this project. `load_cluster_config` validates every key
(an unknown key or a bad value is a one-line error naming it).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from flytekit import PodTemplate, Resources

from images.specs import DEVICES, cpu_image

IMAGE = cpu_image()
SMALL = Resources(cpu="1", mem="2Gi")
ROLE = Resources(cpu="2", mem="8Gi")

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CLUSTER_CONFIG_ENV = "AREAL_CLUSTER_CONFIG"
DEFAULT_CLUSTER_CONFIG = PROJECT_ROOT / "configs" / "cluster.yaml"
# Kubernetes extended-resource names of the accelerators (the device plugins' names).
ACCELERATOR_RESOURCE = {"cuda": "nvidia.com/gpu", "npu": "huawei.com/Ascend910"}


class ClusterConfigError(ValueError):
    """A bad cluster config; the message names the key."""


@dataclass
class PodSpec:
    requests: dict[str, str] = field(default_factory=lambda: {"cpu": "1", "mem": "2Gi"})
    limits: dict[str, str] = field(default_factory=dict)
    accelerators: int = 0  # GPUs (cuda) or NPUs (npu) per pod
    accelerator_type: str = ""  # cuda: a node-selector device name, e.g. nvidia-h100-80gb
    retries: int = 2
    timeout_s: int = 0  # 0: no timeout


@dataclass
class PoolSpec(PodSpec):
    replicas: int = 1


@dataclass
class TrainerSpec(PodSpec):
    nnodes: int = 1
    nproc_per_node: int = 1
    max_restarts: int = 0
    shared_memory: str = ""
    backend: str = "fsdp2"  # fsdp2 | megatron
    tensor_parallel: int = 1
    pipeline_parallel: int = 1


@dataclass
class ScheduleSpec:
    cron: str = "0 3 * * 1"
    config: str = "configs/default.yaml"
    overrides: str = ""
    model_name: str = "areal-flyte-policy"


@dataclass
class ClusterConfig:
    device: str = "cpu"
    rollout: PoolSpec = field(default_factory=PoolSpec)
    reward: PoolSpec = field(default_factory=PoolSpec)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    small: PodSpec = field(default_factory=PodSpec)
    single: PodSpec = field(default_factory=PodSpec)  # SFT and evaluation
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    source: str = ""  # the file it was read from

    @property
    def world_size(self) -> int:
        return self.trainer.nnodes * self.trainer.nproc_per_node


def _fill(obj: Any, data: Any, prefix: str) -> None:
    if not isinstance(data, dict):
        raise ClusterConfigError(f"cluster config '{prefix.rstrip('.') or '<root>'}' must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields or key == "source":
            raise ClusterConfigError(f"unknown cluster config key '{dotted}'")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _fill(current, value, dotted + ".")
        elif isinstance(current, dict):
            if not isinstance(value, dict) or set(value) - {"cpu", "mem", "ephemeral_storage"}:
                raise ClusterConfigError(f"cluster config '{dotted}' must map cpu/mem/ephemeral_storage to quantities")
            setattr(obj, key, {k: str(v) for k, v in value.items()})
        elif isinstance(current, bool) or not isinstance(value, type(current)):
            raise ClusterConfigError(f"cluster config '{dotted}' must be a {type(current).__name__}, got {value!r}")
        else:
            setattr(obj, key, value)


def validate_cluster(cfg: ClusterConfig) -> ClusterConfig:
    if cfg.device not in DEVICES:
        raise ClusterConfigError(f"cluster config 'device' must be one of {list(DEVICES)}, got {cfg.device!r}")
    for name in ("rollout", "reward"):
        if getattr(cfg, name).replicas < 1:
            raise ClusterConfigError(f"cluster config '{name}.replicas' must be >= 1")
    t = cfg.trainer
    for key in ("nnodes", "nproc_per_node", "tensor_parallel", "pipeline_parallel"):
        if getattr(t, key) < 1:
            raise ClusterConfigError(f"cluster config 'trainer.{key}' must be >= 1")
    if t.backend not in ("fsdp2", "megatron"):
        raise ClusterConfigError(f"cluster config 'trainer.backend' must be fsdp2 or megatron, got {t.backend!r}")
    if t.backend == "megatron" and cfg.device != "cuda":
        raise ClusterConfigError("cluster config 'trainer.backend' megatron needs device cuda")
    if t.backend == "fsdp2" and (t.tensor_parallel, t.pipeline_parallel) != (1, 1):
        raise ClusterConfigError("cluster config 'trainer.tensor_parallel/pipeline_parallel' need backend megatron")
    if cfg.world_size % (t.tensor_parallel * t.pipeline_parallel):
        raise ClusterConfigError(
            f"cluster config: trainer world size {cfg.world_size} (nnodes x nproc_per_node) is not a multiple of "
            f"tensor_parallel x pipeline_parallel = {t.tensor_parallel * t.pipeline_parallel}"
        )
    for name in ("rollout", "reward", "trainer", "small", "single"):
        spec = getattr(cfg, name)
        if spec.accelerators < 0 or spec.retries < 0 or spec.timeout_s < 0:
            raise ClusterConfigError(f"cluster config '{name}': accelerators, retries and timeout_s must be >= 0")
        if spec.accelerators and cfg.device == "cpu":
            raise ClusterConfigError(f"cluster config '{name}.accelerators' must be 0 on device cpu")
    if cfg.device != "cpu" and t.accelerators and t.nproc_per_node != t.accelerators:
        raise ClusterConfigError(
            "cluster config 'trainer.nproc_per_node' must equal 'trainer.accelerators' (one process per device)"
        )
    return cfg


def cluster_config_path() -> Path:
    return Path(os.environ.get(CLUSTER_CONFIG_ENV) or DEFAULT_CLUSTER_CONFIG)


def load_cluster_config(path: str | os.PathLike | None = None) -> ClusterConfig:
    p = Path(path) if path else cluster_config_path()
    if not p.is_file():
        raise ClusterConfigError(f"cluster config file '{p}' does not exist (set ${CLUSTER_CONFIG_ENV})")
    cfg = ClusterConfig()
    _fill(cfg, yaml.safe_load(p.read_text()) or {}, "")
    cfg.source = str(p)
    return validate_cluster(cfg)


def cluster_config_from_dict(data: dict[str, Any]) -> ClusterConfig:
    cfg = ClusterConfig()
    _fill(cfg, data, "")
    return validate_cluster(cfg)


def _resources(values: dict[str, str], gpus: int) -> Resources | None:
    if not values and not gpus:
        return None
    return Resources(**values, **({"gpu": str(gpus)} if gpus else {}))


_K8S_NAMES = {"cpu": "cpu", "mem": "memory", "ephemeral_storage": "ephemeral-storage"}


def _npu_pod_template(spec: PodSpec) -> PodTemplate:
    """NPUs are an extended resource Flyte's Resources cannot name, and flytekit replaces the
    primary container's resources whenever the task sets requests/limits: so on npu every
    resource (cpu, memory and the NPUs) goes into the pod template and the task sets none."""
    from kubernetes.client import V1Container, V1PodSpec, V1ResourceRequirements

    npu = {ACCELERATOR_RESOURCE["npu"]: str(spec.accelerators)} if spec.accelerators else {}
    requests = {_K8S_NAMES[k]: v for k, v in spec.requests.items()} | npu
    limits = {_K8S_NAMES[k]: v for k, v in spec.limits.items()} | npu
    container = V1Container(name="primary", resources=V1ResourceRequirements(requests=requests, limits=limits))
    return PodTemplate(primary_container_name="primary", pod_spec=V1PodSpec(containers=[container]))


def task_kwargs(spec: PodSpec, device: str) -> dict[str, Any]:
    """`@task(...)` keyword arguments for a pod of this spec on `device`: resources, accelerators, retries."""
    gpus = spec.accelerators if device == "cuda" else 0
    out: dict[str, Any] = {
        "requests": _resources(spec.requests, gpus),
        "limits": _resources(spec.limits, gpus),
        "retries": spec.retries,
    }
    if spec.timeout_s:
        out["timeout"] = datetime.timedelta(seconds=spec.timeout_s)
    if device == "cuda" and spec.accelerators and spec.accelerator_type:
        from flytekit.extras.accelerators import GPUAccelerator

        out["accelerator"] = GPUAccelerator(spec.accelerator_type)
    if device == "npu" and spec.accelerators:
        out.update(requests=None, limits=None, pod_template=_npu_pod_template(spec))
    return out
