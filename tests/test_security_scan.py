"""Issue 54: a new unsafe load fails CI. The shipped source (not tests/, not benchmarks/) is parsed
and every call that can turn bytes into code or unbounded objects is flagged unless it carries
its guard: torch.load with weights_only=True, no pickle/marshal/dill/joblib/shelve loads, yaml
loads with a safe loader only, numpy loads without allow_pickle=True, archive extraction with a
filter (or in a function that checks every member first). docs/security.md lists the sites."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("areal_core", "task_data", "tasks", "workflows", "flyte2", "scripts")
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BoundedLoader"}  # BoundedLoader: config/base.py, a SafeLoader
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
PICKLE_CALLS = {"load", "loads", "open", "Unpickler"}
# extractall in these functions runs after every member was checked (name, link, size): file -> function
CHECKED_EXTRACTS = {("areal_core/pretrained.py", "extract_wheel")}


def _dotted(node: ast.AST) -> str:
    """`a.b.c` for an attribute chain of names; '' otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_call(call: ast.Call, function: str, rel: str) -> str | None:
    """Why `call` (inside `function` of file `rel`) is an unsafe load; None when it is not one."""
    name = _dotted(call.func)
    head, _, last = name.rpartition(".")
    if name == "torch.load" and not _is_true(_keyword(call, "weights_only")):
        return "torch.load without weights_only=True"
    if head.split(".")[-1] in PICKLE_MODULES and last in PICKLE_CALLS:
        return f"{name}: a pickle runs code"
    if name in ("yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all", "yaml.full_load_all"):
        return f"{name}: builds any Python object"
    if name in ("yaml.load", "yaml.load_all"):
        loader = _keyword(call, "Loader") or (call.args[1] if len(call.args) > 1 else None)
        if loader is None or _dotted(loader).rpartition(".")[2] not in SAFE_YAML_LOADERS:
            return f"{name} without a safe Loader"
    if name in ("np.load", "numpy.load") and _is_true(_keyword(call, "allow_pickle")):
        return f"{name} with allow_pickle=True"
    method = call.func.attr if isinstance(call.func, ast.Attribute) else name
    if method in ("extractall", "unpack_archive") and _keyword(call, "filter") is None:
        if (rel, function) not in CHECKED_EXTRACTS:
            return f"{method}() without a filter (tarfile: filter='data'; zip: check members first)"
    return None


def scan_source(text: str, rel: str) -> list[str]:
    """'rel:line: why' for every unsafe load in the Python source `text`."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.Call) and (why := unsafe_call(child, function, rel)):
                found.append(f"{rel}:{child.lineno}: {why}")
            visit(child, inner)

    visit(ast.parse(text), "")
    return found


def shipped_sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_the_shipped_source_has_no_unsafe_load():
    files = shipped_sources()
    assert len(files) > 100  # the scan sees the tree
    found = [hit for p in files for hit in scan_source(p.read_text(), p.relative_to(ROOT).as_posix())]
    assert found == [], "unsafe loads (docs/security.md says how each kind is guarded):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source, why",
    [
        ("import torch\ntorch.load(f)", "weights_only=True"),
        ("import torch\ntorch.load(f, weights_only=False)", "weights_only=True"),
        ("import pickle\npickle.loads(b)", "a pickle runs code"),
        ("import pickle\npickle.Unpickler(f).load()", "a pickle runs code"),
        ("import joblib\njoblib.load(p)", "a pickle runs code"),
        ("import yaml\nyaml.load(t)", "without a safe Loader"),
        ("import yaml\nyaml.load(t, Loader=yaml.Loader)", "without a safe Loader"),
        ("import yaml\nyaml.unsafe_load(t)", "any Python object"),
        ("import numpy as np\nnp.load(p, allow_pickle=True)", "allow_pickle"),
        ("import tarfile\ntarfile.open(p).extractall(d)", "without a filter"),
        ("import zipfile\ndef f():\n    zipfile.ZipFile(p).extractall(d)", "without a filter"),
    ],
)
def test_each_unsafe_form_is_flagged(source, why):
    (hit,) = scan_source(source, "areal_core/x.py")
    assert why in hit and hit.startswith("areal_core/x.py:")


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.load(f, weights_only=True)",
        "import yaml\nyaml.safe_load(t)",
        "import yaml\nyaml.load(t, Loader=yaml.SafeLoader)",
        "import numpy as np\nnp.load(p)",
        "import tarfile\ntarfile.open(p).extractall(d, filter='data')",
        "import json\njson.loads(t)",
    ],
)
def test_the_guarded_forms_pass(source):
    assert scan_source(source, "areal_core/x.py") == []


def test_a_checked_extract_passes_only_in_its_own_function():
    source = "def extract_wheel():\n    z.extractall(d)\ndef other():\n    z.extractall(d)\n"
    assert [h.split(":")[1] for h in scan_source(source, "areal_core/pretrained.py")] == ["4"]
