"""The Flyte 2 images: the flytekit front end's ImageSpecs (images/specs.py), translated layer by
layer into `flyte.Image`, plus the `flyte` SDK and its plugins. One source of pins: a package
added to images/specs.py is in both front ends' images.

    ImageSpec (images/specs.py)        flyte.Image
    base_image + python_version    ->  Image.from_base(base).clone(name, registry, python_version)
    (no base_image)                ->  Image.from_debian_base(python 3.11, flyte 2.12.1): the SDK's
                                       released base image, which already holds `flyte`
    apt_packages                   ->  .with_apt_packages(...)
    packages, pip_extra_index_url  ->  .with_pip_packages(*packages, *FLYTE2, extra_index_urls=...)
    commands (after the packages)  ->  .with_commands(...)
    env                            ->  .with_env_vars(...)

The image names are the flytekit ones with `areal-flyte2-` for `areal-flyte-`, so the two front
ends never push over each other's tags. Nothing here builds an image: `flyte deploy` (or
`flyte.build_images`) does, with Docker or the cluster's remote builder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import flyte

if TYPE_CHECKING:
    from flytekit import ImageSpec

# The SDK and plugins the Flyte 2 front end imports in a pod (flyte2/*.py): pinned as in
# scripts/setup_flyte2_venv.sh.
FLYTE_VERSION = "2.12.1"
FLYTE2 = [f"flyte=={FLYTE_VERSION}", f"flyteplugins-pytorch=={FLYTE_VERSION}"]
NAME_PREFIX = ("areal-flyte-", "areal-flyte2-")


def _python(version: str | None) -> tuple[int, int]:
    major, minor = (version or "3.11").split(".")[:2]
    return int(major), int(minor)


def from_image_spec(spec: ImageSpec) -> flyte.Image:
    """`spec` (a flytekit ImageSpec of images/specs.py) as a `flyte.Image` with the Flyte 2 SDK added."""
    name = spec.name.replace(*NAME_PREFIX, 1)
    python = _python(spec.python_version)
    if spec.base_image:
        image = flyte.Image.from_base(spec.base_image).clone(
            name=name, registry=spec.registry, python_version=python, extendable=True
        )
    else:
        image = flyte.Image.from_debian_base(
            python_version=python, flyte_version=FLYTE_VERSION, registry=spec.registry, name=name
        )
    if spec.apt_packages:
        image = image.with_apt_packages(*spec.apt_packages)
    image = image.with_pip_packages(*spec.packages, *FLYTE2, extra_index_urls=spec.pip_extra_index_url or None)
    if spec.commands:
        image = image.with_commands(list(spec.commands))
    if spec.env:
        image = image.with_env_vars(dict(spec.env))
    return image


def image_for(device: str, registry: str | None = None) -> flyte.Image:
    """The Flyte 2 image of `device` (cpu | cuda | npu), from images/specs.py's spec of that device."""
    from images.specs import image_for as spec_for

    return from_image_spec(spec_for(device, registry))
