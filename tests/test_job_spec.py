"""One job spec for both Flyte front ends (jobs/catalog.py; issue 56): flytekit's workflows
(workflows/, tasks/) and Flyte 2's tasks (flyte2/) expose each job's inputs with the spec's types,
defaults and docs, its outputs, its schedule and the SFT cache version; an input added to the spec
appears in both; the two front ends repeat no block of six lines; only the functions that say why
reach into an SDK's private modules.

The Flyte 2 side runs in its own venv (.venv-flyte2, tests/test_flyte2.py), as a subprocess; those
checks are skipped, saying why, where that venv is absent.
"""

from __future__ import annotations

import ast
import datetime
import importlib
import inspect
import io
import json
import keyword
import sys
import tokenize
from pathlib import Path
from typing import Any

import pytest

from jobs.catalog import JOBS, SFT_CACHE
from jobs.spec import REQUIRED, Job, Record
from tests.conftest import ROOT
from tests.test_flyte import pyflyte
from tests.test_flyte2 import flyte2_venv, needs_venv, run_flyte, run_py  # noqa: F401 - needs_venv's fixture

FLYTEKIT = {"grpo": "grpo", "grpo_cluster": "grpo", "online_retrain": "online", "online_continuous": "online"}
FLYTEKIT |= {"replay": "replay", "fork": "fork", "regrade": "regrade", "regrade_and_replay": "regrade"}
FLYTE2 = {"grpo": "grpo", "grpo_cluster": "grpo", "online_retrain": "online", "online_continuous": "online"}
FLYTE2 |= {"replay": "derived", "fork": "derived", "regrade": "derived", "regrade_and_replay": "derived"}


# -- what a job looks like, in either venv (sent to the Flyte 2 one as source) ---------------------
def plain(value: Any) -> Any:
    """A default as JSON: a pydantic model as its dump, a datetime as ISO text, none as '<required>'."""
    if value is inspect.Parameter.empty:
        return "<required>"
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    return value


def type_name(t: Any) -> str:
    return getattr(t, "__name__", str(t))


def output_view(outputs: dict[str, Any]) -> list[str]:
    """The output names: a record's fields (a NamedTuple's outputs, a dataclass's fields), else the type."""
    import dataclasses

    if len(outputs) == 1 and dataclasses.is_dataclass(only := next(iter(outputs.values()))):
        return [f.name for f in dataclasses.fields(only)]
    return list(outputs) if len(outputs) > 1 else [type_name(t) for t in outputs.values()]


def view(inputs: dict[str, tuple[Any, Any]], docs: dict[str, str], outputs: dict[str, Any]) -> dict[str, Any]:
    shown = {name: [type_name(t), plain(default), docs.get(name, "")] for name, (t, default) in inputs.items()}
    return {"inputs": shown, "outputs": output_view(outputs)}


def flyte2_views(jobs: list[str]) -> str:
    """A script for the Flyte 2 venv: each job's task as `view`, its triggers, the SFT cache's salt."""
    modules = {name: f"flyte2.{FLYTE2[name]}" for name in jobs}
    return "\n".join(
        [
            "import importlib, json, inspect, datetime",
            "from typing import Any",
            inspect.getsource(plain),
            inspect.getsource(type_name),
            inspect.getsource(output_view),
            inspect.getsource(view),
            "out = {}",
            f"for name, module in {modules!r}.items():",
            "    task = getattr(importlib.import_module(module), name)",
            "    i = task.native_interface",
            "    out[name] = view(i.inputs, i.docstring.input_descriptions, i.outputs)",
            "    out[name]['schedule'] = [t.name for t in task.triggers]",
            "from flyte2.steps import CACHE",
            "print('RESULT' + json.dumps({'jobs': out, 'salt': CACHE.salt}))",
        ]
    )


def spec_view(job: Job) -> dict[str, Any]:
    inputs = {i.name: (i.type, REQUIRED if i.default is REQUIRED else i.default) for i in job.inputs}
    output = job.output
    outputs = {name: t for name, t in output.fields} if isinstance(output, Record) else {"o0": output}
    return view(inputs, {i.name: i.doc for i in job.inputs}, outputs)


def flytekit_view(job: Job) -> dict[str, Any]:
    wf = getattr(importlib.import_module(f"workflows.{FLYTEKIT[job.name]}"), job.name)
    iface = wf.python_interface
    defaults = iface.default_inputs_as_kwargs
    inputs = {name: (t, defaults.get(name, REQUIRED)) for name, t in iface.inputs.items()}
    return view(inputs, iface.docstring.input_descriptions, iface.outputs)


def result(out: Any) -> Any:
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return json.loads(out.stdout.split("RESULT", 1)[1].splitlines()[0])


# -- (a) both front ends expose the spec -----------------------------------------------------------
def test_every_job_is_in_the_spec_and_each_flytekit_workflow_exposes_its_inputs_defaults_docs_and_outputs():
    assert set(JOBS) == set(FLYTEKIT) == set(FLYTE2)
    for job in JOBS.values():
        assert flytekit_view(job) == spec_view(job), job.name
        assert all(i.doc for i in job.inputs), job.name


def test_every_step_of_a_job_is_one_function_of_jobs_steps():
    """The roles (`train`) run as each front end can; every other step is one call in jobs/steps.py."""
    from jobs import steps

    named = {step for job in JOBS.values() for step in job.steps} - {"train"}
    assert named == {n for n, f in vars(steps).items() if inspect.isfunction(f) and f.__module__ == steps.__name__} - {
        "one_frame"
    }
    assert set(steps.RETRIES) <= named | {"train"} and SFT_CACHE.step in named


def test_flytekit_schedules_and_sft_cache_are_the_specs():
    from tasks.pipeline import sft
    from tests.test_flyte import serialize
    from workflows.grpo import grpo_cluster_weekly
    from workflows.online import online_retrain_nightly

    for lp, job in ((grpo_cluster_weekly, JOBS["grpo_cluster"]), (online_retrain_nightly, JOBS["online_retrain"])):
        plan = job.schedule.plan()
        assert lp.name == job.schedule.name and lp.schedule.cron_schedule.schedule == plan.cron
        assert lp.schedule.kickoff_time_input_arg == plan.kickoff_input
        assert {k: lp.saved_inputs[k] for k in plan.inputs} == plan.inputs
        assert list(lp.notifications[0].email.recipients_email) == list(plan.notify)
    meta = serialize(sft).template.metadata
    assert meta.discovery_version == SFT_CACHE.version and list(meta.cache_ignore_input_vars) == list(SFT_CACHE.ignored)


@needs_venv
def test_each_flyte2_task_exposes_the_same_inputs_defaults_docs_outputs_and_schedule():
    got = result(run_py("-c", flyte2_views(list(JOBS))))
    for name, job in JOBS.items():
        want = spec_view(job) | {"schedule": [job.schedule.name] if job.schedule else []}
        assert got["jobs"][name] == want, name
    assert got["salt"] == f"sft-{SFT_CACHE.version}"


def test_pyflyte_help_shows_each_input_with_its_default_and_doc():
    job = JOBS["grpo_cluster"]
    out = pyflyte("run", "workflows/grpo.py", job.name, "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    text = " ".join(out.stdout.split())
    for given in job.inputs:
        assert f"--{given.name}" in text and given.doc in text, given.name
    assert "default: areal-flyte-policy" in text and "default: configs/default.yaml" in text


@needs_venv
def test_flyte2_help_shows_each_input_with_its_default():
    job = JOBS["regrade"]
    out = run_flyte("run", "--local", "flyte2/derived.py", job.name, "--help", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = {line.split()[1 if line.split()[0] == "*" else 0]: line for line in _options(out.stdout)}
    for given in job.inputs:
        line = lines[f"--{given.name}"]
        shown = '""' if given.default == "" else given.default
        want = "[required]" if given.default is REQUIRED else f"[default: {shown}]"
        assert want in line, (given.name, line)


def _options(text: str) -> list[str]:
    return [line.strip("│ ").strip() for line in text.splitlines() if "--" in line and "│" in line]


# -- (b) an input added to the spec shows up in both -----------------------------------------------
ADD_INPUT = (
    "import dataclasses, json\n"
    "import jobs.catalog as catalog\n"
    "from jobs.spec import Input\n"
    "note = Input('note', int, 'a number the test added to the spec', 7)\n"
    "for name in ('GRPO', 'REGRADE_AND_REPLAY'):\n"
    "    job = getattr(catalog, name)\n"
    "    setattr(catalog, name, dataclasses.replace(job, inputs=(*job.inputs, note)))\n"
)


@pytest.mark.slow
def test_an_input_added_to_the_spec_shows_up_in_the_flytekit_workflows_and_pyflytes_help():
    script = ADD_INPUT + (
        "from workflows.grpo import grpo\n"
        "from workflows.regrade import regrade_and_replay\n"
        "from flytekit.clis.sdk_in_container.pyflyte import main\n"
        "views = {wf.name: [wf.python_interface.default_inputs_as_kwargs['note'],\n"
        "                   wf.python_interface.docstring.input_descriptions['note']]\n"
        "         for wf in (grpo, regrade_and_replay)}\n"
        "print('RESULT' + json.dumps(views))\n"
        "main(['run', 'workflows/grpo.py', 'grpo', '--help'])\n"
    )
    out = _run_here(script)
    got = result(out)
    assert got == {
        f"workflows.{m}.{n}": [7, "a number the test added to the spec"]
        for m, n in (("grpo", "grpo"), ("regrade", "regrade_and_replay"))
    }
    help_text = " ".join(out.stdout.split("RESULT", 1)[1].split())
    assert "--note" in help_text and "a number the test added to the spec" in help_text and "default: 7" in help_text


@needs_venv
@pytest.mark.slow
def test_an_input_added_to_the_spec_shows_up_in_the_flyte2_tasks():
    got = result(run_py("-c", ADD_INPUT + flyte2_views(["grpo", "regrade_and_replay"])))
    for name in ("grpo", "regrade_and_replay"):
        assert got["jobs"][name]["inputs"]["note"] == ["int", 7, "a number the test added to the spec"], name


def _run_here(script: str) -> Any:
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")} | {"PYTHONPATH": str(ROOT)}
    env["COLUMNS"] = "300"
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


# -- (c) nothing repeated between the front ends ---------------------------------------------------
WINDOW = 6  # lines
_SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def line_shapes(source: str) -> list[tuple[int, str]]:
    """Each code line's shape: names as x, strings as s, numbers as n, operators and keywords as written
    (so the same lines, or the same lines with other names, strings and numbers, have one shape)."""
    shapes: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in _SKIPPED:
            continue
        shape = tok.string
        if tok.type == tokenize.NAME and not keyword.iskeyword(tok.string):
            shape = "x"
        elif tok.type in (tokenize.STRING, tokenize.NUMBER):
            shape = "s" if tok.type == tokenize.STRING else "n"
        shapes.setdefault(tok.start[0], []).append(shape)
    return [(n, " ".join(s)) for n, s in sorted(shapes.items())]


def blocks(path: Path) -> dict[tuple[str, ...], str]:
    """Every run of WINDOW code lines (at least half of them more than a name or a bracket), by shape."""
    lines = line_shapes(path.read_text())
    out: dict[tuple[str, ...], str] = {}
    for i in range(len(lines) - WINDOW + 1):
        run = lines[i : i + WINDOW]
        if sum(len(shape.split()) > 3 for _, shape in run) >= WINDOW // 2:
            out.setdefault(tuple(shape for _, shape in run), f"{path.relative_to(ROOT)}:{run[0][0]}-{run[-1][0]}")
    return out


def repeated(left: list[Path], right: list[Path]) -> list[tuple[str, str]]:
    seen: dict[tuple[str, ...], str] = {}
    for path in left:
        seen |= {k: v for k, v in blocks(path).items() if k not in seen}
    return [(seen[k], where) for path in right for k, where in blocks(path).items() if k in seen]


def test_the_repetition_guard_sees_the_same_lines_and_the_same_shape_with_other_names(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    body = "def {f}({a}: str, {b}: int = 2) -> str:\n    '''{doc}'''\n    x = {a}.strip()\n"
    body += "    y = [x] * {b}\n    z = ', '.join(y)\n    return z + {s!r}\n"
    (tmp_path / "a.py").write_text(body.format(f="f", a="a", b="b", doc="one", s="!"))
    (tmp_path / "b.py").write_text("import os\n\n" + body.format(f="g", a="p", b="q", doc="two", s="?"))
    (tmp_path / "c.py").write_text(body.replace("[x] * ", "").format(f="h", a="a", b="b", doc="one", s="!"))
    assert repeated([tmp_path / "a.py"], [tmp_path / "b.py"]) == [("a.py:1-6", "b.py:3-8")]
    assert repeated([tmp_path / "a.py"], [tmp_path / "c.py"]) == []


def test_no_block_of_six_lines_is_repeated_between_flyte2_and_the_flytekit_front_end():
    flyte2 = sorted((ROOT / "flyte2").glob("*.py"))
    flytekit = sorted((ROOT / "workflows").glob("*.py")) + sorted((ROOT / "tasks").glob("*.py"))
    assert flyte2 and flytekit
    assert repeated(flyte2, flytekit) == []


def repeated_within(paths: list[Path]) -> list[list[str]]:
    """The places of every run of WINDOW code lines (as `blocks` counts them) that stands twice or more in `paths`."""
    places: dict[tuple[str, ...], list[str]] = {}
    for path in paths:
        lines = line_shapes(path.read_text())
        for i in range(len(lines) - WINDOW + 1):
            run = lines[i : i + WINDOW]
            if sum(len(shape.split()) > 3 for _, shape in run) >= WINDOW // 2:
                where = f"{path.relative_to(ROOT)}:{run[0][0]}-{run[-1][0]}"
                places.setdefault(tuple(shape for _, shape in run), []).append(where)
    return [where for where in places.values() if len(where) > 1]


def test_no_block_of_six_lines_is_repeated_within_flyte2():
    """One copy of each step sequence inside the Flyte 2 front end too (grpo's and fork's start_run -> roles ->
    evaluate, marked failed on error: flyte2/grpo.py roles_and_evaluate, failed_on_error)."""
    assert repeated_within(sorted((ROOT / "flyte2").glob("*.py"))) == []


# -- (d) SDK internals: only where a function says why ---------------------------------------------
# (file, function) -> the private SDK modules it may import; nothing else in the front ends imports one
PRIVATE_SDK_USES = {
    ("flyte2/dryrun.py", "wire_task"): {"flyte._internal.runtime.task_serde"},
    ("flyte2/dryrun.py", "wire_trigger"): {"flyte._internal.runtime.trigger_serde"},
    ("flyte2/dryrun.py", "image_layers"): {"flyte._image"},
}


def private_sdk_imports(source: str) -> dict[str, set[str]]:
    """{function (or '<module>'): the modules of flyte/flytekit with a `_private` part it imports}."""
    found: dict[str, set[str]] = {}

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else where
            if isinstance(child, ast.ImportFrom | ast.Import):
                names = [child.module or ""] if isinstance(child, ast.ImportFrom) else [a.name for a in child.names]
                for name in names:
                    parts = name.split(".")
                    if parts[0] in ("flyte", "flytekit") and any(p.startswith("_") for p in parts[1:]):
                        found.setdefault(where, set()).add(name)
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    return found


def test_only_the_named_functions_import_an_sdks_private_modules():
    got = {}
    for folder in ("flyte2", "workflows", "tasks", "jobs"):
        for path in sorted((ROOT / folder).glob("*.py")):
            for function, modules in private_sdk_imports(path.read_text()).items():
                got[(str(path.relative_to(ROOT)), function)] = modules
    assert got == PRIVATE_SDK_USES
    nested = "def f():\n    def g():\n        from flyte._x import y\n    import flytekit.core.a\nimport flyte.b._c\n"
    assert private_sdk_imports(nested) == {"g": {"flyte._x"}, "<module>": {"flyte.b._c"}}  # the scan sees them


def imported_top_packages(path: Path) -> set[str]:
    tops: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            tops.add((node.module or "").split(".")[0])
    return tops


def test_the_spec_imports_no_sdk_and_no_front_end_and_areal_core_never_imports_it():
    front = {"flytekit", "flytekitplugins", "flyte", "flyteplugins", "tasks", "workflows", "flyte2"}
    for path in sorted((ROOT / "jobs").glob("*.py")):
        assert imported_top_packages(path) & front == set(), path.name
    assert [p for p in (ROOT / "areal_core").rglob("*.py") if "jobs" in imported_top_packages(p)] == []
