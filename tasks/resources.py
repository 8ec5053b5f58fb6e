"""Images and resources the tasks request (cluster values; the local executor ignores them).

Single-machine tasks (tasks/pipeline.py, tasks/roles.py) use IMAGE, SMALL and ROLE. The cluster
workflow (tasks/cluster.py, workflows/grpo.py: grpo_cluster) reads its topology AT IMPORT with
`areal_core.config.cluster.load_cluster_config`, because Flyte fixes resources, images and
replica counts when a workflow is registered:

    AREAL_CLUSTER_CONFIG=configs/my-cluster.yaml pyflyte run --remote --copy all workflows/grpo.py grpo_cluster

`task_kwargs` maps one validated PodSpec to `@task(...)` arguments. SECRETS are the
credentials every task that touches the store or MLflow asks Flyte to inject (Kubernetes secrets
`areal-s3` and `areal-mlflow`, as environment variables; docs/cluster.md).
"""

from __future__ import annotations

import datetime
from typing import Any

from flytekit import PodTemplate, Resources, Secret

from areal_core.config.cluster import PodSpec
from areal_core.config.device import Device
from images.specs import cpu_image

IMAGE = cpu_image()
SMALL = Resources(cpu="1", mem="2Gi")
ROLE = Resources(cpu="2", mem="8Gi")

# The kickoff_time default of a workflow that a schedule also launches: a manual run. FlyteAdmin
# accepts a schedule only when its kickoff input is a plain datetime (not Optional), so "not
# scheduled" is this value rather than None.
UNSCHEDULED = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def scheduled(kickoff_time: datetime.datetime) -> datetime.datetime | None:
    """The schedule's kickoff time, or None for a manual run (UNSCHEDULED)."""
    same = kickoff_time.replace(tzinfo=kickoff_time.tzinfo or datetime.UTC) == UNSCHEDULED
    return None if same else kickoff_time


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
