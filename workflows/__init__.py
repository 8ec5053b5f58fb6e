"""What `pyflyte run` submits (grpo.py, online.py).

Importing this package adjusts how pyflyte turns workflow inputs into command-line options
(flytekit 1.16, click >= 8.2), so that `pyflyte run workflows/grpo.py grpo ...` is clean:

- A bool input becomes a flag (`--resume_run`, `--no_resume_run`). flytekit declares
  `--resume_run` twice (in `--resume_run/--no_resume_run` and `--resume_run/--no-resume-run`),
  which click reports on every run as "The parameter --resume_run is used more than once";
  the duplicate names are dropped here.
- A run-config input (a pydantic ConfigModel, e.g. `--cfg '{"train": {"eta": 0}}'`) that does
  not validate is a one-line usage error naming the key (`config key 'train.eta' must be >= 0,
  got -1`), raised while pyflyte parses its options, before any task starts; its help is its
  description, not the whole JSON schema (the schema stays in the interface, where the console
  renders it as a form).
"""

from __future__ import annotations

from typing import Any

from flytekit.clis.sdk_in_container import run as _pyflyte_run
from pydantic import ValidationError

from areal_core.config.base import ConfigModel, one_line


def _one_line_errors(param_type: Any, model: type[ConfigModel]) -> None:
    """Make the click type of a config input fail with one line (click's BadParameter, through
    the type's own `fail`) instead of pydantic's multi-line ValidationError and a traceback."""
    convert = param_type.convert

    def checked(value: Any, param: Any, ctx: Any) -> Any:
        try:
            return convert(value, param, ctx)
        except ValidationError as exc:
            param_type.fail(str(one_line(exc, model.error_label, "", model)), param, ctx)

    param_type.convert = checked


def _to_click_option(*args: Any, **kwargs: Any) -> Any:
    option = _FLYTEKIT_TO_CLICK_OPTION(*args, **kwargs)
    option.opts = list(dict.fromkeys(option.opts))
    option.secondary_opts = list(dict.fromkeys(option.secondary_opts))
    python_type = kwargs.get("python_type", args[4] if len(args) > 4 else None)
    if isinstance(python_type, type) and issubclass(python_type, ConfigModel):
        _one_line_errors(option.type, python_type)
        option.show_default = False  # the model's defaults, as JSON: too long for --help
        literal_var = kwargs.get("literal_var", args[3] if len(args) > 3 else None)
        option.help = f"{literal_var.description} (JSON)" if literal_var is not None else option.help
    return option


_FLYTEKIT_TO_CLICK_OPTION = getattr(_pyflyte_run.to_click_option, "flytekit_original", _pyflyte_run.to_click_option)
_to_click_option.flytekit_original = _FLYTEKIT_TO_CLICK_OPTION  # type: ignore[attr-defined]
_pyflyte_run.to_click_option = _to_click_option
