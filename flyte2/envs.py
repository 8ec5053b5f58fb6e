"""The Flyte 2 task environments, declared from the cluster config (configs/cluster.yaml, or
$AREAL_CLUSTER_CONFIG; in a pod, the config it was deployed with, $AREAL_CLUSTER_SPEC) and the
images of images/specs.py (flyte2/images.py).

Flyte 2 fixes an environment when its module is imported: `flyte deploy` finds the module-level
`TaskEnvironment`s by importing the file, and a pod imports the same file to find its task. So,
unlike tasks/deferred.py for flytekit (which reads the cluster config only when a task is
serialized), this module reads the cluster config at import; every environment carries it in
$AREAL_CLUSTER_SPEC, so a pod rebuilds the very environments it was deployed with.

| environment     | cluster config pod | what runs there                                           |
|-----------------|--------------------|-----------------------------------------------------------|
| `areal_driver`  | small              | the jobs (flyte2/grpo.py ...): they await the other tasks |
| `areal_small`   | small              | start_run, register                                       |
| `areal_prepare` | prepare            | prepare, prepare_cluster (the preflight loads model.path) |
| `areal_single`  | single             | SFT (cached) and evaluation                               |
| `areal_rollout` | rollout            | rollout workers: ReusePolicy(replicas), interruptible     |
| `areal_reward`  | reward             | reward workers: ReusePolicy(replicas), interruptible      |
| `areal_trainer` | trainer            | the trainer: flyteplugins-pytorch Elastic (torchrun)      |
| `areal_one_machine` | (tasks/resources.py ROLE) | online retraining, replay, fork, regrade       |

A local run (`flyte run --local`, `flyte.init()` + `flyte.run`) ignores images, resources, reuse
and the Elastic layout, and runs every task in this process (docs/flyte2.md).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import flyte
from flyteplugins.pytorch import Elastic

from areal_core.config.cluster import ClusterConfig, PodSpec, PoolSpec
from areal_core.run.cluster import pod_env, registered_cluster, trainer_layout
from flyte2.images import image_for

# Warm pools: an idle rollout or reward pool keeps its containers this long, so the next run's
# workers start in a pulled image with Python and torch already loaded (docs/flyte2.md).
POOL_IDLE_TTL = datetime.timedelta(minutes=30)
# settings of images/specs.py read from the deploying shell, passed on so a pod rebuilds the same images
IMAGE_ENV = ("AREAL_IMAGE_REGISTRY", "AREAL_CUDA_ENGINE", "AREAL_CUDA_BASE_IMAGE", "AREAL_CANN_BASE_IMAGE")
K8S_NAMES = {"cpu": "cpu", "mem": "memory", "ephemeral_storage": "ephemeral-storage"}
NPU_RESOURCE = "huawei.com/Ascend910"  # as tasks/resources.py: the Ascend device plugin's name


def secrets() -> list[flyte.Secret]:
    """The store and MLflow credentials every task asks for: tasks/resources.py's SECRETS, in Flyte 2's terms."""
    from tasks.resources import SECRETS

    return [flyte.Secret(key=s.key, group=s.group, as_env_var=s.env_var) for s in SECRETS]


def one_machine_resources() -> flyte.Resources:
    """What a single-machine flytekit task requests (tasks/resources.py ROLE)."""
    from tasks.resources import ROLE

    return flyte.Resources(cpu=ROLE.cpu, memory=ROLE.mem)


def resources(spec: PodSpec, device: str, shm: str | None = None) -> flyte.Resources | None:
    """A pod of the cluster config as Flyte 2 Resources: requests (limits where given, as a
    (request, limit) pair), the GPUs of a cuda pod (of its accelerator_type, when given),
    `shm` for /dev/shm. None on npu, whose resources are all in the pod template (`pod_template`)."""
    if device == "npu" and spec.accelerators:
        return None
    values: dict[str, Any] = {}
    for key, name in (("cpu", "cpu"), ("mem", "memory"), ("ephemeral_storage", "disk")):
        request, limit = spec.requests.get(key), spec.limits.get(key)
        if request or limit:
            values[name] = (request or limit, limit) if limit else request
    if device == "cuda" and spec.accelerators:  # a named type: the GPU accelerator (a node selector) of that name
        named = flyte.Device(quantity=spec.accelerators, device_class="GPU", device=spec.accelerator_type)
        values["gpu"] = named if spec.accelerator_type else spec.accelerators
    return flyte.Resources(**values, shm=shm)


def pod_template(spec: PodSpec, device: str) -> flyte.PodTemplate | None:
    """NPUs are an extended resource Flyte 2's Resources cannot name: on npu every resource goes into
    the primary container of a pod template (as tasks/resources.py does for flytekit)."""
    if not (device == "npu" and spec.accelerators):
        return None
    from kubernetes.client import V1Container, V1PodSpec, V1ResourceRequirements

    npu = {NPU_RESOURCE: str(spec.accelerators)}
    requests = {K8S_NAMES[k]: v for k, v in spec.requests.items()} | npu
    limits = {K8S_NAMES[k]: v for k, v in spec.limits.items()} | npu
    container = V1Container(name="primary", resources=V1ResourceRequirements(requests=requests, limits=limits))
    return flyte.PodTemplate(pod_spec=V1PodSpec(containers=[container]), primary_container_name="primary")


def reuse(pool: PoolSpec, device: str) -> flyte.ReusePolicy | None:
    """A pool's warm containers: exactly `replicas` of them (one worker each), kept POOL_IDLE_TTL
    after the pool goes idle. None on npu: Flyte 2 refuses a pod template on a reusable
    environment, and NPUs can only be requested through one."""
    if device == "npu" and pool.accelerators:
        return None
    return flyte.ReusePolicy(replicas=pool.replicas, concurrency=1, idle_ttl=POOL_IDLE_TTL)


def elastic(cluster: ClusterConfig) -> Elastic:
    """The trainer's torchrun layout (areal_core/run/cluster.py: trainer_layout): nnodes pods of
    nproc_per_node ranks; nnodes > 1 makes it a Kubeflow PyTorchJob, 1 a single pod running torchrun."""
    layout = trainer_layout(cluster)
    wait = layout.rendezvous_timeout_s
    return Elastic(
        nnodes=layout.nnodes,
        nproc_per_node=layout.nproc_per_node,
        max_restarts=layout.max_restarts,
        rdzv_configs={"timeout": wait, "join_timeout": wait, "read_timeout": wait},
    )


def env_vars(cluster: ClusterConfig, image: flyte.Image) -> dict[str, str]:
    """What every task's container carries: the cluster config itself, the device and the image
    (areal_core/run/cluster.py: pod_env), and the image settings of the deploying shell."""
    shell = {k: os.environ[k] for k in IMAGE_ENV if os.environ.get(k)}
    return pod_env(cluster, image.uri, shell)


def task_settings(spec: PodSpec) -> dict[str, Any]:
    """`@env.task` arguments of a pod: its retries and timeout (0: none)."""
    timeout = datetime.timedelta(seconds=spec.timeout_s) if spec.timeout_s else 0
    return {"retries": spec.retries, "timeout": timeout}


def environment(name: str, role: str, cluster: ClusterConfig, **kwargs: Any) -> flyte.TaskEnvironment:
    """The environment of the cluster config's pod `role` (image of the device, resources, the
    config in its environment variables, the secrets)."""
    spec = getattr(cluster, role)
    image = image_for(cluster.device)
    shm = (cluster.trainer.shared_memory or "auto") if role == "trainer" else None
    return flyte.TaskEnvironment(
        name=name,
        image=image,
        resources=resources(spec, cluster.device, shm),
        pod_template=pod_template(spec, cluster.device),
        env_vars=env_vars(cluster, image),
        secrets=secrets(),
        description=f"AReaL-Flyte: the cluster config's {role} pod ({cluster.device})",
        **kwargs,
    )


CLUSTER = registered_cluster()
SMALL = environment("areal_small", "small", CLUSTER)
PREPARE = environment("areal_prepare", "prepare", CLUSTER)
SINGLE = environment("areal_single", "single", CLUSTER)
ROLLOUT = environment(
    "areal_rollout", "rollout", CLUSTER, reusable=reuse(CLUSTER.rollout, CLUSTER.device), interruptible=True
)
REWARD = environment(
    "areal_reward", "reward", CLUSTER, reusable=reuse(CLUSTER.reward, CLUSTER.device), interruptible=True
)
TRAINER = environment("areal_trainer", "trainer", CLUSTER, plugin_config=elastic(CLUSTER))
ONE_MACHINE = flyte.TaskEnvironment(
    name="areal_one_machine",
    image=image_for("cpu"),
    resources=one_machine_resources(),
    secrets=secrets(),
    description="AReaL-Flyte: single-machine tasks (online retraining, replay, fork, regrade)",
)
DRIVER = environment(
    "areal_driver", "small", CLUSTER, depends_on=[SMALL, PREPARE, SINGLE, ROLLOUT, REWARD, TRAINER, ONE_MACHINE]
)
