"""Walk a serialized workflow's nodes in dependency order, each node as the pods a Flyte cluster
would start for it, its bindings resolved from upstream outputs (literal maps on S3)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from flyteidl.core import literals_pb2, tasks_pb2, types_pb2, workflow_pb2
from google.protobuf.json_format import MessageToDict

from tests.podemu.package import Package
from tests.podemu.pods import (
    ARRAY_INDEX_VAR,
    Pod,
    container,
    execution_env,
    image_env,
    put_literal_map,
    s3_env,
    secret_env,
)

START = "start-node"  # the workflow's inputs: flytekit names the node "", FlyteAdmin's compiler "start-node"


class PodFailure(RuntimeError):
    """A pod failed or the execution ran out of time: the message has every pod's log tail."""

    def __init__(self, message: str, node_id: str = ""):
        super().__init__(message)
        self.node_id = node_id


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _attr(lit: literals_pb2.Literal, path) -> literals_pb2.Literal:
    """Propeller's attribute access on a msgpack-encoded value (a dataclass or pydantic output)."""
    if not path:
        return lit
    if not lit.scalar.binary.value:
        raise NotImplementedError(f"attribute access on a non-msgpack literal: {lit}")
    value: Any = msgpack.loads(lit.scalar.binary.value)
    for p in path:
        value = value[p.string_value] if p.WhichOneof("value") == "string_value" else value[p.int_value]
    binary = literals_pb2.Binary(value=msgpack.dumps(value), tag="msgpack")
    return literals_pb2.Literal(scalar=literals_pb2.Scalar(binary=binary))


def resolve(binding: literals_pb2.BindingData, outputs: dict[str, dict[str, literals_pb2.Literal]]):
    """A node input's literal from its binding: constants, collections, maps and promises."""
    kind = binding.WhichOneof("value")
    if kind == "scalar":
        return literals_pb2.Literal(scalar=binding.scalar)
    if kind == "collection":
        items = [resolve(b, outputs) for b in binding.collection.bindings]
        return literals_pb2.Literal(collection=literals_pb2.LiteralCollection(literals=items))
    if kind == "map":
        items = {k: resolve(b, outputs) for k, b in binding.map.bindings.items()}
        return literals_pb2.Literal(map=literals_pb2.LiteralMap(literals=items))
    if kind == "promise":
        p = binding.promise
        return _attr(outputs[p.node_id][p.var], p.attr_path)
    raise NotImplementedError(f"binding {kind}")


def _promises(binding: literals_pb2.BindingData) -> set[str]:
    kind = binding.WhichOneof("value")
    if kind == "promise":
        return {binding.promise.node_id}
    if kind == "collection":
        return set().union(*(_promises(b) for b in binding.collection.bindings))
    if kind == "map":
        return set().union(*(_promises(b) for b in binding.map.bindings.values()))
    return set()


@dataclass
class NodeRun:
    """The pods of one node; `array` gathers each pod's outputs into collections."""

    node: workflow_pb2.Node
    template: tasks_pb2.TaskTemplate
    pods: list[Pod]
    parallelism: int = 0  # array nodes: pods at once (0: all)
    array: bool = False

    def step(self) -> bool:
        """Start what may start; True when every pod has exited 0."""
        running = sum(1 for p in self.pods if p.proc is not None and p.poll() is None)
        for pod in self.pods:
            if pod.proc is None and (not self.parallelism or running < self.parallelism):
                pod.start()
                running += 1
        return all(p.proc is not None and p.poll() == 0 for p in self.pods)

    def failed(self) -> list[Pod]:
        return [p for p in self.pods if p.poll() not in (None, 0)]

    def outputs(self) -> dict[str, literals_pb2.Literal]:
        names = list(self.template.interface.outputs.variables)
        if not self.array:
            got = next((o for o in (p.outputs() for p in self.pods) if o is not None), None)
            if got is None and names:
                raise PodFailure(f"node {self.node.id}: no pod wrote outputs.pb\n" + self.report())
            return got or {}
        per_pod = [p.outputs() or {} for p in self.pods]
        return {
            n: literals_pb2.Literal(collection=literals_pb2.LiteralCollection(literals=[o[n] for o in per_pod]))
            for n in names
        }

    def report(self) -> str:
        return "\n".join(p.report() for p in self.pods)


@dataclass
class Execution:
    """One execution of `workflow` from `pkg`: every node's pods, logs under `log_dir`, literal
    maps under `<bucket>/metadata/<name>/<node>`. `timeout_s` bounds the whole execution."""

    pkg: Package
    workflow: str
    bucket: str  # s3://name
    root: Path  # the image's working dir (the repository)
    log_dir: Path
    endpoint: str
    secrets: dict[tuple[str, str], str] = field(default_factory=dict)
    timeout_s: float = 1800.0
    # task name -> seconds: its pods are killed that long after they start, as an eviction with
    # the retries spent (the node fails; the workflow's failure node runs)
    evict: dict[str, float] = field(default_factory=dict)
    project: str = "areal"
    domain: str = "development"
    name: str = field(default_factory=lambda: "podemu" + uuid.uuid4().hex[:10])
    runs: dict[str, NodeRun] = field(default_factory=dict)

    # -- pods -----------------------------------------------------------------------------------
    def _env(self, template: tasks_pb2.TaskTemplate, extra: dict[str, str]) -> dict[str, str]:
        env = image_env(self.root, self.log_dir / "home")
        env |= container(template).env  # what the task spec declares
        env |= secret_env(template, self.secrets)
        env |= execution_env(self.project, self.domain, self.name, template) | s3_env(self.endpoint)
        return env | extra

    def _pod(self, node_id: str, template, pod_name: str, prefix: str, extra: dict[str, str], image: str) -> Pod:
        return Pod(
            name=pod_name,
            template=template,
            inputs_uri=f"{self.bucket}/metadata/{self.name}/{node_id}/inputs.pb",
            output_prefix=prefix,
            raw_prefix=f"{self.bucket}/raw/{self.name}/{pod_name}",
            env=self._env(template, extra),
            log=self.log_dir / f"{pod_name}.log",
            cwd=self.root,
            image=image or container(template).image,
        )

    def _node_run(self, node: workflow_pb2.Node, inputs: dict[str, literals_pb2.Literal]) -> NodeRun:
        prefix = f"{self.bucket}/metadata/{self.name}/{node.id}/data/0"
        put_literal_map(f"{self.bucket}/metadata/{self.name}/{node.id}/inputs.pb", inputs)
        if node.WhichOneof("target") == "array_node":
            an = node.array_node
            template = self.pkg.tasks[an.node.task_node.reference_id.name]
            mapped = [k for k in inputs if k not in set(an.bound_inputs)]
            size = len(inputs[mapped[0]].collection.literals)
            pods = [
                self._pod(
                    node.id,
                    template,
                    f"{node.id}-{i}",
                    f"{prefix}/{i}",
                    {"BATCH_JOB_ARRAY_INDEX_VAR_NAME": ARRAY_INDEX_VAR, ARRAY_INDEX_VAR: str(i)},
                    "",
                )
                for i in range(size)
            ]
            return NodeRun(node, template, pods, parallelism=an.parallelism, array=True)
        if node.WhichOneof("target") != "task_node":
            raise NotImplementedError(f"node {node.id}: {node.WhichOneof('target')}")
        template = self.pkg.tasks[node.task_node.reference_id.name]
        image = node.task_node.overrides.container_image
        if template.type == "pytorch":
            return NodeRun(node, template, self._pytorch_job(node.id, template, prefix, image))
        return NodeRun(node, template, [self._pod(node.id, template, node.id, prefix, {}, image)])

    def _pytorch_job(self, node_id: str, template, prefix: str, image: str) -> list[Pod]:
        """The Kubeflow training operator's PyTorchJob: `workerReplicas` worker pods (an elastic
        job has no master), each with the operator's elastic environment (PET_*); the rendezvous
        endpoint stands for <job>-worker-0:<port>. All pods share the output prefix (rank 0 writes)."""
        custom = MessageToDict(template.custom)
        replicas = int(custom["workerReplicas"]["replicas"])
        elastic = custom.get("elasticConfig")
        if elastic is None:
            raise NotImplementedError("a PyTorchJob with a master replica")
        env = {
            "PYTHONUNBUFFERED": "0",
            "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
            "PET_RDZV_BACKEND": elastic.get("rdzvBackend", "c10d"),
            "PET_NNODES": f"{int(elastic['minReplicas'])}:{int(elastic['maxReplicas'])}",
            "PET_MAX_RESTARTS": str(int(elastic.get("maxRestarts", 0))),
            "PET_NPROC_PER_NODE": str(int(elastic["nprocPerNode"])),
        }
        return [self._pod(node_id, template, f"{node_id}-worker-{i}", prefix, env, image) for i in range(replicas)]

    # -- the graph ------------------------------------------------------------------------------
    def run(self, inputs: dict[str, literals_pb2.Literal]) -> dict[str, literals_pb2.Literal]:
        """Run to the end; the workflow's outputs. Raises PodFailure with every pod's log tail,
        after running the workflow's failure node (if it has one) as Flyte does."""
        wf = self.pkg.workflows[self.workflow]
        lp = self.pkg.launch_plans.get(self.workflow)
        given = {k: p.default for k, p in lp.default_inputs.parameters.items() if p.HasField("default")} if lp else {}
        given |= dict(lp.fixed_inputs.literals) if lp else {}
        given |= inputs
        missing = set(wf.interface.inputs.variables) - set(given)
        if missing:
            raise ValueError(f"workflow inputs without a value: {sorted(missing)}")
        outputs: dict[str, dict[str, literals_pb2.Literal]] = {START: given, "": given}
        try:
            self._walk(wf, outputs)
        except PodFailure as exc:
            self._kill()
            if wf.failure_node.id:
                self._failure_node(wf.failure_node, outputs, exc)
            raise
        finally:
            self._kill()
        return {b.var: resolve(b.binding, outputs) for b in wf.outputs}

    def _walk(self, wf: workflow_pb2.WorkflowTemplate, outputs: dict) -> None:
        nodes = {n.id: n for n in wf.nodes}
        deps = {
            n.id: set(n.upstream_node_ids) | set().union(*(_promises(b.binding) for b in n.inputs)) for n in wf.nodes
        }
        deadline = time.time() + self.timeout_s
        while len(outputs) < len(nodes) + 2:
            for nid, node in nodes.items():
                if nid not in self.runs and deps[nid] <= set(outputs):
                    self.runs[nid] = self._node_run(node, {b.var: resolve(b.binding, outputs) for b in node.inputs})
            for nid, nr in list(self.runs.items()):
                if nid in outputs:
                    continue
                self._evictions(nr)
                if nr.failed():
                    raise PodFailure(f"node {nid} failed in execution {self.name}\n{self.report()}", nid)
                if nr.step():
                    outputs[nid] = nr.outputs()
            if time.time() > deadline:
                raise PodFailure(f"execution {self.name} ran past {self.timeout_s}s\n{self.report()}")
            time.sleep(0.5)

    def _evictions(self, nr: NodeRun) -> None:
        after = self.evict.get(nr.template.id.name)
        for pod in nr.pods:
            if after is not None and pod.poll() is None and pod.proc and time.time() - pod.started_at > after:
                pod.kill()

    def _failure_node(self, node: workflow_pb2.Node, outputs: dict, exc: PodFailure) -> None:
        """Flyte's failure node: the workflow's inputs, and `err` holding the failed node and message."""
        template = self.pkg.tasks[node.task_node.reference_id.name]
        bound = {b.var: resolve(b.binding, outputs) for b in node.inputs}
        if "err" in bound:
            error = literals_pb2.Literal(
                scalar=literals_pb2.Scalar(error=types_pb2.Error(failed_node_id=exc.node_id, message=str(exc)[:2000]))
            )
            variants = template.interface.inputs.variables["err"].type.union_type.variants
            kind = next((v for v in variants if v.WhichOneof("type") != "simple" or v.simple != types_pb2.NONE), None)
            union = literals_pb2.Union(value=error, type=kind)
            bound["err"] = literals_pb2.Literal(scalar=literals_pb2.Scalar(union=union)) if kind else error
        nr = self.runs[node.id] = self._node_run(node, bound)
        deadline = time.time() + 600
        while not nr.step():
            if nr.failed() or time.time() > deadline:
                exc.args = (f"{exc.args[0]}\nand the failure node {node.id} failed:\n{nr.report()}",)
                return
            time.sleep(0.5)

    def _kill(self) -> None:
        for pod in self.pods():
            pod.kill()

    def pods(self) -> list[Pod]:
        return [p for nr in self.runs.values() for p in nr.pods]

    def report(self) -> str:
        return "\n".join(nr.report() for nr in self.runs.values())


def to_literals(pkg: Package, workflow: str, values: dict[str, Any]) -> dict[str, literals_pb2.Literal]:
    """Python values as the workflow's input literals (flytekit's type engine, as `pyflyte run`)."""
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.types import LiteralType

    ctx = FlyteContextManager.current_context()
    variables = pkg.workflows[workflow].interface.inputs.variables
    out = {}
    for k, v in values.items():
        lt = LiteralType.from_flyte_idl(variables[k].type)
        out[k] = TypeEngine.to_literal(ctx, v, type(v), lt).to_flyte_idl()
    return out


def to_python(literal: literals_pb2.Literal, python_type: type) -> Any:
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import Literal

    ctx = FlyteContextManager.current_context()
    return TypeEngine.to_python_value(ctx, Literal.from_flyte_idl(literal), python_type)
