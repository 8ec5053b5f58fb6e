"""The architecture as facts: layers import only downward, no import cycle, small files.

The layer order is DESIGN.md's shape of `areal_core/` (docs/architecture.md): config at the
bottom, then the store, the contracts, weights, the roles, the run layer and online retraining.
Every import counts, function-local ones included, so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
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
    "areal_core.procs": 1,
    "areal_core.protocol": 2,
    "areal_core.staleness": 2,
    "areal_core.prompts": 2,
    "areal_core.models": 2,
    "areal_core.context": 2,
    "areal_core.events": 2,
    "areal_core.pretrained": 2,
    "areal_core.weights": 3,
    "areal_core.forks": 3,
    "areal_core.dataset": 3,
    "areal_core.reward": 4,
    "areal_core.rollout": 5,
    "areal_core.proxy": 6,
    "areal_core.train": 7,
    "areal_core.megatron_backend": 7,
    "areal_core.evaluate": 7,
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


@pytest.mark.parametrize("folder", ["areal_core", "tasks", "workflows", "images", "datasets", "benchmarks", "scripts"])
def test_no_source_file_over_500_lines(folder):
    big = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / folder).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert big == {}
