"""What a Flyte cluster would receive (serialised offline) and a local `pyflyte run`."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections import OrderedDict
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY

PYFLYTE = str(Path(sys.executable).parent / "pyflyte")


def pyflyte(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "300"}  # rich wraps help and errors at the terminal width
    return subprocess.run([PYFLYTE, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def serialize(entity):
    from flytekit.configuration import Image, ImageConfig, SerializationSettings
    from flytekit.tools.translator import get_serializable

    settings = SerializationSettings(
        image_config=ImageConfig(default_image=Image(name="default", fqn="areal-flyte", tag="test")),
        project="areal",
        domain="development",
        version="test",
    )
    return get_serializable(OrderedDict(), settings, entity)


# -- nothing is decided at import --------------------------------------------------------------
# Flyte fixes images, resources and schedules at registration: tasks/, workflows/ and images/ read
# them when an entity is serialized or run (tasks/deferred.py), never while a module is imported.
IMPORT_TIME_PACKAGES = ("tasks", "workflows", "images")
_ENV_NAMES = {"environ", "getenv", "getenvb", "environb"}
# calls that read a config file, the environment's config or the cluster config
_READERS = {
    "open",
    "read_text",
    "read_bytes",
    "safe_load",
    "load_config",
    "load_cluster_config",
    "cluster_config_path",
    "read_yaml_file",
    "registered_cluster",
    "auto",  # flytekit's Config.auto() / PlatformConfig.auto()
}


def import_time_reads(source: str) -> list[str]:
    """What a module's import-time code (top-level statements, class bodies, decorators and
    default values; not function bodies) does to read the environment or a config file."""
    found: list[str] = []
    stack: list[ast.AST] = list(ast.parse(source).body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = node.args
            stack += [*getattr(node, "decorator_list", []), *args.defaults, *(d for d in args.kw_defaults if d)]
            continue
        if isinstance(node, ast.Attribute) and node.attr in _ENV_NAMES:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"line {node.lineno}: from os import {a.name}" for a in node.names if a.name in _ENV_NAMES]
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in _READERS or name in _ENV_NAMES:
                found.append(f"line {node.lineno}: {name}()")
        stack.extend(ast.iter_child_nodes(node))
    return found


def test_no_module_of_tasks_or_workflows_reads_the_environment_or_a_config_at_import():
    bad = {
        "X = os.environ.get('AREAL_X')": ["line 1: .environ"],
        "from os import getenv\nY = getenv('Y')": ["line 1: from os import getenv", "line 2: getenv()"],
        "@task(**task_kwargs(load_cluster_config().rollout))\ndef f():\n    pass": ["line 1: load_cluster_config()"],
        "def f(path=os.getenv('P')):\n    pass": ["line 1: .getenv"],
        "class C:\n    spec = yaml.safe_load(open('configs/cluster.yaml'))": ["safe_load()", "open()"],
        "if True:\n    SCHEDULE = Path('c.yaml').read_text()": ["line 2: read_text()"],
    }
    for source, want in bad.items():
        got = import_time_reads(source)
        assert all(any(w in g for g in got) for w in want), (source, got)
    fine = "def f():\n    return os.environ['A'], open('c.yaml').read()\n\n"
    fine += "class C:\n    def m(self):\n        os.getenv('B')"
    assert import_time_reads(fine) == []
    offenders = {}
    for package in IMPORT_TIME_PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            if reads := import_time_reads(path.read_text()):
                offenders[str(path.relative_to(ROOT))] = reads
    assert offenders == {}


def test_every_module_imports_without_the_cluster_config_and_serializing_reads_it():
    """In a fresh interpreter whose cluster config file does not exist and whose image settings
    are invalid (either would fail if read), every module of tasks/, workflows/ and images/ imports
    and opens no config file; serializing grpo_cluster then reads the config, and fails naming it."""
    script = (
        "import importlib, json, pathlib, sys\n"
        "opened = []\n"
        "sys.addaudithook(lambda e, a: opened.append(str(a[0])) if e == 'open' and isinstance(a[0], str) "
        "and a[0].endswith(('.yaml', '.yml')) else None)\n"
        f"for package in {IMPORT_TIME_PACKAGES!r}:\n"
        "    for p in sorted(pathlib.Path(package).glob('*.py')):\n"
        "        importlib.import_module(package if p.stem == '__init__' else f'{package}.{p.stem}')\n"
        "imported = list(opened)\n"
        "from tests.test_flyte import serialize\n"
        "from workflows.grpo import grpo_cluster\n"
        "try:\n"
        "    serialize(grpo_cluster); error = ''\n"
        "except Exception as exc:\n"
        "    error = str(exc)\n"
        "print('RESULT' + json.dumps({'imported': imported, 'error': error}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AREAL_", "PYTEST"))} | {
        "PYTHONPATH": str(ROOT),
        "AREAL_CLUSTER_CONFIG": "/nonexistent/cluster.yaml",
        "AREAL_IMAGE_REGISTRY": "Not A Registry!",
        "AREAL_CUDA_ENGINE": "no-such-engine",
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert got["imported"] == []
    assert "cluster config file '/nonexistent/cluster.yaml' does not exist" in got["error"]


def test_grpo_workflow_serializes_with_its_four_nodes():
    from flytekit.models.types import SimpleType

    from workflows.grpo import grpo

    wf = serialize(grpo)
    nodes = [n.id for n in wf.template.nodes]
    assert len(nodes) == 4
    inputs = wf.template.interface.inputs
    assert set(inputs) == {"cfg", "config", "overrides", "resume_run"}
    # the typed run config: a struct whose JSON schema (the console's form) is the pydantic model's
    assert inputs["cfg"].type.simple == SimpleType.STRUCT
    schema = inputs["cfg"].type.metadata
    assert schema["title"] == "RunConfig" and "TrainConfig" in schema["$defs"]
    eta = schema["$defs"]["TrainConfig"]["properties"]["eta"]
    assert eta["minimum"] == 0 and eta["description"].startswith("staleness bound")


def test_every_workflow_input_has_a_description():
    from workflows.grpo import grpo, grpo_cluster
    from workflows.online import online_retrain

    for wf in (grpo, grpo_cluster, online_retrain):
        inputs = serialize(wf).template.interface.inputs
        assert {k: v.description for k, v in inputs.items() if not v.description or v.description == k} == {}


def test_models_are_flyte_directories_and_the_sft_cache_ignores_the_run_root():
    from flytekit.models.core.types import BlobType

    from tasks.cluster import start_run
    from tasks.pipeline import evaluate, run_async_rl
    from tasks.roles import trainer

    multipart = BlobType.BlobDimensionality.MULTIPART
    outputs = serialize(run_async_rl).template.interface.outputs
    assert {k: v.type.blob.dimensionality for k, v in outputs.items()} == {
        "init_model": multipart,
        "final_model": multipart,
    }
    assert serialize(trainer).template.interface.outputs["o0"].type.blob.dimensionality == multipart
    assert serialize(start_run).template.interface.outputs["init_model"].type.blob.dimensionality == multipart
    ins = serialize(evaluate).template.interface.inputs
    assert ins["init_model"].type.blob.dimensionality == ins["final_model"].type.blob.dimensionality == multipart


def test_cluster_habits_interruptible_pools_secrets_and_a_failure_node():
    from tasks.cluster import prepare_cluster
    from tasks.roles import reward_worker, rollout_worker, trainer
    from workflows.grpo import grpo_cluster

    for task in (rollout_worker, reward_worker):
        assert serialize(task).template.metadata.interruptible is True
    assert not serialize(trainer).template.metadata.interruptible  # its restarts are torchrun's
    for task in (prepare_cluster, rollout_worker, trainer):
        secrets = serialize(task).template.security_context.secrets
        assert {(s.group, s.env_var) for s in secrets} == {
            ("areal-s3", "AWS_ACCESS_KEY_ID"),
            ("areal-s3", "AWS_SECRET_ACCESS_KEY"),
            ("areal-mlflow", "MLFLOW_TRACKING_TOKEN"),
        }
    failure = serialize(grpo_cluster).template.failure_node
    assert failure is not None and failure.task_node.reference_id.name == "tasks.cluster.mark_failed"


def test_config_layers_compose_yaml_then_typed_then_overrides():
    from areal_core.config import RunConfig, changed, load_config
    from areal_core.run.pipeline import parse_overrides

    typed = RunConfig.model_validate({"train": {"eta": 0, "steps": 800}, "sft": {"steps": 5}})
    assert changed(typed) == {"train": {"eta": 0, "steps": 800}, "sft": {"steps": 5}}
    cfg = load_config("configs/default.yaml", parse_overrides("sft.steps=7 store=runs/a,b"), typed)
    assert cfg.train.eta == 0  # typed over YAML
    assert cfg.sft.steps == 7  # overrides over typed
    assert cfg.store == "runs/a,b"  # a value with a comma is one value
    assert cfg.train.lr_schedule == "cosine"  # from the YAML, untouched by the typed defaults
    assert load_config("configs/default.yaml", [], RunConfig()) == load_config("configs/default.yaml")


def test_tasks_carry_cache_retries_and_resources():
    """Single-machine tasks keep what their decorators declare, in the cpu image; each role task
    is defined once and has its cluster pod (configs/cluster.yaml), whoever runs it."""
    import yaml

    from tasks.pipeline import evaluate, run_async_rl, sft
    from tasks.roles import reward_worker, rollout_worker, trainer

    sft_t = serialize(sft).template
    assert sft_t.metadata.discoverable and sft_t.metadata.discovery_version == "2"
    assert list(sft_t.metadata.cache_ignore_input_vars) == ["run_uri"]  # scheduled runs hit it
    assert sft_t.container.image.startswith("localhost:30000/areal-flyte-cpu:")
    assert serialize(run_async_rl).template.metadata.retries.retries == 2
    assert "AREAL_CLUSTER_SPEC" not in serialize(evaluate).template.container.env
    cluster = yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text())
    for role, task in (("rollout", rollout_worker), ("reward", reward_worker), ("trainer", trainer)):
        t = serialize(task).template
        assert t.metadata.retries.retries == cluster[role]["retries"]
        assert t.metadata.timeout.total_seconds() == cluster[role]["timeout_s"]
        requests = {r.name: r.value for r in t.container.resources.requests}
        assert sorted(requests.values()) == sorted(cluster[role]["requests"].values())


def test_sft_cache_hit_is_shared_across_run_roots_and_recomputed_when_gone(tmp_path):
    """The sft task (flytekit's local cache) keyed on sft_key alone: a second run root hits it
    and gets a copy; after the cached folder is deleted (`make clean`), the next run trains SFT
    again instead of failing on the missing folder."""
    from areal_core.layout import LAYOUT
    from areal_core.run import pipeline
    from areal_core.store import Store
    from tasks.pipeline import sft

    key = f"test-{uuid.uuid4().hex}"  # a fresh cache entry

    def prepared(name: str) -> str:
        return pipeline.prepare("", [*TINY, f"store={tmp_path / name}"])[0]

    first = prepared("a")
    cached = sft(run_uri=first, sft_key=key)
    assert cached == Store(first).url(LAYOUT.init_model)
    second = prepared("b")
    assert sft(run_uri=second, sft_key=key) == cached  # a hit: SFT did not run in b
    assert not Store(second).exists(LAYOUT.committed(LAYOUT.init_model))
    pipeline.ensure_init_model(Store(second), cached)  # what the next task does with a hit
    assert Store(second).exists(LAYOUT.committed(LAYOUT.init_model))
    shutil.rmtree(tmp_path / "a")  # make clean
    third = prepared("c")
    gone = sft(run_uri=third, sft_key=key)
    assert gone == cached  # still the (dangling) hit
    pipeline.ensure_init_model(Store(third), gone)
    assert Store(third).exists(LAYOUT.committed(LAYOUT.init_model))  # trained again
    assert (tmp_path / "c" / "init_model" / "model.safetensors").exists()


def test_failure_handler_marks_the_mlflow_run_failed(tmp_path, mlflow_server):
    """The failure node's task, called directly: it finds the run root from the workflow's inputs
    (as prepare_cluster does) and sets the run's MLflow run to FAILED."""
    import mlflow

    from areal_core.run import pipeline
    from areal_core.run.cluster import UNSCHEDULED, cluster_config, registered_cluster
    from areal_core.run.tracking import Tracker
    from areal_core.store import Store
    from tasks.cluster import mark_failed

    overrides = " ".join(
        [
            *[o for o in TINY if not o.startswith("tracking.")],
            f"store={tmp_path / 'run'}",
            f"tracking.uri={mlflow_server}",
        ]
    )
    cfg, full = cluster_config("", overrides, registered_cluster())
    run_uri, _ = pipeline.prepare("", full)
    tracker = Tracker.create(Store(run_uri), cfg)
    assert mlflow.MlflowClient(mlflow_server).get_run(tracker.run_id).info.status == "RUNNING"
    from areal_core.config import RunConfig

    mark_failed(
        cfg=RunConfig(),
        config="",
        overrides=overrides,
        resume_run=False,
        model_name="m",
        kickoff_time=UNSCHEDULED,
    )
    assert mlflow.MlflowClient(mlflow_server).get_run(tracker.run_id).info.status == "FAILED"


def test_pyflyte_help_describes_every_input_without_warnings():
    out = pyflyte("run", "workflows/grpo.py", "grpo", "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    text = " ".join(out.stdout.split())
    for phrase in ("the run config as JSON", "YAML config files", "dotted key=value overrides", "a flag: continue"):
        assert phrase in text
    assert "--resume_run/--no_resume_run" in text and "--resume_run," not in text
    assert "used more than once" not in out.stderr and "Warning" not in out.stderr, out.stderr[-2000:]


def test_pyflyte_run_rejects_a_bad_typed_config_in_one_line_before_any_task(tmp_path):
    cfg = {"store": str(tmp_path / "r"), "train": {"eta": -1}}
    out = pyflyte("run", "workflows/grpo.py", "grpo", "--cfg", json.dumps(cfg))
    assert out.returncode != 0
    both = out.stdout + out.stderr
    lines = [line for line in both.splitlines() if "train.eta" in line]
    assert len(lines) == 1 and "config key 'train.eta' must be >= 0, got -1" in lines[0], both[-2000:]
    assert "Running Execution" not in both and "Traceback" not in both
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_pyflyte_run_of_the_workflow_end_to_end(tmp_path):
    """`make run` with small overrides: typed config, YAML, overrides with a comma, no warnings."""
    store = tmp_path / "run,1"
    out = pyflyte(
        "run",
        "workflows/grpo.py",
        "grpo",
        "--cfg",
        json.dumps({"train": {"eta": 1}}),
        "--overrides",
        " ".join([*TINY, f"store={store}"]),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out greedy accuracy: before RL" in out.stdout + out.stderr
    assert (store / "DONE").exists()
    assert (store / "final_model" / "model.safetensors").exists()
    assert "eta: 1" in (store / "config.yaml").read_text()
    noise = [line for line in out.stderr.splitlines() if re.search(r"warn|deprecat", line, re.I)]
    assert noise == [] or all("cached SFT checkpoint" in line for line in noise), noise


@pytest.mark.slow
def test_pyflyte_run_rejects_a_bad_override_before_any_work(tmp_path):
    out = pyflyte("run", "workflows/grpo.py", "grpo", "--overrides", f"store={tmp_path}/r train.etaa=1")
    assert out.returncode != 0
    assert "unknown config key 'train.etaa'" in out.stdout + out.stderr
    assert not (tmp_path / "r").exists()


def test_readme_config_table_is_generated_from_the_descriptions():
    out = subprocess.run(
        [sys.executable, "scripts/config_table.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_task_of_the_cluster_workflows_requests_the_store_and_mlflow_secrets():
    """On a cluster the S3 and MLflow credentials come only from the secret requests: a task
    without them (register once had none) fails in its pod, reaching neither the store nor MLflow."""
    from flytekit.core.python_function_task import PythonFunctionTask

    import tasks.cluster
    import tasks.online
    import tasks.pipeline
    import tasks.register
    import tasks.roles

    found = {}
    for module in (tasks.cluster, tasks.pipeline, tasks.register, tasks.online, tasks.roles):
        for value in vars(module).values():
            if isinstance(value, PythonFunctionTask) and value.name.startswith(module.__name__ + "."):
                secrets = serialize(value).template.security_context.secrets
                found[value.name] = {(s.group, s.key, s.env_var) for s in secrets}
    assert "tasks.register.register" in found and len(found) >= 12
    want = {(s.group, s.key, s.env_var) for s in __import__("tasks.resources").resources.SECRETS}
    assert {name: got for name, got in found.items() if got != want} == {}


# every documented `pyflyte ... run --remote` command line (a line naming a workflow file or continued with `\`)
_REMOTE_RUN = re.compile(r"run --remote.*(workflows/|\\\\?$)")


def test_fast_registration_ships_the_code_and_configs_the_pods_need():
    """The images hold dependencies, not the code: pods get it by fast registration. pyflyte run
    --remote's default (`--copy auto`) ships only the modules imported at registration, which
    leaves out the roles' code and configs/*.yaml; so every documented command says `--copy all`,
    and `--copy all` ships them."""
    script = (
        "import json, workflows.grpo, workflows.online\n"
        "from flytekit.constants import CopyFileDetection as C\n"
        "from flytekit.tools.ignore import DockerIgnore, FlyteIgnore, GitIgnore, IgnoreGroup, StandardIgnore\n"
        "from flytekit.tools.script_mode import ls_files\n"
        "root = '.'; import os; root = os.getcwd()\n"
        "ignore = IgnoreGroup(root, [GitIgnore, DockerIgnore, StandardIgnore, FlyteIgnore])\n"
        "out = {k: [os.path.relpath(f, root) for f in ls_files(root, c, False, ignore)[0]]\n"
        "       for k, c in (('auto', C.LOADED_MODULES), ('all', C.ALL))}\n"
        "print('RESULT' + json.dumps(out))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")} | {"PYTHONPATH": str(ROOT)}
    for _ in range(3):  # flytekit's walk of the tree fails when a file under runs/ (another test's run) vanishes
        proc = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        if proc.returncode == 0 or "FileNotFoundError" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    shipped = {k: set(v) for k, v in json.loads(proc.stdout.split("RESULT", 1)[1]).items()}
    needed = {"configs/default.yaml", "configs/cluster.yaml", "areal_core/run/roles.py", "areal_core/train/trainer.py"}
    assert needed <= shipped["all"]
    assert not needed <= shipped["auto"]  # why the commands need --copy all
    assert not any(f.startswith((".venv", "runs/", "mlruns")) for f in shipped["all"])
    lines = [
        (p, line)
        for p in [
            ROOT / "README.md",
            ROOT / "flyte.yaml",
            *(ROOT / "docs").glob("*.md"),
            *ROOT.glob("[!t]*/*.py"),
            *ROOT.glob("tasks/*.py"),
        ]
        for line in p.read_text().splitlines()
        if _REMOTE_RUN.search(line.strip().rstrip('"'))
    ]
    assert len(lines) >= 5
    assert [(str(p.relative_to(ROOT)), line) for p, line in lines if "--copy all" not in line] == []


def test_a_role_that_fails_locally_marks_the_mlflow_run_failed(tmp_path, mlflow_server, monkeypatch):
    """`grpo` on one machine: when a role dies (here the trainer), run_async_rl raises and the
    run's MLflow run is FAILED, not left RUNNING."""
    import mlflow

    from areal_core.run import launcher, pipeline
    from areal_core.run.tracking import Tracker
    from areal_core.store import Store

    overrides = [o for o in TINY if not o.startswith("tracking.")]
    overrides += [f"store={tmp_path / 'run'}", "tracking.enabled=true", f"tracking.uri={mlflow_server}"]
    run_uri, _ = pipeline.prepare("", overrides)
    checkpoint = pipeline.sft(run_uri)

    def trainer_dies(*args, **kwargs):
        raise launcher.RoleFailed("role trainer-0 exited with code 1; stopping the run")

    monkeypatch.setattr(launcher, "launch", trainer_dies)
    with pytest.raises(launcher.RoleFailed, match="trainer-0"):
        pipeline.run_async_rl(run_uri, checkpoint)
    run_id = Tracker.attach(Store(run_uri)).run_id
    assert run_id and mlflow.MlflowClient(mlflow_server).get_run(run_id).info.status == "FAILED"
