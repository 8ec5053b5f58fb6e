"""Container images. The registry comes from $AREAL_IMAGE_REGISTRY (default: localhost:30000,
the Flyte sandbox's). Local `pyflyte run` never builds them."""

from __future__ import annotations

import os

from flytekit import ImageSpec

REGISTRY = os.environ.get("AREAL_IMAGE_REGISTRY", "localhost:30000")

COMMON = [
    "transformers>=4.50",
    "pyarrow",
    "s3fs",
    "mlflow",
    "math-verify",
    "pyyaml",
    "flytekitplugins-kfpytorch",
]


def cpu_image() -> ImageSpec:
    return ImageSpec(
        name="areal-flyte-cpu",
        registry=REGISTRY,
        python_version="3.11",
        packages=["torch==2.13.0", *COMMON],
        pip_extra_index_url=["https://download.pytorch.org/whl/cpu"],
    )
