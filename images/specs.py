"""Container images, one per device: cpu, cuda, npu (Ascend). Local `pyflyte run` never builds them;
`pyflyte run --remote` / `pyflyte register` build and push them (ImageSpec) before registering.

Environment (read when an image is made, i.e. when a task is serialized for registration; never
at import):
  AREAL_IMAGE_REGISTRY     registry to push to (default: localhost:30000, the Flyte sandbox's)
  AREAL_CUDA_ENGINE        inference engine baked into the cuda image: vllm (default) or sglang
  AREAL_CUDA_BASE_IMAGE    the CUDA base image of the cuda image (its toolkit is there in case
                           flash-attn has no prebuilt wheel for the torch/CUDA/Python in use)
  AREAL_CANN_BASE_IMAGE    the prebuilt Ascend CANN base image the npu image starts from
  AREAL_CANN_PYTHON        the python interpreter inside that base image

The version pins are not verified here (no GPU, NPU or Docker on the development machine):
treat them as a starting point and check them against each engine's release notes.
The cuda image pins torch to the version its inference engine was built against; megatron-core
is installed with it, flash-attn in a separate layer after it (`commands`, which the builder runs
once the packages are installed): flash-attn's build imports torch, so it cannot be in torch's
own install step; without build isolation it finds the installed torch and fetches the prebuilt
wheel that matches it. Every image lists every distribution the code imports directly
(tests/test_images.py checks it against the imports). The
npu image starts from a CANN base that already holds the Ascend driver user space, toolkit and
kernels; torch-npu must match its torch exactly, vllm-ascend must match vllm.
"""

from __future__ import annotations

import os

from flytekit import ImageSpec

from areal_core.config.device import DEVICES

DEFAULT_REGISTRY = "localhost:30000"
CUDA_ENGINES = ("vllm", "sglang")

COMMON = [
    "flytekit>=1.14",
    "flytekitplugins-kfpytorch",
    "kubernetes",  # pod templates (tasks/resources.py)
    "transformers>=4.50",
    "tokenizers>=0.20",
    "safetensors>=0.4",
    "numpy",
    "pyarrow",
    "fsspec",
    "s3fs",
    "mlflow",
    "psutil",  # MLflow system metrics
    "boto3",
    "psycopg2-binary",  # MLflow server mode with a Postgres backend
    "math-verify",
    "pyyaml",
    "pydantic>=2.6",
    "matplotlib",  # the run report (areal_core/report/plots.py)
    "jinja2",  # chat templates rendered by the tokenizer (proxy/templating.py)
    "gguf>=0.10",  # `model.path: pretrained:smollm2` (areal_core/pretrained.py)
    "peft>=0.13",  # LoRA (train/lora.py)
    "zstandard>=0.22",  # delta weight publication (weights/delta.py)
    "numba>=0.68",  # the delta codec's fused CPU kernels (weights/delta_words.py)
    # the proxy and the remote engines' clients, and the agent examples
    "fastapi>=0.110",
    "starlette",
    "uvicorn>=0.29",
    "h11",
    "httpx>=0.27",
    "openai>=1.30",
    "langchain-core>=1.0",
    "langchain-openai>=1.0",
    "mcp>=2.3,<3",  # agent.mcp_servers (areal_core/agents/mcp.py)
    "mcp-types>=2.3,<3",  # imported directly by areal_core/agents/mcp.py (a dependency of mcp)
    "pillow>=10",  # model.kind vlm: images in the store (areal_core/vlm/)
    "reasoning-gym==0.1.25",  # task.name reasoning_gym (task_data/reasoning_gym.py)
    "websockets>=15",  # rollout.environment openenv:<url> (areal_core/environments/openenv_env.py)
]

# Versions that are known to go together (each engine release pins its torch).
CUDA_VERSION = "12.8"
CUDA_STACK = {
    # 0.32: the rollout client needs /inference/v1/generate with weight_versions, /pause?mode=keep
    # and /update_weight_version (docs/vllm.md); vllm 0.32 is built against torch 2.13.
    "vllm": ["torch==2.13.0", "vllm==0.32.0"],
    "sglang": ["torch==2.8.0", "sglang[all]==0.5.3"],
}
CUDA_TRAINING = ["megatron-core>=0.13"]
CUDA_BASE = f"nvidia/cuda:{CUDA_VERSION}.1-cudnn-devel-ubuntu22.04"
# a layer of its own, after torch is installed (see the module docstring)
FLASH_ATTN_COMMANDS = [
    "uv pip install setuptools wheel packaging ninja",  # what flash-attn's setup.py imports
    "uv pip install --no-build-isolation flash-attn==2.8.3",
]

# vllm-ascend 0.11.0 goes with torch/torch-npu 2.7.1 and CANN >= 8.3.RC1. vLLM itself is built
# without CUDA kernels (VLLM_TARGET_DEVICE=empty) before vllm-ascend is installed on top.
NPU_STACK = ["torch==2.7.1", "torch-npu==2.7.1"]
NPU_COMMANDS = [
    "VLLM_TARGET_DEVICE=empty pip install --no-binary vllm vllm==0.11.0",
    "pip install vllm-ascend==0.11.0",
]
CANN_BASE = "quay.io/ascend/cann:8.3.rc2-910b-ubuntu22.04-py3.11"
CANN_PYTHON = "/usr/local/python3.11/bin/python3"


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def cpu_image(registry: str | None = None) -> ImageSpec:
    return ImageSpec(
        name="areal-flyte-cpu",
        registry=registry or _env("AREAL_IMAGE_REGISTRY", DEFAULT_REGISTRY),
        python_version="3.11",
        packages=["torch==2.13.0", *COMMON],
        pip_extra_index_url=["https://download.pytorch.org/whl/cpu"],
        env={"AREAL_DEVICE": "cpu"},
    )


def cuda_image(registry: str | None = None, engine: str | None = None) -> ImageSpec:
    engine = engine or _env("AREAL_CUDA_ENGINE", "vllm")
    if engine not in CUDA_ENGINES:
        raise ValueError(f"AREAL_CUDA_ENGINE must be one of {CUDA_ENGINES}, got {engine!r}")
    return ImageSpec(
        name=f"areal-flyte-cuda-{engine}",
        registry=registry or _env("AREAL_IMAGE_REGISTRY", DEFAULT_REGISTRY),
        base_image=_env("AREAL_CUDA_BASE_IMAGE", CUDA_BASE),
        python_version="3.11",
        apt_packages=["git", "build-essential"],
        packages=[*CUDA_STACK[engine], *CUDA_TRAINING, *COMMON],
        commands=FLASH_ATTN_COMMANDS,
        env={"AREAL_DEVICE": "cuda", "NCCL_DEBUG": "WARN"},
    )


def npu_image(registry: str | None = None) -> ImageSpec:
    return ImageSpec(
        name="areal-flyte-ascend",
        registry=registry or _env("AREAL_IMAGE_REGISTRY", DEFAULT_REGISTRY),
        base_image=_env("AREAL_CANN_BASE_IMAGE", CANN_BASE),
        python_exec=_env("AREAL_CANN_PYTHON", CANN_PYTHON),
        packages=[*NPU_STACK, *COMMON],
        pip_extra_index_url=["https://download.pytorch.org/whl/cpu"],
        commands=NPU_COMMANDS,
        env={
            "AREAL_DEVICE": "npu",
            # the CANN base sets up LD_LIBRARY_PATH through this script; torch-npu needs it
            "ASCEND_TOOLKIT_HOME": "/usr/local/Ascend/ascend-toolkit/latest",
            "HCCL_CONNECT_TIMEOUT": "1200",
        },
    )


def image_for(device: str, registry: str | None = None) -> ImageSpec:
    """The image a task runs in on `device` (cpu | cuda | npu; `ascend` is accepted for npu)."""
    device = "npu" if device == "ascend" else device
    if device == "cpu":
        return cpu_image(registry)
    if device == "cuda":
        return cuda_image(registry)
    if device == "npu":
        return npu_image(registry)
    raise ValueError(f"unknown device {device!r}; expected one of {DEVICES}")
