"""The container images provide what the code imports: every third-party top-level import under
areal_core/, tasks/, workflows/ and task_data/ (parsed with ast, function-local imports included)
is a distribution that the build flytekit renders for each device's image (`image_for`, what the
cluster's tasks run in) installs; the device-only ones are in the right images only; the cuda
image installs flash-attn in a layer of its own after torch; the registry, engine and base images
come from the environment when an image is made, not at import."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

from areal_core.config.device import DEVICES
from images.specs import cuda_image, image_for

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("areal_core", "tasks", "workflows", "task_data")
FIRST_PARTY = {p.name for p in ROOT.iterdir() if p.is_dir() and any(p.glob("*.py"))}

# the image of each device, as the cluster's tasks get it, and the cuda image's other engine
IMAGES = {device: image_for(device, "test") for device in DEVICES} | {"cuda-sglang": cuda_image("test", "sglang")}
CUDA = {"cuda", "cuda-sglang"}
# Modules only some images can have (GPU or NPU builds; not installed on the development
# machine): module -> (distribution, the images that must install it; the others must not).
DEVICE_ONLY = {
    "megatron": ("megatron-core", CUDA),
    "flash_attn": ("flash-attn", CUDA),
    "torch_npu": ("torch-npu", {"npu"}),
    "vllm": ("vllm", {"cuda", "npu"}),
    "sglang": ("sglang", {"cuda-sglang"}),
}
# Modules imported only by scripts that a side venv's interpreter runs, never by the project's own
# processes: module -> those files (verifiers: scripts/setup_verifiers_venv.sh, docs/environments.md).
SIDE_VENV = {"verifiers": {"areal_core/environments/verifiers_runner.py"}}


def side_venv_only(module: str, files: set[str]) -> bool:
    return module in SIDE_VENV and files <= SIDE_VENV[module]


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


def render(spec, folder: Path) -> tuple[str, str]:
    """The build flytekit's default builder makes of `spec`: (Dockerfile, the requirements file
    its main install step reads)."""
    from flytekit.image_spec.default_builder import create_docker_context

    folder.mkdir(parents=True, exist_ok=True)
    create_docker_context(spec, folder)
    return (folder / "Dockerfile").read_text(), (folder / "requirements_uv.txt").read_text()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("images")
    return {name: render(spec, tmp / name) for name, spec in IMAGES.items()}


def installed(dockerfile: str, requirements: str) -> set[str]:
    """Every distribution a rendered build installs: its requirements file, then every `pip install`
    of its RUN steps."""
    names = {requirement_name(line) for line in requirements.splitlines() if line.strip() and line[0] != "#"}
    for block in dockerfile.split("\nRUN ")[1:]:
        names.update(command_installs(block.replace("\\\n", " ")))
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
def test_every_third_party_import_is_installed_in_the_image(image, rendered):
    dists = importlib.metadata.packages_distributions()
    have = installed(*rendered[image])
    missing = {}
    for module, files in sorted(third_party_imports().items()):
        if module in DEVICE_ONLY or side_venv_only(module, files):
            continue
        assert module in dists, f"{module} (imported by {sorted(files)}) is neither installed here nor in DEVICE_ONLY"
        # a module some distributions share (mlflow: mlflow, mlflow-skinny) needs one of them
        if not {normalize(d) for d in dists[module]} & have:
            missing[module] = sorted(files)
    assert not missing, f"the {image} image lacks the distributions of {missing}"


@pytest.mark.parametrize("module", sorted(DEVICE_ONLY))
def test_device_only_packages_are_in_the_right_images_only(module, rendered):
    dist, images = DEVICE_ONLY[module]
    assert {name for name in IMAGES if dist in installed(*rendered[name])} == images


def test_device_only_imports_are_declared():
    dists = importlib.metadata.packages_distributions()
    undeclared = {
        m for m, files in third_party_imports().items() if m not in dists | DEVICE_ONLY and not side_venv_only(m, files)
    }
    assert not undeclared


@pytest.mark.parametrize("image", sorted(CUDA))
def test_flash_attn_is_built_in_its_own_layer_after_torch(image, rendered):
    spec = IMAGES[image]
    packages = {requirement_name(p) for p in spec.packages}
    assert "torch" in packages and "flash-attn" not in packages  # not in torch's install step
    assert not spec.pip_extra_args  # the main step keeps build isolation
    (flash,) = [c for c in spec.commands if "flash-attn" in command_installs(c)]
    assert "--no-build-isolation" in flash.split()  # it builds against the installed torch
    # the builder installs the packages in one RUN, then the commands in a later RUN
    dockerfile, requirements = rendered[image]
    assert "torch==" in requirements
    runs = [block for block in dockerfile.split("\nRUN ") if "uv pip install" in block]
    step = next(i for i, block in enumerate(runs) if "requirements_uv.txt" in block)
    layer = next(i for i, block in enumerate(runs) if "flash-attn" in block)
    assert layer > step


def test_image_settings_are_read_when_an_image_is_made(monkeypatch):
    """Registry, engine and base images come from the environment when a task is serialized (the
    image is made then), so changing them after import changes the image; a bad engine is refused."""
    import images.specs

    monkeypatch.setenv("AREAL_IMAGE_REGISTRY", "registry.example.com/areal")
    monkeypatch.setenv("AREAL_CUDA_ENGINE", "sglang")
    monkeypatch.setenv("AREAL_CUDA_BASE_IMAGE", "nvidia/cuda:12.8.1-devel-ubuntu24.04")
    cuda = images.specs.image_for("cuda")
    assert cuda.image_name().startswith("registry.example.com/areal/areal-flyte-cuda-sglang:")
    assert cuda.base_image == "nvidia/cuda:12.8.1-devel-ubuntu24.04"
    assert "sglang" in {requirement_name(p) for p in cuda.packages}
    assert images.specs.image_for("ascend").name == images.specs.image_for("npu").name
    monkeypatch.setenv("AREAL_CUDA_ENGINE", "tensorrt")
    with pytest.raises(ValueError, match="AREAL_CUDA_ENGINE must be one of"):
        images.specs.image_for("cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        images.specs.image_for("tpu")
