"""Loading a Hugging Face checkpoint folder (a user's `model.path`, the run's init_model/, a staged
version) without running anything the folder holds.

transformers can run Python that a folder ships: config.json's or tokenizer_config.json's
`auto_map` names a module of the folder, which AutoConfig, AutoTokenizer and AutoModel* import
when `trust_remote_code` is true; left unset, they ask on a terminal, and a "y" on stdin runs it.
Every load here passes `trust_remote_code=False`, so:

    a model type transformers implements, with an `auto_map` (older Phi-3 hub folders, say):
        transformers' own classes load it; the folder's .py is never imported
    a model type only the folder's code implements: CheckpointNeedsCode, one error naming the folder

AutoTokenizer (and AutoImageProcessor) also instantiate whatever class of the `transformers`
namespace `tokenizer_class` (`image_processor_type`) names: `AutoModelForCausalLM` there loads a
whole model as "the tokenizer". A name that resolves to a class that is not a tokenizer (image
processor) is refused before loading. Weights: safetensors where the folder has it; a pickle
`pytorch_model.bin` goes through `torch.load(weights_only=True)` (transformers' default, passed
explicitly so a changed default cannot reach it). Chat templates are rendered by transformers in
jinja2's ImmutableSandboxedEnvironment (no attribute starting with `_`, ranges capped).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from areal_core.layout import LAYOUT

NO_CODE: dict[str, Any] = {"trust_remote_code": False}
MAX_CONFIG_BYTES = 16 * 1024**2  # a config or tokenizer_config.json (a chat template included) is KBs


class CheckpointNeedsCode(ValueError):
    """The checkpoint needs Python code of its own, or names a class that is not what it loads."""


@contextmanager
def refusing_code(folder: str | Path) -> Iterator[None]:
    """transformers' refusal to run a folder's code (its ValueError) as one CheckpointNeedsCode."""
    try:
        yield
    except ValueError as exc:
        if "trust_remote_code" not in str(exc):
            raise
        raise CheckpointNeedsCode(
            f"{folder}: the checkpoint needs Python code of its own (`auto_map` in config.json or "
            "tokenizer_config.json); nothing in a model folder runs as code (trust_remote_code=False): "
            "use a checkpoint whose model type transformers implements"
        ) from None


def _json_field(folder: str | Path, name: str, key: str) -> Any:
    """`key` of the JSON file `name` in `folder` (None when the file or key is absent); the file is
    size-checked before it is read."""
    path = Path(folder) / name
    if not path.is_file():
        return None
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise CheckpointNeedsCode(f"{path}: {path.stat().st_size} bytes, over the {MAX_CONFIG_BYTES} of a config")
    data = json.loads(path.read_bytes())
    return data.get(key) if isinstance(data, dict) else None


def _is_a(found: Any, base: type) -> bool:
    """`found` is a subclass of `base`, or transformers' placeholder for one whose package is missing."""
    return isinstance(found, type) and (issubclass(found, base) or type(found).__name__ == "DummyObject")


def check_named_class(
    folder: str | Path, files: tuple[str, ...], key: str, resolve: Callable[[str], Any], base: type
) -> None:
    """The class named by `key` in each of `files` is a `base` (or names nothing transformers has);
    CheckpointNeedsCode naming the file and the class otherwise."""
    for name in files:
        value = _json_field(folder, name, key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise CheckpointNeedsCode(f"{Path(folder) / name}: {key} must be a class name, got {type(value).__name__}")
        found = resolve(value)
        if found is not None and not _is_a(found, base):
            raise CheckpointNeedsCode(
                f"{Path(folder) / name}: {key} {value!r} is not a {base.__name__} class; refused before loading"
            )


def check_tokenizer_class(folder: str | Path) -> None:
    """tokenizer_config.json's (or config.json's) `tokenizer_class` names a tokenizer class."""
    from transformers import PreTrainedTokenizerBase
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    files = ("tokenizer_config.json", LAYOUT.hf_config)
    check_named_class(folder, files, "tokenizer_class", tokenizer_class_from_name, PreTrainedTokenizerBase)


def load_tokenizer(folder: str | Path, **kw: Any) -> Any:
    """AutoTokenizer of a local folder: its tokenizer class checked, no code of the folder run."""
    from transformers import AutoTokenizer

    check_tokenizer_class(folder)
    with refusing_code(folder):
        return AutoTokenizer.from_pretrained(folder, **NO_CODE, **kw)


def load_config(folder: str | Path, **kw: Any) -> Any:
    """AutoConfig of a local folder, no code of the folder run."""
    from transformers import AutoConfig

    with refusing_code(folder):
        return AutoConfig.from_pretrained(folder, **NO_CODE, **kw)


def load_model(auto_class: Any, folder: str | Path, **kw: Any) -> Any:
    """`auto_class.from_pretrained(folder)` (AutoModelForCausalLM, AutoModelForImageTextToText):
    no code of the folder run, a pickle weights file loaded weights-only."""
    with refusing_code(folder):
        return auto_class.from_pretrained(folder, **NO_CODE, weights_only=True, **kw)


def load_image_processor(folder: str | Path, **kw: Any) -> Any:
    """AutoImageProcessor of a local folder: its class checked, no code of the folder run."""
    from transformers import AutoImageProcessor
    from transformers.image_processing_base import ImageProcessingMixin
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    files = ("preprocessor_config.json",)
    check_named_class(folder, files, "image_processor_type", get_image_processor_class_from_name, ImageProcessingMixin)
    with refusing_code(folder):
        return AutoImageProcessor.from_pretrained(folder, **NO_CODE, **kw)
