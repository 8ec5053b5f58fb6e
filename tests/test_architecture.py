"""The architecture as facts: layers import only downward, no import cycle, small files, and
docs that describe it (every layer in docs/architecture.md, no reference to a missing file).

The layer order is the table in docs/architecture.md ("Layers"; docs/design.md for the roles):
config at the bottom, then the store, the contracts, weights, the roles, the run layer and
online retraining. Every import counts, function-local ones included, so a lazy import cannot
hide a cycle.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "areal_core"

# module prefix -> rank; the longest matching prefix wins. A module may import its own rank
# (within its package) or lower ranks only.
LAYERS: dict[str, int] = {
    "areal_core.config": 0,
    "areal_core.store": 1,
    "areal_core.layout": 1,
    "areal_core.logs": 1,
    "areal_core.retry": 1,
    "areal_core.manifest": 1,
    "areal_core.procs": 1,
    "areal_core.protocol": 2,
    "areal_core.ipc_reader": 2,
    "areal_core.staleness": 2,
    "areal_core.prompts": 2,
    "areal_core.models": 2,
    "areal_core.architecture": 2,  # beside models.py: what an HF decoder computes (windows, LoRA targets)
    "areal_core.context": 2,
    "areal_core.events": 2,
    "areal_core.pretrained": 2,
    "areal_core.hf_load": 2,  # beside models.py: an HF folder loaded without running its code
    "areal_core.vlm": 2,  # beside models.py: the VLM, images, multimodal inputs
    "areal_core.vlm_processor": 2,  # below models.py, which returns one for a VLM folder; vlm/ imports models.py
    "areal_core.shard_feed": 2,  # beside protocol.py: the shards of a layer, listed from a cursor
    "areal_core.writer_claim": 2,  # beside protocol.py: one live writer per shard writer id
    "areal_core.routes": 2,  # beside protocol.py: an MoE's routers and its recorded routes column
    "areal_core.weights": 3,
    "areal_core.forks": 3,
    "areal_core.dataset": 3,
    "areal_core.reward": 4,
    "areal_core.rollout": 5,
    "areal_core.proxy": 6,
    "areal_core.agents": 6,  # beside proxy/: MCP servers as agent environments, over its AgentWorkflow
    "areal_core.train": 7,
    "areal_core.megatron": 7,  # the Megatron backend: conversion, TP sharding, GPTModel, checks
    "areal_core.evaluate": 7,
    "areal_core.environments": 7,  # environments other frameworks wrote (verifiers, OpenEnv), run as agents over proxy/
    "areal_core.run": 8,
    "areal_core.sim": 8,
    "areal_core.online": 9,
    "areal_core.report": 8,  # beside run/, which builds the report at the end of a run
}
# Roles at one level do not import each other: a pair (importer package, imported package).
FORBIDDEN = {
    ("areal_core.rollout", "areal_core.train"),
    ("areal_core.rollout", "areal_core.proxy"),
    ("areal_core.train", "areal_core.rollout"),
    ("areal_core.train", "areal_core.proxy"),
    ("areal_core.reward", "areal_core.rollout"),
    ("areal_core.reward", "areal_core.train"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every areal_core module `path` imports, resolved to the modules that exist."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t.startswith("areal_core") and t != "areal_core":
                out.add(t)
    out.discard(name)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def rank(name: str) -> int | None:
    best = None
    for prefix, r in LAYERS.items():
        if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, r)
    return None if best is None else best[1]


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_the_guard_sees_a_cycle_and_an_upward_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert rank("areal_core.train.step") == 7 and rank("areal_core.config.run") == 0


def test_no_import_cycle():
    assert find_cycle(graph()) is None


def test_every_module_has_a_layer():
    assert [m for m in modules() if m != "areal_core" and rank(m) is None] == []


def test_layers_import_only_downward():
    bad = []
    for name, deps in graph().items():
        r = rank(name)
        for dep in deps:
            if rank(dep) is not None and r is not None and rank(dep) > r:
                bad.append(f"{name} (layer {r}) imports {dep} (layer {rank(dep)})")
            for low, high in FORBIDDEN:
                if name.startswith(low) and dep.startswith(high):
                    bad.append(f"{name} imports {dep}: roles do not import each other")
    assert bad == []


MAX_LAYERS = 13  # issue 56: the modules and folders of areal_core/ stack at most this high


def unit(name: str) -> str:
    """The top-level module or folder of areal_core that `name` belongs to."""
    return ".".join(name.split(".")[:2])


def unit_graph(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """`g` between areal_core's top-level modules and folders (`models.py`, `vlm/`)."""
    out: dict[str, set[str]] = {}
    for name, deps in g.items():
        if name != "areal_core":
            out.setdefault(unit(name), set()).update(unit(d) for d in deps if unit(d) != unit(name))
    return out


def stacked_layers(g: dict[str, set[str]]) -> dict[str, int]:
    """Each node's layer in an acyclic graph: 1 for a node importing nothing, else one above the
    highest layer it imports. Every import then goes down, and max() is the number of layers."""
    layer: dict[str, int] = {}

    def of(n: str) -> int:
        if n not in layer:
            layer[n] = 1 + max((of(d) for d in g.get(n, ())), default=0)
        return layer[n]

    for n in g:
        of(n)
    return layer


def test_the_layer_count_follows_the_longest_import_chain():
    assert stacked_layers({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == {"a": 3, "b": 2, "c": 1}
    assert unit_graph({"areal_core.vlm.model": {"areal_core.models"}, "areal_core.models": set()}) == {
        "areal_core.vlm": {"areal_core.models"},
        "areal_core.models": set(),
    }


def test_modules_and_folders_import_no_cycle_and_stack_at_most_13_layers():
    """Between folders too: no folder imports a module that imports the folder back (the VLM
    processor sits beside models.py, below vlm/, since models.py returns one for a VLM folder)."""
    units = unit_graph(graph())
    assert find_cycle(units) is None
    layers = stacked_layers(units)
    assert max(layers.values()) <= MAX_LAYERS, sorted(layers.items(), key=lambda kv: kv[1])


def test_config_imports_nothing_from_the_runtime():
    deps = {d for n, ds in graph().items() if n.startswith("areal_core.config") for d in ds}
    assert {d for d in deps if not d.startswith("areal_core.config")} == set()


def test_core_never_imports_flytekit():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            offenders += [f"{path}: {n}" for n in names if n.split(".")[0].startswith("flytekit")]
    assert offenders == []


@pytest.mark.parametrize(
    "folder", ["areal_core", "tasks", "workflows", "flyte2", "images", "task_data", "benchmarks", "scripts"]
)
def test_no_source_file_over_500_lines(folder):
    big = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / folder).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert big == {}


# -- house rules (issue 56) ----------------------------------------------------------------------
SOURCE_FOLDERS = ["areal_core", "benchmarks", "tasks", "workflows", "flyte2", "jobs", "task_data", "scripts", "images"]
MAX_FUNCTION_LINES = 80
# 'path:function' -> why it may run longer (each entry must still need it: test_long_function_exceptions_are_current).
# None today: the last ones (train_step, the benchmarks' mains, vs_trl_side's trl_side) were split in issue 56.
LONG_FUNCTIONS: dict[str, str] = {}


def source_files(folders: list[str] = SOURCE_FOLDERS) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py") if "__pycache__" not in p.parts)


def long_functions(path: Path, text: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """'path:name' -> lines, for every function (methods and nested ones too) longer than `limit`."""
    rel = path.relative_to(ROOT).as_posix() if path.is_absolute() else path.as_posix()
    return {
        f"{rel}:{node.name}": n
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (n := node.end_lineno - node.lineno + 1) > limit  # type: ignore[operator]
    }


def test_the_length_guard_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    assert long_functions(Path("m.py"), f"def short():\n{body}\n") == {}  # 80 lines
    assert long_functions(Path("m.py"), f"def long():\n{body}\n    return 1\n") == {"m.py:long": 81}


def test_no_function_over_80_lines_but_the_recorded_exceptions():
    """Short functions: a reader does not scroll. The recorded exceptions say why (LONG_FUNCTIONS)."""
    found = {
        k: n for p in source_files(["areal_core", "benchmarks"]) for k, n in long_functions(p, p.read_text()).items()
    }
    assert {k: n for k, n in found.items() if k not in LONG_FUNCTIONS} == {}


def test_long_function_exceptions_are_current():
    found = {k for p in source_files(["areal_core", "benchmarks"]) for k in long_functions(p, p.read_text())}
    assert [k for k in LONG_FUNCTIONS if k not in found] == [], "drop the exceptions that no longer exceed"


def imported_names(text: str) -> list[tuple[str, str]]:
    """(module, name) for every `from module import name`, and (module, '') for `import module`."""
    out: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and not node.level:
            out += [(node.module or "", a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names]
    return out


def test_no_tests_imports_outside_tests():
    """Benchmarks and the package import no test module: what both need lives outside tests/
    (benchmarks/tiny_run.py, benchmarks/tiny_checkpoints.py, benchmarks/fault_kit.py)."""
    bad = [
        f"{p.relative_to(ROOT)}: {m or n}"
        for p in source_files()
        for m, n in imported_names(p.read_text())
        if m == "tests" or m.startswith("tests.")
    ]
    assert bad == []


OUR_PACKAGES = ("areal_core", "benchmarks", "tasks", "workflows", "flyte2", "jobs", "task_data")


def private_imports(text: str) -> list[str]:
    """`module._name` for every private name (`_x`, not `__x__`) imported from one of our modules,
    or reached as an attribute of one of our modules imported whole."""
    ours = [(m, n) for m, n in imported_names(text) if m.split(".")[0] in OUR_PACKAGES]
    bad = [f"{m}.{n}" for m, n in ours if n.startswith("_") and not n.endswith("__")]
    aliases: dict[str, str] = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in OUR_PACKAGES:
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name.split(".")[0] in OUR_PACKAGES})
    for node in ast.walk(ast.parse(text)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.endswith("__")
        ):
            bad.append(f"{aliases[node.value.id]}.{node.attr}")
    return bad


def test_the_private_name_guard_sees_one():
    text = "from areal_core.reward.sandbox import _parse_status, Limits\n"
    text += "import areal_core.train.packing as pk\npk._unpack\n"
    assert private_imports(text) == ["areal_core.reward.sandbox._parse_status", "areal_core.train.packing._unpack"]
    assert private_imports("import os\nos._exit(0)\nfrom areal_core import __version__\n") == []


def test_no_module_imports_another_modules_private_names():
    """No reaching across: a name two modules share is public (proxy.schemas.SamplingFields,
    sandbox.parse_status, packing.unpack). The tests may test private helpers; the code may not lean on them."""
    bad = [f"{p.relative_to(ROOT)}: {name}" for p in source_files() for name in private_imports(p.read_text())]
    assert bad == []


# -- the docs ------------------------------------------------------------------------------------
DOCS = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
# files of other projects the docs name (SGLang's server), not paths of this repository
EXTERNAL = {"http_server.py"}
SKIP_DIRS = {
    ".git",
    ".venv",
    ".venv-vllm",
    ".venv-trl",
    ".venv-megatron",
    ".venv-flyte2",
    ".venv-verifiers",
    "runs",
    "mlruns",
    "node_modules",
    "__pycache__",
}


def layer_rows(text: str) -> dict[int, str]:
    """The "Layers" table of docs/architecture.md: {layer: its modules cell}."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    return {int(m[1]): m[2] for m in re.finditer(r"^\|\s*(\d+)\s*\|([^|]*)\|", section, re.M)}


def layer_name(prefix: str) -> str:
    """'areal_core.weights' -> 'weights/' (a package), 'areal_core.store' -> 'store.py' (a module)."""
    name = prefix.removeprefix("areal_core.").replace(".", "/")
    return f"{name}/" if (PACKAGE / name).is_dir() else f"{name}.py"


def test_architecture_md_lists_every_layer_at_its_rank():
    rows = layer_rows((ROOT / "docs" / "architecture.md").read_text())
    missing = [f"{p} (layer {r})" for p, r in LAYERS.items() if f"`{layer_name(p)}`" not in rows.get(r, "")]
    assert missing == [], f"docs/architecture.md's Layers table lacks {missing}"


@functools.cache
def repo_files() -> tuple[set[str], set[str], set[str]]:
    """(every file path relative to ROOT, their base names, every folder name) outside build folders."""
    paths: set[str] = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        base = Path(folder).relative_to(ROOT)
        paths.update((base / f).as_posix() for f in files)
    folders = {part for rel in paths for part in rel.split("/")[:-1]}
    return paths, {rel.rsplit("/", 1)[-1] for rel in paths}, folders


def broken_references(doc: Path, text: str) -> list[str]:
    """The file references of a doc that name nothing in the repository: relative markdown links
    (to the doc's folder), and backticked paths. A backticked path counts when it starts with a
    top-level entry of the repository (`docs/cluster.md`, `configs/default.yaml`), is a module
    under areal_core/ (`run/prepare.py`, `layout.py:LAYOUT`), or is a bare `.py`/`.md` name;
    store paths (`weights/LATEST`), patterns (`v{N}`) and commands are not references."""
    paths, names, folders = repo_files()
    top = {rel.split("/", 1)[0] for rel in paths}
    subpackages = {p.name for p in PACKAGE.iterdir() if p.is_dir()}
    bad = []
    for m in re.finditer(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)|!\[[^\]\n]*\]\(([^)\s]+)\)", text):
        target = (m[1] or m[2]).split("#", 1)[0]
        if target and not re.match(r"[a-z][a-z0-9+.-]*:", target) and not (doc.parent / target).exists():
            bad.append(f"link {target}")
    for m in re.finditer(r"`([^`\n]+)`", text):
        ref = re.split(r"::|:(?=[A-Za-z_])", m[1].strip())[0].rstrip("/")
        if not re.fullmatch(r"[A-Za-z0-9_.\-/]+", ref) or ref in EXTERNAL:
            continue
        head = ref.split("/", 1)[0]
        if head in top:
            ok = ref in paths or any(p.startswith(ref + "/") for p in paths)
        elif head in subpackages and ref.endswith(".py"):
            ok = f"areal_core/{ref}" in paths or ref in paths
        elif "/" not in ref and ref.endswith((".py", ".md")):
            ok = ref in names
        elif "/" in ref and ref.endswith((".py", ".md")) and head in folders:
            ok = any(p.endswith("/" + ref) for p in paths)  # relative to a folder named beside it
        else:
            continue
        if not ok:
            bad.append(f"`{m[1]}`")
    return bad


def test_the_link_checker_sees_a_missing_file():
    doc = ROOT / "docs" / "architecture.md"
    text = "`DESIGN.md`, `areal_core/nope.py`, `run/nope.py:f`, [x](nope.md), `weights/LATEST`, `run/roles.py`"
    assert broken_references(doc, text) == ["link nope.md", "`DESIGN.md`", "`areal_core/nope.py`", "`run/nope.py:f`"]
    assert broken_references(doc, "[design](design.md) `docs/design.md` `layout.py:LAYOUT` `v{N}/`") == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_reference_only_files_in_the_repository(doc):
    assert broken_references(doc, doc.read_text()) == []
