"""Prepare a run root: the resolved config and the prompt set."""

from __future__ import annotations

from areal_core.config import RunConfig, to_yaml
from areal_core.prompts import write_prompts
from areal_core.store import LAYOUT, Store


def prepare_run(cfg: RunConfig) -> str:
    """Write config.yaml and prompts/ under the run root; returns the root URI.

    Raises (before writing anything) when the task's data cannot be loaded.
    """
    from datasets import load_task

    train, held_out = load_task(cfg.task, cfg.seed)
    if not train or not held_out:
        raise ValueError(f"task {cfg.task.name!r} produced an empty split (train={len(train)}, eval={len(held_out)})")
    store = Store(cfg.store)
    store.write_text(LAYOUT.config, to_yaml(cfg))
    write_prompts(store, train, held_out)
    return store.uri
