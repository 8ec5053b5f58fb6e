"""The Flyte 2 front end (flyte2/, docs/flyte2.md), run through its own venv (.venv-flyte2, made by
scripts/setup_flyte2_venv.sh; the `flyte` SDK cannot live in .venv beside flytekit without
changing what pyflyte draws its command line with): each test starts that venv's python or its
`flyte` command in a subprocess and is skipped, saying why, when the venv is absent or broken.

- the local run of the embedded default job (the TINY overrides) reaches DONE in its run root with
  the files a flytekit run writes, the three roles running at once as Flyte tasks;
- what `flyte deploy` would send (flyte2/dryrun.py) takes its images, resources, replicas,
  reuse policies, Elastic layout and triggers from configs/cluster.yaml and images/specs.py;
- a bad config is refused, in one line, before any task runs.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from areal_core.layout import LAYOUT
from areal_core.weights import WEIGHTS_FILE
from tests.conftest import ROOT, TINY

VENV = ROOT / ".venv-flyte2"
PYTHON, FLYTE = VENV / "bin" / "python", VENV / "bin" / "flyte"
SETUP = "scripts/setup_flyte2_venv.sh"
ROLES = ("trainer", "rollout", "reward")


@functools.cache
def venv_problem() -> str:
    """Why the Flyte 2 venv cannot run the front end ('' when it can)."""
    if not PYTHON.exists():
        return f"the Flyte 2 venv {VENV.name} is absent: run {SETUP} (.ci/run builds it; its log says why it could not)"
    probe = run_py("-c", "import flyte, flyteplugins.pytorch, flyte2.grpo; print(flyte.__version__)", timeout=300)
    if probe.returncode != 0:
        return f"the Flyte 2 venv {VENV.name} cannot import the front end: {probe.stderr.strip()[-500:]}"
    return ""


@pytest.fixture
def flyte2_venv() -> None:
    if problem := venv_problem():
        pytest.skip(problem)


needs_venv = pytest.mark.usefixtures("flyte2_venv")


def env(**extra: str) -> dict[str, str]:
    """The subprocess's environment: the project on the path, no cluster config of the caller's."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "AREAL_CLUSTER", "VIRTUAL_ENV"))}
    return base | {"PYTHONPATH": str(ROOT), "COLUMNS": "300", "PYTHONUNBUFFERED": "1"} | extra


def run_py(*args: str, timeout: int = 300, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(PYTHON), *args], cwd=ROOT, env=env(**extra), capture_output=True, text=True, timeout=timeout
    )


def run_flyte(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(FLYTE), *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


# -- (a) the local run ----------------------------------------------------------------------------
def role_times(store: Path) -> dict[str, list[float]]:
    """Every event time of each role in the run root's events (areal_core/events.py), sorted."""
    from areal_core.events import read_events
    from areal_core.store import Store

    times: dict[str, list[float]] = {role: [] for role in ROLES}
    for record in read_events(Store(str(store))):
        if record.get("role") in times:
            times[record["role"]] += [record["t"], *(record[k] for k in ("t0", "t1") if k in record)]
    return {role: sorted(t) for role, t in times.items()}


@needs_venv
@pytest.mark.slow
def test_local_run_of_the_default_job_reaches_done_with_the_roles_running_at_once(tmp_path):
    """`flyte run --local flyte2/grpo.py grpo` with the TINY overrides and a typed config: DONE in
    its run root with what a flytekit run writes; each role ran as its Flyte task, at once."""
    store = tmp_path / "run,1"
    out = run_flyte(
        "run",
        "--local",
        "flyte2/grpo.py",
        "grpo",
        "--cfg",
        json.dumps({"train": {"eta": 1}}),
        "--overrides",
        " ".join([*TINY, f"store={store}"]),
    )
    both = out.stdout + out.stderr
    assert out.returncode == 0, both[-4000:]
    assert "held-out greedy accuracy: before RL" in both
    for rel in (LAYOUT.config, LAYOUT.done, f"{LAYOUT.final_model}/{WEIGHTS_FILE}", LAYOUT.latest):
        assert (store / rel).is_file(), rel
    assert list((store / LAYOUT.trained_dir).glob("step-*.json"))
    assert "eta: 1" in (store / LAYOUT.config).read_text()  # the typed config, over the YAML
    for role in ROLES:  # every role ran through its task (flyte2/roles.py), its output forwarded
        assert f'[{role}-0] {{"role": "{role}"' in both, role
    times = role_times(store)
    assert all(times[role] for role in ROLES), {r: len(t) for r, t in times.items()}
    # at once: every two roles' event timelines overlap, and rollout recorded events while the
    # trainer ran (between its first and last) and the trainer while rollout ran
    spans = {role: (t[0], t[-1]) for role, t in times.items()}
    for a in ROLES:
        for b in ROLES:
            assert spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1], (a, b, spans)
    assert any(spans["trainer"][0] < t < spans["trainer"][1] for t in times["rollout"])
    assert any(spans["rollout"][0] < t < spans["rollout"][1] for t in times["trainer"])


@needs_venv
@pytest.mark.slow
def test_the_cluster_job_runs_on_this_machine(tmp_path):
    """flytekit's local executor cannot run grpo_cluster (it runs nodes one at a time); the Flyte 2
    local mode runs its pools as configs/cluster.yaml sizes them (2 rollout and 2 reward workers,
    forced into the run config) and the trainer at once, to DONE."""
    from areal_core.events import read_events
    from areal_core.store import Store

    store = tmp_path / "run"
    out = run_flyte(
        "run", "--local", "flyte2/grpo.py", "grpo_cluster", "--overrides", " ".join([*TINY, f"store={store}"])
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert (store / "DONE").is_file() and (store / "final_model" / "model.safetensors").is_file()
    cluster = yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text())
    cfg = yaml.safe_load((store / "config.yaml").read_text())
    assert cfg["rollout"]["num_workers"] == cluster["rollout"]["replicas"]
    assert cfg["reward"]["num_workers"] == cluster["reward"]["replicas"]
    workers = {(r["role"], r["worker"]) for r in read_events(Store(str(store)))}
    want = {("rollout", str(i)) for i in range(cluster["rollout"]["replicas"])}
    want |= {("reward", str(i)) for i in range(cluster["reward"]["replicas"])} | {("trainer", "0")}
    assert want <= workers, workers


@needs_venv
@pytest.mark.slow
def test_a_role_that_fails_stops_the_others_and_fails_the_run(tmp_path):
    """A rollout worker whose vLLM server cannot start fails (after its retries); the trainer task
    stops its process, the job fails naming the role, the run's MLflow run is FAILED, and no role
    process is left."""
    import mlflow

    from areal_core.run.tracking import Tracker
    from areal_core.store import Store

    store, db = tmp_path / "run", tmp_path / "mlflow.db"
    overrides = [o for o in TINY if not o.startswith("tracking.")] + [
        f"store={store}",
        "tracking.enabled=true",
        f"tracking.uri=sqlite:///{db}",
        "rollout.engine=vllm",
        "rollout.server.python=/bin/false",  # exists, so the config passes; the server exits at once
    ]
    out = run_flyte("run", "--local", "flyte2/grpo.py", "grpo", "--overrides", " ".join(overrides))
    both = out.stdout + out.stderr
    assert out.returncode != 0 and "role rollout-0 exited with code 1" in both, both[-4000:]
    assert "role trainer-0 stopped: another role of the run failed" in both
    assert not (store / "DONE").exists()
    run_id = Tracker.attach(Store(str(store))).run_id
    assert run_id and mlflow.MlflowClient(f"sqlite:///{db}").get_run(run_id).info.status == "FAILED"
    left = [p for p in Path("/proc").glob("[0-9]*") if str(store).encode() in _cmdline(p)]
    assert left == []


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


@needs_venv
@pytest.mark.slow
def test_replay_and_fork_of_a_run_through_flyte2(tmp_path):
    """flyte2/derived.py on a finished run (made here by areal_core, as `make run` does): the replay
    reproduces its steps exactly; the fork continues from step 2 to DONE with its roles as Flyte
    tasks, and the parent gains only its lineage record."""
    from areal_core.run import pipeline

    parent = tmp_path / "parent"
    run_uri, _ = pipeline.prepare("", [*TINY, f"store={parent}"])
    pipeline.run_async_rl(run_uri, pipeline.sft(run_uri))
    parent_config = (parent / "config.yaml").read_text()
    script = (
        "import dataclasses, json, sys, flyte\n"
        "from flyte2 import derived\n"
        "flyte.init()\n"
        f"replayed = flyte.run(derived.replay, run={str(parent)!r}, into={str(tmp_path / 'replay')!r}).outputs()[0]\n"
        f"forked = flyte.run(derived.fork, run={str(parent)!r}, step=2, into={str(tmp_path / 'fork')!r},\n"
        "                   overrides='train.lr=1e-4').outputs()[0]\n"
        "print('RESULT' + json.dumps({'replay': dataclasses.asdict(replayed), 'fork': dataclasses.asdict(forked)}))\n"
    )
    out = run_py("-c", script, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    got = json.loads(out.stdout.split("RESULT", 1)[1])
    assert got["replay"]["steps"] == 4
    assert got["replay"]["max_loss_rel_diff"] == 0.0 and got["replay"]["max_grad_norm_rel_diff"] == 0.0
    assert set(got["fork"]) == {"before", "after"}  # held-out accuracy (jobs/catalog.py: ACCURACY)
    assert (tmp_path / "fork" / "DONE").is_file() and (tmp_path / "fork" / "final_model").is_dir()
    assert (parent / "config.yaml").read_text() == parent_config and list((parent / "lineage").rglob("*.json"))
    assert '[rollout-0] {"role": "rollout"' in out.stderr  # the fork's roles ran as Flyte tasks


# -- (b) what `flyte deploy` would send ------------------------------------------------------------
def dry_run(cluster_config: Path | None = None) -> dict:
    extra = {"AREAL_CLUSTER_CONFIG": str(cluster_config)} if cluster_config else {}
    out = run_py("-m", "flyte2.dryrun", **extra)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def k8s(quantities: dict[str, str]) -> dict[str, str]:
    names = {"cpu": "cpu", "mem": "memory", "ephemeral_storage": "ephemeral_storage"}
    return {names[k]: str(v) for k, v in quantities.items()}


@needs_venv
def test_deployable_definitions_come_from_the_cluster_config_and_the_image_specs():
    from areal_core.config.cluster import load_cluster_config
    from jobs.catalog import NIGHTLY_CRON
    from tasks.resources import SECRETS

    got = dry_run()
    tasks, cluster = got["tasks"], yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text())
    pods = {
        "areal_rollout.rollout_worker": "rollout",
        "areal_reward.reward_worker": "reward",
        "areal_trainer.trainer": "trainer",
        "areal_single.sft": "single",
        "areal_single.evaluate": "single",
        "areal_prepare.prepare_cluster": "prepare",
        "areal_small.start_run": "small",
        "areal_small.register": "small",
    }
    for name, pod in pods.items():
        t, want = tasks[name], cluster[pod]
        assert t["requests"] == k8s(want["requests"]) and t["limits"] == k8s(want["limits"]), name
        assert t["retries"] == want["retries"] and t["timeout_s"] == want.get("timeout_s", 0), name
    driver = tasks["areal_driver.grpo_cluster"]  # the jobs run on the small pod, never retried whole
    assert driver["requests"] == k8s(cluster["small"]["requests"]) and driver["retries"] == 0
    for pool in ("rollout", "reward"):
        t = tasks[f"areal_{pool}.{pool}_worker"]
        replicas = cluster[pool]["replicas"]
        assert t["type"] == "actor" and t["interruptible"] is True
        assert t["reuse"]["replica_count"] == t["reuse"]["min_replica_count"] == replicas
        assert t["reuse"]["parallelism"] == 1 and t["reuse"]["ttl_seconds"] == 1800
    trainer, layout = tasks["areal_trainer.trainer"], cluster["trainer"]
    assert trainer["type"] == ("pytorch" if layout["nnodes"] > 1 else "python-task")
    elastic = trainer["plugin"]["elasticConfig"]
    assert elastic["minReplicas"] == elastic["maxReplicas"] == layout["nnodes"]
    assert elastic["nprocPerNode"] == layout["nproc_per_node"] and elastic["maxRestarts"] == layout["max_restarts"]
    assert trainer["plugin"]["workerReplicas"]["replicas"] == layout["nnodes"]
    assert trainer["shm"] == layout["shared_memory"] and trainer["interruptible"] is False
    assert tasks["areal_single.sft"]["cache"] == {"enabled": True, "ignored": ["run_uri"]}
    # every task: the image of the cluster's device, the cluster config in its environment, the secrets
    registered = load_cluster_config(ROOT / "configs" / "cluster.yaml").model_dump(mode="json")
    secrets = sorted([s.group, s.key, s.env_var] for s in SECRETS)
    for name, t in tasks.items():
        image = got["images"]["cpu" if t["env"] == "areal_one_machine" else cluster["device"]]["uri"]
        assert t["image"] == image, name
        assert t["secrets"] == secrets, name
        if t["env"] != "areal_one_machine":
            assert json.loads(t["env_vars"]["AREAL_CLUSTER_SPEC"]) == registered, name
            assert t["env_vars"]["AREAL_DEVICE"] == cluster["device"] and t["env_vars"]["AREAL_IMAGE"] == image
    # the triggers: the weekly one from the cluster config's schedule, the nightly one as the launch plan's
    triggers = {t["name"]: t for t in got["triggers"]}
    weekly, sched = triggers["grpo_cluster_weekly"], cluster["schedule"]
    assert weekly["task"] == "areal_driver.grpo_cluster" and weekly["cron"] == sched["cron"]
    assert weekly["kickoff_input"] == "kickoff_time"
    assert weekly["inputs"] == {
        "config": sched["config"],
        "overrides": sched["overrides"],
        "model_name": sched["model_name"],
        "resume_run": False,
    }
    failed = {"ACTION_PHASE_FAILED", "ACTION_PHASE_TIMED_OUT", "ACTION_PHASE_ABORTED"}
    assert [(set(n["phases"]), n["to"]) for n in weekly["notify"]] == [(failed, sched["notify"])]
    nightly = triggers["online_retrain_nightly"]
    assert nightly["task"] == "areal_driver.online_retrain" and nightly["cron"] == NIGHTLY_CRON
    assert nightly["kickoff_input"] == "kickoff_time"


@needs_venv
def test_the_images_are_the_image_specs_plus_the_flyte_sdk():
    """Each device's flyte.Image holds its ImageSpec's packages (in order), extra indexes, apt
    packages, commands, environment and base image, with the Flyte 2 SDK and plugin added."""
    from images.specs import image_for

    images = dry_run()["images"]
    for device, got in images.items():
        spec = image_for(device)
        assert got["packages"] == [*spec.packages, "flyte==2.12.1", "flyteplugins-pytorch==2.12.1"], device
        assert got["extra_index_urls"] == list(spec.pip_extra_index_url or []), device
        assert got["apt"] == list(spec.apt_packages or []) and got["commands"] == list(spec.commands or []), device
        assert got["env"] == spec.env and got["python"] == [3, 11], device
        assert got["base_image"] == (spec.base_image or "ghcr.io/flyteorg/flyte:py3.11-v2.12.1"), device
        name = spec.name.replace("areal-flyte-", "areal-flyte2-")
        assert got["uri"].startswith(f"{spec.registry}/{name}:"), device


@needs_venv
def test_another_cluster_config_changes_what_would_be_deployed(tmp_path):
    """The declarations follow $AREAL_CLUSTER_CONFIG, not values written in flyte2/: a cuda cluster
    with 3 rollout replicas and a one-pod trainer of 2 GPUs."""
    cluster = yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text())
    cluster["device"] = "cuda"
    cluster["rollout"] |= {"replicas": 3, "accelerators": 1, "retries": 5}
    cluster["trainer"] |= {"nnodes": 1, "nproc_per_node": 2, "accelerators": 2, "shared_memory": "8Gi"}
    cluster["trainer"]["accelerator_type"] = "nvidia-h100-80gb"
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    got = dry_run(path)
    rollout, trainer = got["tasks"]["areal_rollout.rollout_worker"], got["tasks"]["areal_trainer.trainer"]
    assert rollout["reuse"]["replica_count"] == 3 and rollout["retries"] == 5
    assert rollout["requests"]["gpu"] == "1" and trainer["requests"]["gpu"] == "2"
    assert trainer["type"] == "python-task"  # one pod running torchrun, not a PyTorchJob
    elastic = trainer["plugin"]["elasticConfig"]
    assert elastic["nprocPerNode"] == 2 and elastic["minReplicas"] == elastic["maxReplicas"] == 1
    assert trainer["shm"] == "8Gi" and trainer["accelerator"] == "nvidia-h100-80gb" and not rollout["accelerator"]
    assert rollout["image"] == got["images"]["cuda"]["uri"] and "areal-flyte2-cuda-" in rollout["image"]


# -- (c) a bad config is refused before any task runs ----------------------------------------------
@needs_venv
def test_a_bad_override_or_typed_config_is_refused_in_one_line_before_any_task(tmp_path):
    store = tmp_path / "r"
    for args, want in (
        (["--overrides", f"store={store} train.etaa=1"], "unknown config key 'train.etaa'"),
        (["--cfg", json.dumps({"store": str(store), "train": {"eta": -1}})], "config key 'train.eta' must be >= 0"),
    ):
        out = run_py("-m", "flyte2", "grpo", *args)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {want}"), out.stderr
        assert "run:" not in out.stdout  # no Flyte run was started
    # through the SDK's own command line: the job's first step refuses it, before any other task
    out = run_flyte("run", "--local", "flyte2/grpo.py", "grpo", "--overrides", f"store={store} train.etaa=1")
    both = out.stdout + out.stderr
    assert out.returncode != 0 and "unknown config key 'train.etaa'" in both, both[-3000:]
    assert not any(f"[{role}-0]" in both for role in ROLES)
    assert not store.exists()  # prepare, the first task, never ran


def test_areal_core_never_imports_the_flyte_sdk():
    """areal_core stays front-end free: neither flytekit (tests/test_architecture.py) nor Flyte 2."""
    import ast

    offenders = []
    for path in (ROOT / "areal_core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            top = {n.split(".")[0] for n in names}
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in top & {"flyte", "flyteplugins", "flyte2"}]
    assert offenders == []
