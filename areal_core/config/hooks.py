"""The one loader of "pkg.module:name" config values (reward functions, agents, corpora, ...).

fn = import_object("areal_core.proxy.examples:calculator_agent", key="rollout.agent", coroutine=True)
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

from areal_core.config.base import ConfigError


def import_object(path: str, *, key: str, coroutine: bool = False) -> Any:
    """'pkg.module:name' -> that callable (an async function if `coroutine`); a one-line
    ConfigError naming the config `key` when it does not look like that, does not import, or
    is not callable."""
    module, _, name = str(path).partition(":")
    if not module or not name:
        raise ConfigError(f"config key '{key}' must look like 'pkg.module:function', got {path!r}")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(f"config key '{key}': cannot import {path!r} ({type(exc).__name__}: {detail})") from None
    if not callable(obj) or (coroutine and not asyncio.iscoroutinefunction(obj)):
        kind = "an async function" if coroutine else "callable"
        raise ConfigError(f"config key '{key}': {path!r} is not {kind}")
    return obj
