"""New run roots made from an existing run (run/replay.py, run/fork.py): the derived config with
its contract check, and a fresh root holding the source's config, prompts and initial model."""

from __future__ import annotations

import json
from typing import Any

from areal_core.config import ConfigError, RunConfig, load_config, to_flat_dict, to_yaml
from areal_core.layout import LAYOUT, BadName, check_root
from areal_core.store import Store


class DerivedRunError(ValueError):
    """A replay or fork that cannot be made as asked; the message (one line) says why."""


def derived_config(source: RunConfig, overrides: list[str], into: str, fixed: tuple[str, ...], what: str) -> RunConfig:
    """`source` with the dotted `overrides` applied and `store=into`; DerivedRunError when the
    overrides change a key under one of the `fixed` prefixes (a key, or a section ending in '.')."""
    try:
        cfg = load_config(None, [*overrides, f"store={into}"], typed=source)
        from areal_core.train.algorithm import check_for_model
        from areal_core.train.loss import check_algorithm, complete_settings

        check_algorithm(cfg.algo)
        check_for_model(cfg.algo, cfg.model.kind)  # a fork or replay may change algo.*
        cfg = cfg.model_copy(update={"algo": complete_settings(cfg.algo)})  # the loss's settings, written out
    except ConfigError as exc:
        raise DerivedRunError(str(exc)) from None
    old, new = to_flat_dict(source), to_flat_dict(cfg)
    broken = sorted(
        k for k in new if old.get(k) != new[k] and any(k == f or (f.endswith(".") and k.startswith(f)) for f in fixed)
    )
    if broken:
        raise DerivedRunError(
            f"{what} cannot change {', '.join(broken)}: the stored run fixes it "
            f"(allowed: anything but {', '.join(fixed)})"
        )
    return cfg


def fresh_root(into: str, source: Store, request: dict[str, Any]) -> tuple[Store, str]:
    """The new run root and where it stands: 'new' (empty), 'unfinished' (an earlier attempt of
    this same `request`, e.g. a retried task: continue it) or 'finished' (its result is written).
    DerivedRunError when it is the source's root or inside it, an S3 key with '.' or '..'
    segments, a name that check_root refuses (control characters; a last segment '.', '..',
    hidden or overlong), or when it holds anything else (another request's root, or any other
    entry: a folder with only dot-files or empty folders is not empty)."""
    try:
        check_root(into, "--into")
    except BadName as exc:
        raise DerivedRunError(str(exc)) from None
    store = Store(into)
    src = source.uri.rstrip("/")
    if store.uri.rstrip("/") == src:
        raise DerivedRunError(f"{into} is the source run's own root: give a new run root")
    if store.uri.startswith(src + "/"):
        raise DerivedRunError(f"{into} is inside the source run's root {src}: give a root outside it")
    if not store.local and {".", ".."} & set(store.uri.split("://", 1)[1].split("/")):
        raise DerivedRunError(f"{into}: an object-store root with '.' or '..' segments is ambiguous; spell it out")
    if not store.has_any(""):
        return store, "new"
    found = store.read_json(LAYOUT.derived_request) if store.exists(LAYOUT.derived_request) else None
    if found is None:
        raise DerivedRunError(f"{store.uri} already holds a run (or other files): give a new, empty run root")
    if found != request:
        raise DerivedRunError(
            f"{store.uri} already holds another request ({json.dumps(found, sort_keys=True)[:200]}): "
            "give a new, empty run root"
        )
    return store, "finished" if store.exists(LAYOUT.derived_result) else "unfinished"


def begin(store: Store, request: dict[str, Any]) -> None:
    """Record `request` as the new root's first object (a conditional write: of two attempts
    started at once, one records it; the other goes on only if it asked the same)."""
    body = json.dumps(request, sort_keys=True).encode()
    if not store.write_if(LAYOUT.derived_request, body, None) and store.read_json(LAYOUT.derived_request) != request:
        raise DerivedRunError(f"{store.uri} was claimed at the same moment by another request: give a new root")


def copy_base(source: Store, store: Store, cfg: RunConfig) -> None:
    """Write the derived config and copy the source's prompt set and initial model (the policy
    RL started from, also the reference model's weights)."""
    if not source.exists(LAYOUT.committed(LAYOUT.init_model)):
        raise DerivedRunError(f"{source.uri} has no committed {LAYOUT.init_model}/: it never started RL")
    store.write_text(LAYOUT.config, to_yaml(cfg))
    store.copy_dir(LAYOUT.prompts_dir, LAYOUT.prompts_dir, source=source)
    store.copy_dir(LAYOUT.init_model, LAYOUT.init_model, source=source)
