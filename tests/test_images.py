"""The container images provide what the code imports: every third-party top-level import under
areal_core/, tasks/, workflows/ and datasets/ (parsed with ast, function-local imports included)
is a distribution that each ImageSpec installs; the device-only ones are in the right images
only; the cuda image installs flash-attn in a layer of its own after torch."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

from images.specs import cpu_image, cuda_image, npu_image

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("areal_core", "tasks", "workflows", "datasets")
FIRST_PARTY = {p.name for p in ROOT.iterdir() if p.is_dir() and any(p.glob("*.py"))}

IMAGES = {
    "cpu": cpu_image("test"),
    "cuda": cuda_image("test", "vllm"),
    "cuda-sglang": cuda_image("test", "sglang"),
    "ascend": npu_image("test"),
}
CUDA = {"cuda", "cuda-sglang"}
# Modules only some images can have (GPU or NPU builds; not installed on the development
# machine): module -> (distribution, the images that must install it; the others must not).
DEVICE_ONLY = {
    "megatron": ("megatron-core", CUDA),
    "flash_attn": ("flash-attn", CUDA),
    "torch_npu": ("torch-npu", {"ascend"}),
    "vllm": ("vllm", {"cuda", "ascend"}),
    "sglang": ("sglang", {"cuda-sglang"}),
}


def normalize(dist: str) -> str:
    """PEP 503 name: lower case, runs of -, _ and . become one -."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def requirement_name(req: str) -> str:
    """The distribution of a requirement string: `sglang[all]==0.5.3` -> sglang."""
    return normalize(re.split(r"[\[<>=!~;@ ]", req.strip(), maxsplit=1)[0])


def command_installs(command: str) -> list[str]:
    """The distributions a `pip install ...` / `uv pip install ...` command line names."""
    out: list[str] = []
    for part in command.split("&&"):
        words = part.split()
        if "install" not in words:
            continue
        for word in words[words.index("install") + 1 :]:
            if not word.startswith("-") and "=" not in word.split("==")[0]:
                out.append(requirement_name(word))
    return out


def installed(spec) -> set[str]:
    """Every distribution the image installs: its packages, then what its build commands install."""
    names = {requirement_name(p) for p in spec.packages or []}
    for command in spec.commands or []:
        names.update(command_installs(command))
    return names


def third_party_imports() -> dict[str, set[str]]:
    """{top-level module: files importing it} for the scanned packages, stdlib and first party left out."""
    found: dict[str, set[str]] = {}
    for package in SCANNED:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_the_parsers():
    assert requirement_name("sglang[all]==0.5.3") == "sglang" and requirement_name("PyYAML") == "pyyaml"
    assert command_installs("VLLM_TARGET_DEVICE=empty pip install --no-binary vllm vllm==0.11.0") == ["vllm", "vllm"]
    assert command_installs("uv pip install --no-build-isolation flash-attn==2.8.3") == ["flash-attn"]
    assert "torch" in third_party_imports() and "areal_core" not in third_party_imports()


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_every_third_party_import_is_installed_in_the_image(image):
    dists = importlib.metadata.packages_distributions()
    have = installed(IMAGES[image])
    missing = {}
    for module, files in sorted(third_party_imports().items()):
        if module in DEVICE_ONLY:
            continue
        assert module in dists, f"{module} (imported by {sorted(files)}) is neither installed here nor in DEVICE_ONLY"
        # a module some distributions share (mlflow: mlflow, mlflow-skinny) needs one of them
        if not {normalize(d) for d in dists[module]} & have:
            missing[module] = sorted(files)
    assert not missing, f"the {image} image lacks the distributions of {missing}"


@pytest.mark.parametrize("module", sorted(DEVICE_ONLY))
def test_device_only_packages_are_in_the_right_images_only(module):
    dist, images = DEVICE_ONLY[module]
    assert {name for name, spec in IMAGES.items() if dist in installed(spec)} == images


def test_device_only_imports_are_declared():
    dists = importlib.metadata.packages_distributions()
    undeclared = {m for m in third_party_imports() if m not in dists and m not in DEVICE_ONLY}
    assert not undeclared


@pytest.mark.parametrize("image", sorted(CUDA))
def test_flash_attn_is_built_in_its_own_layer_after_torch(image, tmp_path):
    from flytekit.image_spec.default_builder import create_docker_context

    spec = IMAGES[image]
    packages = {requirement_name(p) for p in spec.packages}
    assert "torch" in packages and "flash-attn" not in packages  # not in torch's install step
    assert not spec.pip_extra_args  # the main step keeps build isolation
    (flash,) = [c for c in spec.commands if "flash-attn" in command_installs(c)]
    assert "--no-build-isolation" in flash.split()  # it builds against the installed torch
    # the builder installs the packages in one RUN, then the commands in a later RUN
    create_docker_context(spec, tmp_path)
    dockerfile = (tmp_path / "Dockerfile").read_text()
    assert "torch==" in (tmp_path / "requirements_uv.txt").read_text()
    runs = [block for block in dockerfile.split("\nRUN ") if "uv pip install" in block]
    step = next(i for i, block in enumerate(runs) if "requirements_uv.txt" in block)
    layer = next(i for i, block in enumerate(runs) if "flash-attn" in block)
    assert layer > step


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_every_image_renders_a_dockerfile(image, tmp_path):
    from flytekit.image_spec.default_builder import create_docker_context

    create_docker_context(IMAGES[image], tmp_path)
    assert (tmp_path / "Dockerfile").exists()
