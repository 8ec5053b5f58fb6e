"""What Flyte fixes at registration, decided then, not when a module is imported.

Flyte fixes a task's image, resources, retries and environment, the trainer's torchrun layout and
a launch plan's schedule when they are registered. Here they are read from the cluster config
(areal_core/run/cluster.py: registered_cluster) and the image specs (images/specs.py) when
flytekit first asks for them: when `pyflyte run --remote`, `pyflyte register` or `pyflyte package`
serializes the entity, or when the task runs. Importing a module of tasks/ or workflows/ reads
neither the environment nor a config file (tests/test_flyte.py checks both), so the same modules
import in the registering shell, in a test and in a pod (which has no config file: it reads the
registered config back from the environment its task spec gives it).

- `@task(task_config=Pod("rollout"))`: the task's pod is the cluster config's `rollout` pod (the
  image of its device, requests and limits, accelerators, retries, timeout) and its environment
  carries the registered config (areal_core/run/cluster.py: pod_env). `Pod()` (ONE_MACHINE): a
  single-machine task in the cpu image, with what its decorator requests.
- `@task(task_config=Torchrun())`: the trainer, a kfpytorch Elastic task with the `trainer` pod
  and the cluster config's layout (nnodes > 1: a PyTorchJob; nnodes = 1: one pod running torchrun).
  A local execution (`pyflyte run tasks/roles.py trainer`) runs the function once, in-process.
- `DeferredLaunchPlan.deferred(name, workflow, plan)`: a launch plan whose default inputs, schedule
  and notifications are `plan()`'s, asked for when it is first serialized.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from flytekit import LaunchPlan, PythonFunctionTask, Resources
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.interface import Interface, transform_inputs_to_parameters
from flytekit.core.resources import ResourceSpec
from flytekit.extend import TaskPlugins
from flytekit.models.interface import ParameterMap
from flytekitplugins.kfpytorch import Elastic
from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask

from areal_core.run.cluster import pod_env, registered_cluster, trainer_layout
from images.specs import cpu_image, image_for
from tasks.execution import console_env
from tasks.resources import image_name, task_kwargs


@dataclasses.dataclass(frozen=True)
class Pod:
    """A task's pod: `role` names a pod of the cluster config (rollout, reward, trainer, small,
    prepare, single); '' is a single-machine task."""

    role: str = ""


@dataclasses.dataclass(frozen=True)
class Torchrun(Pod):
    """The trainer's pod, run under torchrun in the cluster config's layout."""

    role: str = "trainer"


ONE_MACHINE = Pod()


@functools.cache
def one_machine_image():
    return cpu_image()


def cluster_image():
    """The image of the cluster config's device."""
    return image_for(registered_cluster().device)


def pod_settings(role: str) -> dict[str, Any]:
    """`@task` arguments of the cluster config's `role` pod, read now: image, environment,
    resources, accelerator, retries, timeout (and the trainer's /dev/shm size)."""
    cluster = registered_cluster()
    spec = getattr(cluster, role)
    image = cluster_image()
    out = task_kwargs(spec, cluster.device)
    out["container_image"] = image
    out["environment"] = pod_env(cluster, image_name(image), console_env())
    if role == "trainer":  # /dev/shm for NCCL/HCCL and data loaders: the configured size, else the pod's memory
        out["shared_memory"] = cluster.trainer.shared_memory or True
    return out


class PodSetting:
    """A task attribute that the cluster config's pod settings override once the task is ready (PodTask._setting):
    reading it gives the setting, or what was declared; writing it (flytekit's constructor does) declares it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.declared = name, f"_declared_{name}"

    def __get__(self, task: Any, owner: type | None = None) -> Any:
        if task is None:
            return self
        return task._setting(self.name, getattr(task, self.declared, None))

    def __set__(self, task: Any, value: Any) -> None:
        setattr(task, self.declared, value)


class PodTask(PythonFunctionTask[Pod]):
    """A function task whose pod (Pod.role) is read when flytekit first asks for it after the
    task is defined, never at import. While the base classes' __init__ runs, every setting
    reads back as declared in the decorator."""

    def __init__(self, task_config: Pod, task_function: Callable, **kwargs: Any):
        self._role = task_config.role
        self._ready = False
        self._pod: dict[str, Any] | None = None
        self._pod_metadata = None
        self._declared_pod_template = self._declared_accelerator = self._declared_shared_memory = None
        super().__init__(task_config=self._base_config(task_config), task_function=task_function, **kwargs)
        self._ready = True

    def _base_config(self, task_config: Pod) -> Any:
        return task_config

    def _setting(self, key: str, declared: Any) -> Any:
        if not (self._ready and self._role):
            return declared
        if self._pod is None:
            self._pod = pod_settings(self._role)
        value = self._pod.get(key)
        return declared if value is None else value

    @property
    def container_image(self):
        if not self._ready or self._container_image is not None:
            return self._container_image
        return self._setting("container_image", None) or one_machine_image()

    @property
    def resources(self) -> ResourceSpec:
        requests, limits = self._setting("requests", None), self._setting("limits", None)
        if requests is None and limits is None:
            return self._resources
        return ResourceSpec(requests=requests or Resources(), limits=limits or Resources())

    @property
    def environment(self) -> dict[str, str]:
        return {**(self._environment or {}), **self._setting("environment", {})}

    @property
    def metadata(self):
        if not (self._ready and self._role):
            return self._metadata
        if self._pod_metadata is None:
            timeout = self._setting("timeout", self._metadata.timeout)
            self._pod_metadata = dataclasses.replace(
                self._metadata, retries=self._setting("retries", self._metadata.retries), timeout=timeout
            )
        return self._pod_metadata

    pod_template = PodSetting()  # a PodTemplate or None
    accelerator = PodSetting()
    shared_memory = PodSetting()


class TrainerTask(PodTask, PytorchElasticFunctionTask):
    """The trainer: kfpytorch's Elastic task with the layout of the cluster config, read when
    first asked for (in a pod: the registered one). Its task type follows the layout: a
    PyTorchJob when nnodes > 1, a plain pod running torchrun when nnodes = 1."""

    def __init__(self, task_config: Torchrun, task_function: Callable, **kwargs: Any):
        self._elastic: Elastic | None = None
        super().__init__(task_config, task_function, **kwargs)

    def _base_config(self, task_config: Pod) -> Elastic:
        return Elastic(increase_shared_mem=False)  # what the base __init__ sees: replaced when read

    @property
    def task_config(self) -> Elastic:
        if not self._ready:
            return self._task_config
        if self._elastic is None:
            layout = trainer_layout(registered_cluster())
            wait = layout.rendezvous_timeout_s
            self._elastic = Elastic(
                nnodes=layout.nnodes,
                nproc_per_node=layout.nproc_per_node,
                max_restarts=layout.max_restarts,
                start_method="spawn",
                rdzv_configs={"timeout": wait, "join_timeout": wait, "read_timeout": wait},
                increase_shared_mem=False,  # the trainer pod's shared_memory (pod_settings) instead
            )
        return self._elastic

    @property
    def task_type(self) -> str:
        if not self._ready:
            return self._task_type
        return self._ELASTIC_TASK_TYPE if self.task_config.nnodes > 1 else self._ELASTIC_TASK_TYPE_STANDALONE

    @property
    def min_nodes(self) -> int:
        return int(self.task_config.nnodes)

    @min_nodes.setter
    def min_nodes(self, value: int) -> None:
        pass  # the base __init__'s, from the placeholder config: the layout's is read when asked for

    @property
    def max_nodes(self) -> int:
        return int(self.task_config.nnodes)

    @max_nodes.setter
    def max_nodes(self, value: int) -> None:
        pass

    def execute(self, **kwargs: Any) -> Any:
        """Under torchrun in a pod; once, in this process, in a local execution."""
        state = FlyteContextManager.current_context().execution_state
        if state is None or state.is_local_execution():
            return PythonFunctionTask.execute(self, **kwargs)
        return PytorchElasticFunctionTask.execute(self, **kwargs)


TaskPlugins.register_pythontask_plugin(Pod, PodTask)
TaskPlugins.register_pythontask_plugin(Torchrun, TrainerTask)


class DeferredLaunchPlan(LaunchPlan):
    """A launch plan whose default inputs, schedule and notifications are `plan()`'s (a dict with
    those keys), asked for when they are first read (serialization), not at import."""

    deferred_plan: Callable[[], dict[str, Any]] | None = None

    @classmethod
    def deferred(cls, name: str, workflow: Any, plan: Callable[[], dict[str, Any]]) -> DeferredLaunchPlan:
        lp = cls.create(name, workflow)
        lp.deferred_plan = plan
        return lp

    def _resolve(self) -> None:
        """The one place this front end writes flytekit's private launch-plan state. flytekit 1.16 has
        no public way to give a launch plan its defaults, schedule and notifications after
        `LaunchPlan.create`, which needs them at import (and registers the name, so a second plan
        of that name cannot be made later); so they are set here, when first read, the way
        `LaunchPlan.create` sets them (the workflow's signature, then the plan's default inputs over it)."""
        plan, self.deferred_plan = self.deferred_plan, None
        if plan is None:
            return
        got = plan()
        defaults = got.get("default_inputs", {})
        types = self.workflow.python_interface.inputs
        ctx = FlyteContextManager.current_context()
        given = Interface(inputs={k: (types[k], v) for k, v in defaults.items()}, outputs={})
        params = {**self._parameters.parameters, **transform_inputs_to_parameters(ctx, given).parameters}
        self._parameters = ParameterMap(parameters=params)
        self._saved_inputs = {**self._saved_inputs, **defaults}
        self._schedule = got.get("schedule")
        self._notifications = got.get("notifications") or []

    @property
    def parameters(self) -> ParameterMap:
        self._resolve()
        return self._parameters

    @property
    def saved_inputs(self) -> dict[str, Any]:
        self._resolve()
        return self._saved_inputs.copy()

    @property
    def schedule(self):
        self._resolve()
        return self._schedule

    @property
    def notifications(self):
        self._resolve()
        return self._notifications
