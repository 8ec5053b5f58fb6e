"""What a Flyte cluster receives for the cluster topology (serialised offline with flytekit's
get_serializable), the cluster config, the registry, the megatron checks, the simulated-cost
mode, and (slow) the topology itself: rollout, reward and trainer as separate `pyflyte run`
processes on one run root on a real S3 endpoint (moto)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from tests import test_run_cluster
from tests.conftest import ROOT, TINY, wait_until
from tests.test_flyte import serialize

env_cluster = test_run_cluster.env_cluster  # the fixture

PYFLYTE = str(Path(sys.executable).parent / "pyflyte")


def resources(res) -> dict[str, str]:
    from flytekit.models.task import Resources as R

    names = {R.ResourceName.CPU: "cpu", R.ResourceName.MEMORY: "mem", R.ResourceName.GPU: "gpu"}
    return {names.get(r.name, str(r.name)): r.value for r in res}


def cluster_yaml() -> dict:
    return yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text())


# -- the workflow and its nodes -------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster_wf():
    from workflows.grpo import grpo_cluster

    return serialize(grpo_cluster)


def test_cluster_workflow_runs_the_three_roles_concurrently(cluster_wf):
    nodes = {n.id: n for n in cluster_wf.template.nodes}

    def name(n):
        if n.task_node:
            return n.task_node.reference_id.name
        return n.array_node.node.id.split("_")[1] + "_pool"  # map_<task>_<hash>-arraynode

    by_name = {name(n): n for n in nodes.values()}
    assert set(by_name) == {
        "tasks.cluster.prepare_cluster",
        "tasks.pipeline.sft",
        "tasks.cluster.start_run",
        "rollout_pool",
        "reward_pool",
        "tasks.roles.trainer",
        "tasks.pipeline.evaluate",
        "tasks.register.register",
    }
    start = by_name["tasks.cluster.start_run"].id
    roles = [by_name["rollout_pool"], by_name["reward_pool"], by_name["tasks.roles.trainer"]]
    for role in roles:  # no edges among the three: each waits only for start_run
        assert list(role.upstream_node_ids) == [start]
    assert by_name["tasks.roles.trainer"].id in by_name["tasks.pipeline.evaluate"].upstream_node_ids
    assert by_name["tasks.pipeline.evaluate"].id in by_name["tasks.register.register"].upstream_node_ids
    assert set(cluster_wf.template.interface.inputs) == {
        "cfg",
        "config",
        "overrides",
        "resume_run",
        "model_name",
        "kickoff_time",
    }
    # SFT and evaluation are moved to the cluster image and the `single` pod spec
    for key in ("tasks.pipeline.sft", "tasks.pipeline.evaluate"):
        ov = by_name[key].metadata
        assert ov.retries.retries == cluster_yaml()["single"]["retries"]
        assert by_name[key].task_node.overrides.container_image.startswith("localhost:30000/areal-flyte-cpu:")
        assert resources(by_name[key].task_node.overrides.resources.requests) == {"cpu": "2", "mem": "8Gi"}


def test_pools_are_map_tasks_with_every_replica_at_once(cluster_wf):
    cfg = cluster_yaml()
    pools = [n for n in cluster_wf.template.nodes if n.array_node]
    assert len(pools) == 2
    for node in pools:
        role = "rollout" if "rollout" in node.array_node.node.id else "reward"
        idl = node.array_node.to_flyte_idl()
        replicas = cfg[role]["replicas"]
        assert idl.parallelism == replicas  # all replicas concurrently
        assert idl.min_success_ratio == 1.0  # a lost worker would starve the trainer: fail instead
        assert list(idl.bound_inputs) == ["run_uri"]
        index = next(b for b in node.inputs if b.var == "index").binding.collection.bindings
        assert [b.scalar.primitive.integer for b in index] == list(range(replicas))
        sub = node.array_node.node.metadata
        assert sub.retries.retries == cfg[role]["retries"]
        assert sub.timeout.total_seconds() == cfg[role]["timeout_s"]


def test_pool_tasks_carry_resources_image_and_retries():
    from tasks.roles import reward_worker, rollout_worker

    cfg = cluster_yaml()
    for role, task in (("rollout", rollout_worker), ("reward", reward_worker)):
        t = serialize(task).template
        assert t.metadata.retries.retries == cfg[role]["retries"]
        assert resources(t.container.resources.requests) == cfg[role]["requests"]
        assert resources(t.container.resources.limits) == cfg[role]["limits"]
        assert t.container.image.startswith("localhost:30000/areal-flyte-cpu:")
        assert t.container.env["AREAL_DEVICE"] == "cpu"
        assert t.container.env["AREAL_IMAGE"] == t.container.image


def test_trainer_is_an_elastic_pytorchjob_from_the_cluster_config():
    from tasks.roles import trainer

    tc = cluster_yaml()["trainer"]
    t = serialize(trainer).template
    assert tc["nnodes"] > 1 and t.type == "pytorch"  # a PyTorchJob (one node would be a plain pod)
    assert t.custom == {
        "workerReplicas": {"replicas": tc["nnodes"]},
        "elasticConfig": {
            "rdzvBackend": "c10d",
            "minReplicas": tc["nnodes"],
            "maxReplicas": tc["nnodes"],
            "nprocPerNode": tc["nproc_per_node"],
            "maxRestarts": tc["max_restarts"],
        },
    }
    assert t.metadata.retries.retries == tc["retries"]
    assert t.metadata.timeout.total_seconds() == tc["timeout_s"]
    assert resources(t.container.resources.requests) == tc["requests"]
    assert t.extended_resources.shared_memory.size_limit == tc["shared_memory"]


def test_register_and_start_tasks_serialize():
    from tasks.cluster import prepare_cluster, start_run
    from tasks.register import register

    pods = cluster_yaml()
    for task, pod in ((prepare_cluster, "prepare"), (start_run, "small"), (register, "small")):
        t = serialize(task).template
        assert t.metadata.retries.retries == pods[pod]["retries"]
        assert resources(t.container.resources.requests) == pods[pod]["requests"]
    assert set(serialize(register).template.interface.inputs) == {"run_uri", "model_name", "before", "after"}


def test_weekly_launch_plan_schedule():
    from workflows.grpo import grpo_cluster_weekly

    sched = cluster_yaml()["schedule"]
    lp = serialize(grpo_cluster_weekly)
    cron = lp.spec.entity_metadata.schedule
    assert cron.cron_schedule.schedule == sched["cron"]
    assert cron.kickoff_time_input_arg == "kickoff_time"
    assert lp.spec.workflow_id.name == "workflows.grpo.grpo_cluster"
    defaults = lp.spec.default_inputs.parameters
    assert defaults["config"].default.scalar.primitive.string_value == sched["config"]
    assert defaults["model_name"].default.scalar.primitive.string_value == sched["model_name"]


def test_flyte_yaml_is_a_pyflyte_config_with_placeholders():
    from flytekit.configuration import Config

    cfg = Config.auto(str(ROOT / "flyte.yaml"))
    assert cfg.platform.endpoint == "flyte.example.com" and cfg.platform.auth_mode == "Pkce"
    assert cfg.platform.console_endpoint.endswith("/console")
    assert cfg.data_config.s3.endpoint == "https://s3.example.com"
    assert cfg.data_config.s3.access_key_id is None  # credentials never live in the file


# -- images and resources per device -----------------------------------------------------------
def _fresh(role: str):
    """A new task of `role`'s function and pod: it reads the cluster config when it is
    serialized, so a config chosen after it was defined is the one it gets."""
    from flytekit import task

    import tasks.roles
    from tasks.deferred import Pod, Torchrun

    fn = {"rollout": tasks.roles.rollout_worker, "reward": tasks.roles.reward_worker, "trainer": tasks.roles.trainer}
    config = Torchrun() if role == "trainer" else Pod(role)
    return task(task_config=config)(fn[role].task_function)


def _on(device: str, **pods) -> dict:
    data = cluster_yaml() | {"device": device}
    for name, values in pods.items():
        data[name] = data[name] | values
    return data


@pytest.mark.parametrize("device", ["cpu", "cuda", "npu"])
def test_every_cluster_task_runs_in_the_image_of_the_configured_device(device, env_cluster):
    """The device of the config in force when the task is serialized picks the image (and the
    accelerator stack with it: tests/test_images.py); the pod is told its device and image."""
    from images.specs import image_for
    from tasks.resources import image_name

    pool, trainer = _fresh("rollout"), _fresh("trainer")  # defined before the config is chosen
    env_cluster(_on(device))
    want = image_name(image_for(device))
    for task in (pool, trainer):
        t = serialize(task).template
        c = t.container if t.container else None
        image = c.image if c else t.k8s_pod.pod_spec["containers"][0]["image"]
        env = c.env if c else {e["name"]: e["value"] for e in t.k8s_pod.pod_spec["containers"][0]["env"]}
        assert image == want and env["AREAL_DEVICE"] == device and env["AREAL_IMAGE"] == want
        assert json.loads(env["AREAL_CLUSTER_SPEC"])["device"] == device
    assert want.split("/")[-1].split(":")[0] == {"cpu": "areal-flyte-cpu", "cuda": "areal-flyte-cuda-vllm"}.get(
        device, "areal-flyte-ascend"
    )


def test_cuda_pods_request_gpus_and_an_accelerator_type(env_cluster):
    pool, trainer = _fresh("rollout"), _fresh("trainer")
    env_cluster(
        _on(
            "cuda",
            rollout={"requests": {"cpu": "8", "mem": "64Gi"}, "limits": {}, "accelerators": 1},
            trainer={
                "requests": {"cpu": "32", "mem": "256Gi"},
                "limits": {},
                "accelerators": 8,
                "accelerator_type": "nvidia-h100",
                "nnodes": 4,
                "nproc_per_node": 8,
            },
        )
    )
    t = serialize(pool).template
    assert resources(t.container.resources.requests) == {"cpu": "8", "mem": "64Gi", "gpu": "1"}
    assert t.container.image.startswith("localhost:30000/areal-flyte-cuda-vllm:")
    t = serialize(trainer).template
    assert t.type == "pytorch" and t.extended_resources.gpu_accelerator.device == "nvidia-h100"
    assert t.custom["workerReplicas"]["replicas"] == 4 and t.custom["elasticConfig"]["nprocPerNode"] == 8
    assert resources(t.container.resources.requests)["gpu"] == "8"


def test_npu_pods_request_ascend_devices_in_the_pod_spec(env_cluster):
    pool = _fresh("rollout")
    env_cluster(_on("npu", rollout={"requests": {"cpu": "8", "mem": "64Gi"}, "limits": {}, "accelerators": 2}))
    t = serialize(pool).template
    pod = t.k8s_pod.pod_spec
    primary = next(c for c in pod["containers"] if c["name"] == "primary")
    assert primary["resources"]["limits"]["huawei.com/Ascend910"] == "2"
    assert primary["resources"]["requests"] == {"cpu": "8", "memory": "64Gi", "huawei.com/Ascend910": "2"}
    assert primary["image"].startswith("localhost:30000/areal-flyte-ascend:")


def test_a_one_node_trainer_is_a_pod_running_torchrun_with_shared_memory(env_cluster):
    """nnodes = 1 is a plain pod (no PyTorchJob: no operator needed) whose torchrun starts
    nproc_per_node ranks; without a configured /dev/shm size it gets the pod's memory."""
    trainer = _fresh("trainer")
    env_cluster(_on("cpu", trainer={"nnodes": 1, "nproc_per_node": 2, "shared_memory": ""}))
    t = serialize(trainer).template
    assert t.type == "python-task" and not t.custom
    assert t.extended_resources.shared_memory.size_limit == ""  # as large as the pod's memory
    assert t.extended_resources.shared_memory.mount_path == "/dev/shm"
    assert (trainer.task_config.nnodes, trainer.task_config.nproc_per_node) == (1, 2)


# -- the cluster config --------------------------------------------------------------------------
def test_cluster_config_validation():
    from areal_core.config import ConfigError
    from areal_core.config.cluster import cluster_config_from_dict, load_cluster_config

    cfg = load_cluster_config(ROOT / "configs" / "cluster.yaml")
    assert cfg.world_size == cfg.trainer.nnodes * cfg.trainer.nproc_per_node
    bad = [
        ({"rollout": {"replicaz": 2}}, "unknown cluster config key 'rollout.replicaz'"),
        ({"device": "tpu"}, "'device' must be one of"),
        ({"reward": {"replicas": 0}}, "'reward.replicas' must be >= 1"),
        ({"trainer": {"backend": "megatron"}}, "megatron needs device cuda"),
        ({"trainer": {"tensor_parallel": 2}}, "needs backend megatron"),
        ({"rollout": {"accelerators": 1}}, "must be 0 on device cpu"),
        ({"device": "cuda", "trainer": {"accelerators": 8, "nproc_per_node": 4}}, "must equal 'trainer.accelerators'"),
        (
            {"device": "cuda", "trainer": {"backend": "megatron", "tensor_parallel": 4, "nproc_per_node": 2}},
            "not a multiple of tensor_parallel x pipeline_parallel",
        ),
        ({"rollout": {"requests": {"gpu": "1"}}}, "must map cpu/mem/ephemeral_storage"),
        ({"trainer": {"nnodes": "2"}}, "'trainer.nnodes' must be an integer"),
    ]
    for data, message in bad:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            cluster_config_from_dict(data)


def test_cluster_config_comes_from_the_environment(tmp_path, monkeypatch):
    from areal_core.config.cluster import cluster_config_path, load_cluster_config

    data = cluster_yaml()
    data["rollout"]["replicas"] = 7
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("AREAL_CLUSTER_CONFIG", str(path))
    assert cluster_config_path() == path
    assert load_cluster_config().rollout.replicas == 7


def test_cluster_workflow_refuses_the_local_executor(tmp_path):
    """Its concurrent nodes would deadlock one after another: it fails at once, before any work."""
    from workflows.grpo import grpo_cluster

    with pytest.raises(Exception, match="cannot do"):
        grpo_cluster(overrides=f"store={tmp_path / 'r'}")
    assert not (tmp_path / "r").exists()


def test_a_local_run_of_the_trainer_task_runs_it_once_in_process(tmp_path, monkeypatch):
    """`pyflyte run tasks/roles.py trainer` on one machine: no torchrun (the cluster layout has
    2 nodes, which would wait for a rendezvous), the function runs here and returns the model."""
    from areal_core.run import roles
    from tasks.roles import trainer

    calls = []

    def trains(run_uri: str) -> None:
        calls.append((run_uri, os.getpid()))
        (Path(run_uri) / "final_model").mkdir()

    monkeypatch.setattr(roles, "trainer_task", trains)
    assert trainer.task_config.nnodes == cluster_yaml()["trainer"]["nnodes"] > 1
    out = trainer(run_uri=str(tmp_path))
    assert calls == [(str(tmp_path), os.getpid())]
    assert Path(out.path).name == "final_model"


# -- megatron backend (config checks only: unverified without a GPU) ------------------------------
def test_megatron_config_checks():
    from areal_core.config import ConfigError, load_config
    from areal_core.megatron.checks import check_megatron_config, import_megatron
    from areal_core.megatron.shapes import MegatronParallel, transformer_config_kwargs

    cfg = load_config(
        None,
        [
            "device=cuda",
            "model.hidden_size=256",
            "model.num_heads=8",
            "model.num_kv_heads=4",
            "model.num_layers=8",
            "model.intermediate_size=512",
            "train.batch_groups=8",
            "rollout.group_size=8",
        ],
    )
    shape = check_megatron_config(cfg, MegatronParallel(tensor=4, pipeline=2, world_size=16, micro_batch_size=4))
    kw = transformer_config_kwargs(shape, MegatronParallel(tensor=4, pipeline=2, world_size=16))
    assert (kw["num_query_groups"], kw["tensor_model_parallel_size"], kw["num_layers"]) == (4, 4, 8)
    bad = [
        (MegatronParallel(tensor=8, world_size=8), "must divide model.num_kv_heads=4"),
        (MegatronParallel(tensor=3, world_size=3), "must divide model.num_heads=8"),
        (MegatronParallel(pipeline=3, world_size=3), "must divide model.num_layers=8"),
        (MegatronParallel(tensor=4, pipeline=2, world_size=12), "world size 12 is not a multiple"),
        (MegatronParallel(tensor=1, world_size=1, sequence_parallel=True), "sequence parallel needs tensor"),
        (MegatronParallel(pipeline=1, virtual_pipeline=2, world_size=1), "virtual"),
        (MegatronParallel(tensor=1, world_size=64, micro_batch_size=2), "must split into micro-batches"),
    ]
    for par, message in bad:
        with pytest.raises(ConfigError, match=message):
            check_megatron_config(cfg, par)
    with pytest.raises(ConfigError, match="needs device cuda"):
        check_megatron_config(load_config(None, []), MegatronParallel())
    with pytest.raises(ImportError, match="megatron-core"):
        import_megatron()


# -- MLflow registry ---------------------------------------------------------------------------
def _finished_run(tmp_path, tracking_uri: str):
    """A run root that looks finished: init/final model (the tiny model), a checkpoint, DONE, MLflow run."""
    import torch

    from areal_core.context import load_run_config
    from areal_core.models import build_tiny_model, build_tokenizer, save_pretrained
    from areal_core.run import pipeline
    from areal_core.run.tracking import Tracker
    from areal_core.store import Store
    from areal_core.train import checkpoint

    overrides = [o for o in TINY if not o.startswith("tracking.")]
    run_uri, _ = pipeline.prepare("", [*overrides, f"store={tmp_path / 'run'}", f"tracking.uri={tracking_uri}"])
    store = Store(run_uri)
    cfg = load_run_config(store)
    tok = build_tokenizer(["1 + 2 = 3", "user assistant"], cfg.model.vocab_size)
    model = build_tiny_model(cfg.model, len(tok), seed=3)
    for rel in ("init_model", "final_model"):
        save_pretrained(model, tok, tmp_path / rel)
        store.put_dir(tmp_path / rel, rel)
        store.write_json(f"{rel}/COMMITTED", {})
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.save(store, checkpoint.TrainerState(step=4, version=4), model, opt, [])
    store.write_json("DONE", {"step": 4, "version": 4, "counters": {}})
    Tracker.create(store, cfg)
    return store, model


def _check_registry(tmp_path, tracking_uri: str):
    import mlflow
    import torch

    from areal_core.online.registry import load_registered, register_run

    store, model = _finished_run(tmp_path, tracking_uri)
    out = register_run(
        store.uri, "policy", "cuda", "registry/areal-flyte-cuda-vllm:abc", {"heldout_accuracy_after": 0.5}
    )
    assert out == {"final": "models:/policy/1", "checkpoint": "models:/policy-checkpoints/1"}
    assert register_run(store.uri, "policy", "cuda", "x") == out  # a retried task adds no version
    client = mlflow.MlflowClient(tracking_uri)
    mv = client.get_model_version("policy", "1")
    assert mv.tags["device"] == "cuda" and mv.tags["image"] == "registry/areal-flyte-cuda-vllm:abc"
    assert mv.tags["step"] == "4" and mv.tags["heldout_accuracy_after"] == "0.5000" and mv.tags["kind"] == "final"
    ck = client.get_model_version("policy-checkpoints", "1")
    assert ck.tags["checkpoint_step"] == "4" and ck.tags["device"] == "cuda"
    # trained on "cuda", loaded here on cpu: same weights
    for uri in [*out.values(), "models:/policy@champion"]:
        loaded, tok = load_registered(uri, "cpu", tracking_uri)
        assert next(loaded.parameters()).device.type == "cpu" and tok.eos_token
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[name], tensor)
    # the first final model of a name is its champion and its candidate
    assert str(client.get_model_version_by_alias("policy", "champion").version) == "1"
    assert str(client.get_model_version_by_alias("policy", "candidate").version) == "1"
    # every version is an MLflow transformers model that generates text as it is
    served = mlflow.pyfunc.load_model("models:/policy@champion")
    assert served.metadata.flavors["transformers"]["task"] == "text-generation"
    assert [p.name for p in served.metadata.signature.params.params] == ["max_new_tokens", "do_sample"]
    text = served.predict(["1 + 2 ="], params={"max_new_tokens": 3})
    assert isinstance(text[0], str) and text[0].startswith("1 + 2 =")
    # a second run's final model waits as candidate; the champion stays
    store2, _ = _finished_run(tmp_path / "second", tracking_uri)
    assert register_run(store2.uri, "policy", "cpu", "x", include_checkpoint=False) == {"final": "models:/policy/2"}
    assert str(client.get_model_version_by_alias("policy", "candidate").version) == "2"
    assert str(client.get_model_version_by_alias("policy", "champion").version) == "1"


def test_register_final_model_and_checkpoint_with_device_and_image_tags(tmp_path):
    _check_registry(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}")


@pytest.mark.slow
def test_register_against_an_mlflow_server(tmp_path, mlflow_server):
    _check_registry(tmp_path, mlflow_server)


# -- the simulated-cost mode --------------------------------------------------------------------
def test_simulation_applies_the_staleness_rules():
    from areal_core.sim import SimConfig, simulate

    base = {"rollout_workers": 8, "slots": 16, "trainer_workers": 2, "batch_groups": 8, "group_size": 4, "steps": 20}
    for eta in (0, 1, 3):
        r = simulate(SimConfig(**base, eta=eta, warmup_steps=4))
        assert r.steps == 20 and r.admission_violations == 0
        assert max(r.staleness_histogram) <= eta  # the hard bound: nothing older than v - η is trained
        if eta == 0:
            assert set(r.staleness_histogram) == {0} and r.dropped_samples == 0  # synchronous, on-policy
    r = simulate(SimConfig(**base, eta=1, admission=False, warmup_steps=4))  # no admission: the hard bound drops
    assert r.dropped_samples > 0 and max(r.staleness_histogram) <= 1


def test_simulation_async_beats_sync_and_approaches_capacity():
    from areal_core.sim import SimConfig, compare

    """A small cluster with the benchmark's long-tail lengths: 16 rollout engines of 32 slots,
    4 trainer workers, 64 groups of 8 a step, η = 8."""
    cfg = SimConfig(
        rollout_workers=16, slots=32, trainer_workers=4, batch_groups=64, group_size=8, steps=30, warmup_steps=6, eta=8
    )
    out = compare(cfg)
    assert out["speedup"] > 2.77
    assert 0.88 < out["async"]["efficiency"] <= 1.0
    assert out["sync"]["efficiency"] < 0.3
    assert out["async"]["staleness_max"] <= 8 and out["sync"]["staleness_max"] == 0


# -- the topology, for real (slow) ----------------------------------------------------------------
def _pyflyte_role(task: str, run_uri: str, log_path: Path, index: int | None = None) -> subprocess.Popen:
    args = [PYFLYTE, "run", "tasks/roles.py", task, "--run_uri", run_uri]
    if index is not None:
        args += ["--index", str(index)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # AWS_* from the s3_server fixture: the moto endpoint
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.s3
def test_cluster_topology_as_separate_pyflyte_runs_on_s3(tmp_path, s3_bucket):
    from areal_core.context import load_run_config
    from areal_core.run import pipeline
    from areal_core.store import Store

    overrides = [*TINY, f"store={s3_bucket}/runs/topology", "rollout.num_workers=2", "reward.num_workers=2"]
    run_uri, _ = pipeline.prepare("", overrides)
    pipeline.sft(run_uri)
    store = Store(run_uri)
    assert store.uri.startswith("s3://")
    cfg = load_run_config(store)
    procs = {
        "trainer": _pyflyte_role("trainer", run_uri, tmp_path / "trainer.log"),
        "rollout-0": _pyflyte_role("rollout_worker", run_uri, tmp_path / "rollout-0.log", 0),
        "rollout-1": _pyflyte_role("rollout_worker", run_uri, tmp_path / "rollout-1.log", 1),
        "reward-0": _pyflyte_role("reward_worker", run_uri, tmp_path / "reward-0.log", 0),
        "reward-1": _pyflyte_role("reward_worker", run_uri, tmp_path / "reward-1.log", 1),
    }
    deadline = time.time() + 420
    try:
        while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
            failed = {k: p.returncode for k, p in procs.items() if p.poll() not in (None, 0)}
            assert not failed, f"{failed}: {(tmp_path / (next(iter(failed)) + '.log')).read_text()[-3000:]}"
            time.sleep(1)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = {k: (tmp_path / f"{k}.log").read_text() for k in procs}
    assert all(p.returncode == 0 for p in procs.values()), {k: v[-2000:] for k, v in logs.items()}
    assert store.done()
    assert "DONE at step" in logs["trainer"]  # the trainer task ran the role in its own process
    trained = [store.read_json(p) for p in store.find("trainer/trained", ".json")]
    assert [t["step"] for t in trained] == list(range(cfg.train.steps))
    ids = [sid for t in trained for sid, _ in t["samples"]]
    assert len(ids) == len(set(ids)) == cfg.train.steps * cfg.train.batch_groups * cfg.rollout.group_size
    for t in trained:
        assert all(v >= t["trainer_version"] - cfg.train.eta for _, v in t["samples"])
    workers = {sid.split("-g")[0] for sid in ids}
    assert workers == {"rollout-0", "rollout-1"}  # both rollout processes fed the trainer
    statuses = store.statuses()
    assert {"rollout-0", "rollout-1", "reward-0", "reward-1", "trainer-0"} <= set(statuses)
    assert store.latest_version() == cfg.train.steps
    assert store.exists("final_model/COMMITTED")


@pytest.mark.slow
def test_the_topology_is_read_from_the_env_when_serialized(tmp_path):
    """A cuda cluster file named in a fresh process: every task and the PyTorchJob follow it."""
    data = cluster_yaml()
    data["device"] = "cuda"
    data["rollout"].update(replicas=8, accelerators=1)
    data["trainer"].update(nnodes=4, nproc_per_node=8, accelerators=8, accelerator_type="nvidia-h100")
    path = tmp_path / "cuda.yaml"
    path.write_text(yaml.safe_dump(data))
    script = textwrap.dedent(
        """
        import json
        from tests.test_flyte import serialize
        from workflows.grpo import grpo_cluster
        from tasks.roles import trainer, rollout_worker
        from flytekit.models.task import Resources as R
        wf = serialize(grpo_cluster)
        t = serialize(trainer).template
        r = serialize(rollout_worker).template
        pools = [n.array_node.to_flyte_idl().parallelism for n in wf.template.nodes if n.array_node]
        print("RESULT", json.dumps({"custom": t.custom, "image": t.container.image, "pools": pools,
            "gpu": [x.value for x in r.container.resources.requests if x.name == R.ResourceName.GPU],
            "accel": t.extended_resources.gpu_accelerator.device}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "AREAL_CLUSTER_CONFIG": str(path)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.split("RESULT", 1)[1])
    assert got["custom"]["workerReplicas"]["replicas"] == 4 and got["custom"]["elasticConfig"]["nprocPerNode"] == 8
    assert got["image"].startswith("localhost:30000/areal-flyte-cuda-vllm:")
    assert got["pools"] == [8, 2] and got["gpu"] == ["1"] and got["accel"] == "nvidia-h100"


# -- the Flyte execution, handed to areal_core -------------------------------------------------
def test_tasks_bind_the_flyte_execution_for_areal_core(monkeypatch):
    from types import SimpleNamespace

    import flytekit

    from areal_core.run.tracking import EXECUTION_ENV, Execution
    from tasks.execution import bind_execution, console_env

    for var in EXECUTION_ENV.values():
        monkeypatch.setenv(var, "")  # restored (unset) after the test, whatever bind_execution sets
    assert bind_execution() == Execution() and Execution.from_env() == Execution()  # a local run
    monkeypatch.setenv("FLYTE_PLATFORM_URL", "flyte.example.com")
    assert console_env() == {"AREAL_FLYTE_CONSOLE": "https://flyte.example.com"}
    ex = SimpleNamespace(name="f3a9", project="areal", domain="production")
    monkeypatch.setattr(flytekit, "current_context", lambda: SimpleNamespace(execution_id=ex))
    bound = bind_execution()
    assert Execution.from_env() == bound == Execution("f3a9", "areal", "production", "https://flyte.example.com")
    assert bound.url == "https://flyte.example.com/console/projects/areal/domains/production/executions/f3a9"
    assert bound.run_name("default") == "f3a9"


def test_a_role_logs_its_machines_system_metrics_to_the_run(tmp_path, monkeypatch):
    import mlflow

    from areal_core.run.tracking import Tracker, new_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = new_run(mlflow.MlflowClient(uri), "exp", "sys")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
    wanted = {"system/rollout-1/cpu_utilization_percentage", "system/rollout-1/system_memory_usage_megabytes"}
    with Tracker(run_id, uri).system_metrics("rollout-1"):  # until logged (every 0.5 s): no fixed wait
        wait_until(lambda: wanted <= set(mlflow.MlflowClient(uri).get_run(run_id).data.metrics), 120, str(wanted))
    with Tracker(None, "").system_metrics("x"):  # tracking disabled: nothing to do
        pass
