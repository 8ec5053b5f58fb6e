"""The workflows executed the way a Flyte cluster runs them (tests/podemu/): serialized with
`pyflyte package` under a non-default cluster config, then every node as pods: the task's own
container command in a fresh process whose environment is only what the task spec declares
(plus what Flyte and the Kubeflow operator inject, and S3 credentials), inputs and outputs as
literal maps on the moto S3 endpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT, TINY
from tests.podemu.execute import Execution, PodFailure, to_literals, to_python
from tests.podemu.package import package
from tests.podemu.pods import container

# the cluster config the tests register with: nothing here is the default (configs/cluster.yaml)
CLUSTER = {
    "device": "cpu",
    "rollout": {"replicas": 3, "requests": {"cpu": "1", "mem": "3Gi"}, "retries": 1},
    "reward": {"replicas": 2, "requests": {"cpu": "1", "mem": "1Gi"}, "retries": 1},
    "trainer": {"nnodes": 1, "nproc_per_node": 2, "requests": {"cpu": "2", "mem": "6Gi"}, "retries": 1},
    "small": {"requests": {"cpu": "500m", "mem": "1Gi"}},
    "single": {"requests": {"cpu": "1", "mem": "2Gi"}},
}


# what the cluster's Kubernetes secrets hold (tasks/resources.py: SECRETS): the moto endpoint's keys
SECRETS = {
    ("areal-s3", "access-key-id"): "testing",
    ("areal-s3", "secret-access-key"): "testing",
    ("areal-mlflow", "tracking-token"): "unused-by-this-server",
}


def registration_env(cluster_file) -> dict[str, str]:
    """The registering user's shell: the cluster config file named in $AREAL_CLUSTER_CONFIG."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AREAL_", "PYTEST"))}
    return env | {"AREAL_CLUSTER_CONFIG": str(cluster_file), "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def cluster_package(tmp_path_factory):
    """Every workflow under workflows/, registered with the non-default cluster config."""
    tmp = tmp_path_factory.mktemp("registration")
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(CLUSTER))
    return package(ROOT, tmp / "pkg", registration_env(path))


def _env(template) -> dict[str, str]:
    return container(template).env


def test_the_cluster_config_travels_with_the_registered_tasks(cluster_package, tmp_path):
    """Registration reads the config file named in $AREAL_CLUSTER_CONFIG; a pod has neither the
    variable nor the file. Its task spec carries the config: a fresh interpreter with nothing but
    the trainer task's declared environment gets the registered pools, layout, device and image,
    not configs/cluster.yaml's."""
    tasks = cluster_package.tasks
    cluster_tasks = [
        t for name, t in tasks.items() if name.startswith(("tasks.cluster.", "tasks.register.", "tasks.roles."))
    ]
    assert len(cluster_tasks) >= 6
    specs = {_env(t)["AREAL_CLUSTER_SPEC"] for t in cluster_tasks}
    assert len(specs) == 1
    trainer = tasks["tasks.roles.trainer"]
    assert trainer.type == "python-task"  # nnodes 1: one pod, torchrun inside it
    wf = cluster_package.workflows["workflows.grpo.grpo_cluster"]
    assert sorted(n.array_node.parallelism for n in wf.nodes if n.WhichOneof("target") == "array_node") == [2, 3]
    # the pod's view: what the trainer task launches under torchrun, and what the tasks report
    script = (
        "import json\n"
        "from areal_core.run.cluster import pod_identity, pool_indices, registered_cluster\n"
        "from tasks.roles import trainer\n"
        "c = registered_cluster()\n"
        "print('RESULT', json.dumps([c.rollout.replicas, c.reward.replicas, trainer.task_config.nnodes,\n"
        "    trainer.task_config.nproc_per_node, pod_identity(lambda: 'not registered')['device'],\n"
        "    pod_identity(lambda: 'not registered')['image'], pool_indices(c, 'rollout')]))\n"
    )
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)} | _env(trainer)
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.split("RESULT", 1)[1])
    assert got == [3, 2, 1, 2, "cpu", container(trainer).image, [0, 1, 2]]


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.timeout(1200)
def test_harness_runs_plain_map_and_pytorchjob_pods(tmp_path, s3_bucket, s3_server):
    """The harness on a small workflow: a task sees only its declared env, a map task's pods
    their index (as Flyte passes it), a 2-pod PyTorchJob rendezvous with the operator's env."""
    pkg = package(ROOT, tmp_path / "pkg", registration_env(tmp_path / "none.yaml"), packages="tests.podemu.toy")
    wf = "tests.podemu.toy.toy"
    ex = Execution(pkg, wf, s3_bucket, ROOT, tmp_path / "pods", s3_server, timeout_s=900)
    out = ex.run(to_literals(pkg, wf, {"x": 4}))
    seen = json.loads(to_python(out["o0"], str))
    assert seen == {
        "BATCH_JOB_ARRAY_INDEX_VAR_NAME": None,
        "PET_NNODES": None,
        "PET_NPROC_PER_NODE": None,
        "AREAL_TOY": "declared",
        "AREAL_CLUSTER_CONFIG": None,  # the registering shell's variable does not reach a pod
        "x": 4,
    }
    assert to_python(out["o1"], list[int]) == [1, 4, 16]
    ranks = json.loads(to_python(out["o2"], str))
    assert sorted(r[0] for r in ranks["ranks"]) == [0, 1] and {r[1] for r in ranks["ranks"]} == {2}
    assert sorted(r[2] for r in ranks["ranks"]) == [0, 1]  # two nodes (pods), one process each
    assert len([p for p in ex.pods() if "-worker-" in p.name]) == 2
    workers = [p.env for p in ex.pods() if "-worker-" in p.name]
    assert [(e["PET_NNODES"], e["PET_NPROC_PER_NODE"], e["PET_RDZV_BACKEND"]) for e in workers] == [
        ("2:2", "1", "c10d")
    ] * 2
    assert len([p for p in ex.pods() if p.env.get("BATCH_JOB_ARRAY_INDEX_VAR_NAME")]) == 3


def tracked_overrides(run_uri: str, tracking: str, *extra: str) -> list[str]:
    overrides = [o for o in TINY if not o.startswith("tracking.")]
    return [*overrides, f"store={run_uri}", "tracking.enabled=true", f"tracking.uri={tracking}", *extra]


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.timeout(2700)
def test_grpo_cluster_runs_as_pods_to_done_and_a_registered_model(
    cluster_package, tmp_path, s3_bucket, s3_server, mlflow_server
):
    """`grpo_cluster` as a cluster runs it: 3 rollout pods, 2 reward pods and a 2-process Elastic
    trainer (all concurrent), then evaluate and register, to DONE and a registered model."""
    import mlflow

    from areal_core.context import load_run_config
    from areal_core.store import Store

    tracking = mlflow_server
    run_uri = f"{s3_bucket}/runs/podemu"
    wf = "workflows.grpo.grpo_cluster"
    inputs = {"overrides": " ".join(tracked_overrides(run_uri, tracking)), "model_name": "podemu-policy"}
    ex = Execution(cluster_package, wf, s3_bucket, ROOT, tmp_path / "pods", s3_server, SECRETS, timeout_s=2400)
    out = ex.run(to_literals(cluster_package, wf, inputs))
    assert to_python(out["o0"], str) == "models:/podemu-policy/1"

    # what ran: one pod per replica, the trainer as one pod of two processes (from the config)
    by_node = {nid: nr.pods for nid, nr in ex.runs.items()}
    names = {nid: cluster_package.tasks[ex.runs[nid].template.id.name].id.name for nid in by_node}
    pools = {n: len(by_node[nid]) for nid, n in names.items() if "map_" in n}
    assert sorted(pools.values()) == [2, 3] and any("rollout" in n and c == 3 for n, c in pools.items())
    trainer = next(nid for nid, n in names.items() if n == "tasks.roles.trainer")
    assert len(by_node[trainer]) == 1
    assert all("AREAL_CLUSTER_CONFIG" not in p.env for p in ex.pods())
    store = Store(run_uri)
    assert store.done()
    cfg = load_run_config(store)
    assert (cfg.rollout.num_workers, cfg.reward.num_workers, cfg.device) == (3, 2, "cpu")
    statuses = store.statuses()
    roles = {k for k in statuses if k.startswith(("rollout-", "reward-", "trainer-"))}
    assert roles == {"rollout-0", "rollout-1", "rollout-2", "reward-0", "reward-1", "trainer-0"}
    assert statuses["trainer-0"]["world_size"] == 2  # nproc_per_node 2 of the registered config
    assert store.exists("final_model/COMMITTED")

    # the registered model, tagged with the device and image the pods ran in
    image = container(cluster_package.tasks["tasks.register.register"]).image
    client = mlflow.MlflowClient(tracking)
    mv = client.get_model_version("podemu-policy", "1")
    assert mv.tags["device"] == "cpu" and mv.tags["image"] == image
    assert str(client.get_model_version_by_alias("podemu-policy", "champion").version) == "1"
    mlflow.set_tracking_uri(tracking)
    served = mlflow.pyfunc.load_model("models:/podemu-policy@champion")
    text = served.predict(["1 + 2 ="], params={"max_new_tokens": 3})
    assert isinstance(text[0], str) and text[0].startswith("1 + 2 =")


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.timeout(1800)
def test_a_failed_cluster_run_runs_the_failure_node(cluster_package, tmp_path, s3_bucket, s3_server, mlflow_server):
    """The trainer's pod is evicted with its retries spent: the node fails, the other pods stop,
    and the workflow's failure node marks the run's MLflow run FAILED."""
    import mlflow

    from areal_core.run.tracking import Tracker
    from areal_core.store import Store

    run_uri = f"{s3_bucket}/runs/failed"
    overrides = tracked_overrides(run_uri, mlflow_server, "train.steps=200", "tracking.experiment=podemu-failed")
    wf = "workflows.grpo.grpo_cluster"
    trainer = "tasks.roles.trainer"
    ex = Execution(
        cluster_package, wf, s3_bucket, ROOT, tmp_path / "pods", s3_server, SECRETS, timeout_s=1200, evict={trainer: 15}
    )
    with pytest.raises(PodFailure) as failure:
        ex.run(to_literals(cluster_package, wf, {"overrides": " ".join(overrides)}))
    failed = ex.runs[failure.value.node_id]
    assert failed.template.id.name == trainer, str(failure.value)[-5000:]
    fn = cluster_package.workflows[wf].failure_node.id
    assert [p.poll() for p in ex.runs[fn].pods] == [0], str(failure.value)[-5000:]
    assert all(p.poll() is not None for p in ex.pods())  # nothing left running
    run_id = Tracker.attach(Store(run_uri)).run_id
    assert mlflow.MlflowClient(mlflow_server).get_run(run_id).info.status == "FAILED"
