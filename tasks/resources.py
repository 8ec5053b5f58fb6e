"""What the tasks request, in flytekit's terms (cluster values; the local executor ignores them).

Single-machine tasks (tasks/pipeline.py, fork, replay, regrade, online) request SMALL or ROLE;
prepare requests PREPARE, the memory of the largest checkpoint its preflight loads
(areal_core/config/pod_memory.py, docs/cluster.md).
The cluster's tasks take their pods from the cluster config (areal_core/config/cluster.py), read
when a task is serialized for registration, never at import (tasks/deferred.py):

    AREAL_CLUSTER_CONFIG=configs/my-cluster.yaml pyflyte run --remote --copy all workflows/grpo.py grpo_cluster

`task_kwargs` maps one validated PodSpec to `@task(...)` arguments. SECRETS are the
credentials every task that touches the store or MLflow asks Flyte to inject (Kubernetes secrets
`areal-s3` and `areal-mlflow`, as environment variables; docs/cluster.md).
"""

from __future__ import annotations

import datetime
from typing import Any

from flytekit import ImageSpec, PodTemplate, Resources, Secret

from areal_core.config.cluster import PodSpec
from areal_core.config.device import Device
from areal_core.config.pod_memory import prepare_pod_memory

SMALL = Resources(cpu="1", mem="2Gi")
PREPARE = Resources(cpu="1", mem=prepare_pod_memory())
ROLE = Resources(cpu="2", mem="8Gi")


_ENV = Secret.MountType.ENV_VAR
SECRETS = [
    Secret(group="areal-s3", key="access-key-id", mount_requirement=_ENV, env_var="AWS_ACCESS_KEY_ID"),
    Secret(group="areal-s3", key="secret-access-key", mount_requirement=_ENV, env_var="AWS_SECRET_ACCESS_KEY"),
    Secret(group="areal-mlflow", key="tracking-token", mount_requirement=_ENV, env_var="MLFLOW_TRACKING_TOKEN"),
]

# Kubernetes extended-resource names of the accelerators (the device plugins' names).
ACCELERATOR_RESOURCE = {"cuda": "nvidia.com/gpu", "npu": "huawei.com/Ascend910"}


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


def task_kwargs(spec: PodSpec, device: Device) -> dict[str, Any]:
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


def image_name(spec: ImageSpec) -> str:
    """The fully qualified name the image will be pushed under (recorded with registered models)."""
    try:
        return spec.image_name()
    except Exception:  # no builder available: the spec's own name
        return f"{spec.registry}/{spec.name}"
