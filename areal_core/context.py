"""What every role does first: read the run's resolved config, set threads, wait for weights."""

from __future__ import annotations

import os
import time

import torch

from areal_core.config import ConfigError, RunConfig, from_yaml_text
from areal_core.config.base import MAX_YAML_BYTES
from areal_core.layout import LAYOUT
from areal_core.retry import configure
from areal_core.store import Store, UnreadableObject


def load_run_config(store: Store) -> RunConfig:
    """The run's config; its `store_retry_s` becomes this process's (and its children's) store retry window."""
    if not store.exists(LAYOUT.config):
        raise FileNotFoundError(f"{store.url(LAYOUT.config)} is missing: the run was not prepared")
    try:
        text = store.read_bytes(LAYOUT.config, MAX_YAML_BYTES)
    except (UnreadableObject, IsADirectoryError) as exc:
        raise ConfigError(f"the run's {LAYOUT.config}: {exc}") from None
    cfg = from_yaml_text(text, f"the run's {LAYOUT.config}")
    configure(cfg.store_retry_s)
    return cfg


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))


def wait_for_version(store: Store, timeout_s: float = 600.0, poll_s: float = 0.05) -> int:
    """Block until weights/LATEST names a version (the trainer publishes v0 at start)."""
    deadline = time.time() + timeout_s
    while (v := store.latest_version()) is None:
        if store.done():
            raise RuntimeError("run already DONE before any weights were published")
        if time.time() > deadline:
            raise TimeoutError(f"no weights/LATEST under {store.uri} after {timeout_s:.0f}s")
        time.sleep(poll_s)
    return v
