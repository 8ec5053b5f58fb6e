"""Prepare a run root: claim it for this run, then the resolved config and the prompt set."""

from __future__ import annotations

from areal_core.config import ConfigError, RunConfig, to_yaml
from areal_core.layout import LAYOUT
from areal_core.prompts import write_prompts
from areal_core.run import (
    preflight_reward,  # noqa: F401 - registers the reward check
    preflight_routing,  # noqa: F401 - registers the router replay check
)
from areal_core.run.ownership import claim
from areal_core.run.preflight import run_preflight
from areal_core.store import Store
from areal_core.vlm.records import has_images, store_record_images


def prepare_run(cfg: RunConfig, resume: bool = False) -> str:
    """Claim the run root (run/ownership.py; a new run clears an earlier run's state, a resume
    keeps it), then write config.yaml, the prompts' images (images/, content-addressed: a record
    with `meta.image_source` or `meta.images` gets `meta.image_ids`) and prompts/; returns the root URI.

    Raises (before writing anything) when the task's data cannot be loaded, holds images for a
    text model, the preflight refuses the model (run/preflight.py), or another run owns the root.
    """
    from task_data import load_run_task

    try:
        train, held_out = load_run_task(cfg)
    except ConfigError:  # already one line naming its key (rollout.environment's server, a hook)
        raise
    except (ValueError, OSError) as exc:  # the task's data: a missing file, a bad record, a bad choice
        raise ConfigError(f"config section 'task' ({cfg.task.name}): {str(exc)[:300]}") from None
    if not train or not held_out:
        raise ValueError(f"task {cfg.task.name!r} produced an empty split (train={len(train)}, eval={len(held_out)})")
    if cfg.model.kind != "vlm" and any(has_images(r) for r in train[:1] + held_out[:1]):
        raise ConfigError(f"config key 'model.kind': task {cfg.task.name!r} has images; set model.kind=vlm")
    run_preflight(cfg, train)  # the user's model, engine, LoRA and prompt format (run/preflight.py)
    store = Store(cfg.store)
    claim(store, cfg.lease, resume)
    if not resume:
        for name in LAYOUT.run_state:
            store.delete(name, recursive=True)
    kept = cfg.model_copy(update={"lease": cfg.lease.model_copy(update={"takeover": False})})  # a one-time request
    store.write_text(LAYOUT.config, to_yaml(kept))
    store_record_images(store, train + held_out)
    write_prompts(store, train, held_out)
    return store.uri
