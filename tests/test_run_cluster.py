"""areal_core/run/cluster.py without Flyte: the run config a cluster run trains with, a scheduled
run's root, the failure node's step, what a cluster task's pod carries and reads back, the
trainer's layout. Nothing here imports flytekit or tasks/."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, TINY


@pytest.fixture
def env_cluster(tmp_path, monkeypatch):
    """Point $AREAL_CLUSTER_CONFIG at a file made from `data` (configs/cluster.yaml's keys updated),
    with no registered spec in the environment, and forget the process's cached cluster config."""
    from areal_core.run.cluster import registered_cluster

    monkeypatch.delenv("AREAL_CLUSTER_SPEC", raising=False)
    monkeypatch.delenv("AREAL_IMAGE", raising=False)

    def use(data: dict) -> None:
        path = tmp_path / f"cluster-{len(list(tmp_path.glob('cluster-*')))}.yaml"
        path.write_text(yaml.safe_dump(data))
        monkeypatch.setenv("AREAL_CLUSTER_CONFIG", str(path))
        registered_cluster.cache_clear()

    yield use
    registered_cluster.cache_clear()


def test_a_scheduled_run_gets_its_own_root_a_manual_run_none():
    from areal_core.run.cluster import UNSCHEDULED, kickoff_suffix, scheduled

    monday = datetime.datetime(2025, 1, 6, 3, 0, tzinfo=datetime.UTC)
    assert kickoff_suffix(monday) == "20250106T030000Z" and scheduled(monday) == monday
    assert kickoff_suffix(UNSCHEDULED) == "" and scheduled(UNSCHEDULED) is None
    assert scheduled(UNSCHEDULED.replace(tzinfo=None)) is None  # Flyte may hand the default back naive


def test_the_cluster_forces_its_worker_counts_and_device_over_the_users(tmp_path):
    from areal_core.config.cluster import cluster_config_from_dict
    from areal_core.run.cluster import cluster_config, cluster_overrides

    cluster = cluster_config_from_dict({"rollout": {"replicas": 3}, "reward": {"replicas": 2}})
    user = f"store={tmp_path / 'runs'} rollout.num_workers=1 device=cuda"
    cfg, full = cluster_config("", user, cluster, store_suffix="20250106T030000Z")
    assert (cfg.rollout.num_workers, cfg.reward.num_workers, cfg.device) == (3, 2, "cpu")
    assert cfg.store == f"{tmp_path / 'runs'}/20250106T030000Z"
    assert full[-1] == f"store={tmp_path / 'runs'}/20250106T030000Z"
    assert cluster_overrides("", cluster)[-3:] == ["rollout.num_workers=3", "reward.num_workers=2", "device=cpu"]


def test_a_cluster_run_with_vllm_uses_the_images_python_not_the_local_venv():
    """No image holds the project's .venv-vllm: on the cluster the vLLM server runs on the pod's
    own python (the image's); the run config's check of the interpreter must not fail there."""
    from areal_core.config import RunConfig
    from areal_core.config.cluster import cluster_config_from_dict
    from areal_core.run.cluster import cluster_config

    cluster = cluster_config_from_dict({})
    cfg, full = cluster_config("configs/default.yaml", "rollout.engine=vllm", cluster)
    assert cfg.rollout.server.python == sys.executable and full[0] == f"rollout.server.python={sys.executable}"
    own = "/usr/bin/python3"
    assert (
        cluster_config("", f"rollout.engine=vllm rollout.server.python={own}", cluster)[0].rollout.server.python == own
    )
    typed = RunConfig.model_validate({"rollout": {"engine": "vllm", "server": {"python": own}}})
    assert cluster_config("", "", cluster, typed=typed)[0].rollout.server.python == own


def test_prepare_task_writes_the_scheduled_root_with_the_cluster_worker_counts(tmp_path):
    from areal_core.config import RunConfig
    from areal_core.config.cluster import cluster_config_from_dict
    from areal_core.context import load_run_config
    from areal_core.run.cluster import prepare_task
    from areal_core.store import Store

    cluster = cluster_config_from_dict({"rollout": {"replicas": 3}, "reward": {"replicas": 2}})
    overrides = " ".join([*TINY, f"store={tmp_path / 'runs'}", "rollout.num_workers=1"])
    monday = datetime.datetime(2025, 1, 6, 3, 0, tzinfo=datetime.UTC)
    run_uri, key = prepare_task(RunConfig(), "", overrides, False, monday, cluster)
    assert run_uri.endswith("/runs/20250106T030000Z") and key
    cfg = load_run_config(Store(run_uri))
    assert (cfg.rollout.num_workers, cfg.reward.num_workers, cfg.device) == (3, 2, "cpu")


def test_prepare_rejects_a_megatron_layout_that_does_not_fit_the_model(tmp_path):
    from areal_core.config import ConfigError
    from areal_core.config.cluster import cluster_config_from_dict
    from areal_core.run.cluster import prepare_for_cluster

    cluster = cluster_config_from_dict(
        {"device": "cuda", "trainer": {"backend": "megatron", "tensor_parallel": 8, "nproc_per_node": 8}}
    )
    with pytest.raises(ConfigError, match="tensor parallel 8 must divide model.num_heads=2"):
        prepare_for_cluster("", " ".join([*TINY, f"store={tmp_path / 'r'}"]), False, cluster)
    assert not (tmp_path / "r").exists()


def test_the_failure_step_finds_the_root_prepare_chose(tmp_path):
    """mark_failed_task gets the workflow's inputs, not the run root: it must derive the same root
    (a scheduled run's own) as prepare_task did, and say whether there was an MLflow run to mark."""
    import mlflow

    from areal_core.config import RunConfig
    from areal_core.config.cluster import cluster_config_from_dict
    from areal_core.context import load_run_config
    from areal_core.run.cluster import mark_failed_task, prepare_task
    from areal_core.run.tracking import Tracker
    from areal_core.store import Store

    cluster = cluster_config_from_dict({})
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [o for o in TINY if not o.startswith("tracking.")]
    overrides = " ".join([*overrides, f"store={tmp_path / 'runs'}", f"tracking.uri={tracking}"])
    monday = datetime.datetime(2025, 1, 6, 3, 0, tzinfo=datetime.UTC)
    run_uri, _ = prepare_task(RunConfig(), "", overrides, False, monday, cluster)
    tracker = Tracker.create(Store(run_uri), load_run_config(Store(run_uri)))
    assert mark_failed_task(RunConfig(), "", overrides, monday, cluster) is True
    assert mlflow.MlflowClient(tracking).get_run(tracker.run_id).info.status == "FAILED"


def test_a_pod_reads_back_the_config_it_was_registered_with(env_cluster, monkeypatch):
    """What registration puts in a task's environment (pod_env) is all a pod needs: with that
    environment and no file, registered_cluster() is the registering shell's config, and
    pod_identity reports the registered device and image; a local call reports the defaults."""
    from areal_core.config.cluster import load_cluster_config
    from areal_core.run.cluster import pod_env, pod_identity, registered_cluster

    data = yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text())
    data["rollout"]["replicas"] = 7
    env_cluster(data)
    registering = registered_cluster()
    assert registering.rollout.replicas == 7
    assert pod_identity(lambda: "local/image:tag") == {"device": "cpu", "image": "local/image:tag"}
    env = pod_env(registering, "registry/areal-flyte-cpu:abc", {"EXTRA": "1"})
    assert env["AREAL_DEVICE"] == "cpu" and env["EXTRA"] == "1" and json.loads(env["AREAL_CLUSTER_SPEC"])
    # the pod: only the registered environment (the file it named is gone from its view)
    monkeypatch.setenv("AREAL_CLUSTER_CONFIG", "/nonexistent/cluster.yaml")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    registered_cluster.cache_clear()
    assert registered_cluster() == registering == load_cluster_config()
    assert pod_identity(lambda: "never/asked:x") == {"device": "cpu", "image": "registry/areal-flyte-cpu:abc"}


def test_the_cluster_config_is_read_once_on_first_use(env_cluster):
    """Read when first asked for, then fixed for the process: a registration sees one config even
    if the file changes while it serializes."""
    from areal_core.run.cluster import registered_cluster

    data = yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text())
    env_cluster(data)
    first = registered_cluster()
    data["reward"]["replicas"] = 5
    Path(os.environ["AREAL_CLUSTER_CONFIG"]).write_text(yaml.safe_dump(data))
    assert registered_cluster() is first and first.reward.replicas == 2


def test_pools_and_the_trainer_layout_follow_the_config():
    from areal_core.config.cluster import cluster_config_from_dict
    from areal_core.run.cluster import pool_indices, trainer_layout

    cluster = cluster_config_from_dict(
        {"rollout": {"replicas": 3}, "trainer": {"nnodes": 4, "nproc_per_node": 2, "max_restarts": 1}}
    )
    assert pool_indices(cluster, "rollout") == [0, 1, 2] and pool_indices(cluster, "reward") == [0]
    with pytest.raises(ValueError, match="not a pool"):
        pool_indices(cluster, "trainer")
    layout = trainer_layout(cluster)
    assert (layout.nnodes, layout.nproc_per_node, layout.max_restarts, layout.world_size) == (4, 2, 1, 8)
