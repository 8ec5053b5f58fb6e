"""New run roots made from an existing run (run/replay.py, run/fork.py): the derived config with
its contract check, and a fresh root holding the source's config, prompts and initial model."""

from __future__ import annotations

from areal_core.config import ConfigError, RunConfig, load_config, to_flat_dict, to_yaml
from areal_core.layout import LAYOUT
from areal_core.store import Store


class DerivedRunError(ValueError):
    """A replay or fork that cannot be made as asked; the message (one line) says why."""


def derived_config(source: RunConfig, overrides: list[str], into: str, fixed: tuple[str, ...], what: str) -> RunConfig:
    """`source` with the dotted `overrides` applied and `store=into`; DerivedRunError when the
    overrides change a key under one of the `fixed` prefixes (a key, or a section ending in '.')."""
    try:
        cfg = load_config(None, [*overrides, f"store={into}"], typed=source)
    except ConfigError as exc:
        raise DerivedRunError(str(exc)) from None
    old, new = to_flat_dict(source), to_flat_dict(cfg)
    broken = sorted(
        k for k in new if old.get(k) != new[k] and any(k == f or (f.endswith(".") and k.startswith(f)) for f in fixed)
    )
    if broken:
        raise DerivedRunError(
            f"{what} cannot change {', '.join(broken)}: the stored run fixes it (allowed: anything but {', '.join(fixed)})"
        )
    return cfg


def fresh_root(into: str, source: Store) -> Store:
    """The new run root; DerivedRunError when it is the source or already holds anything."""
    store = Store(into)
    if store.uri.rstrip("/") == source.uri.rstrip("/"):
        raise DerivedRunError(f"{into} is the source run's own root: give a new run root")
    if store.find(""):
        raise DerivedRunError(f"{store.uri} already holds a run (or other files): give a new, empty run root")
    return store


def copy_base(source: Store, store: Store, cfg: RunConfig) -> None:
    """Write the derived config and copy the source's prompt set and initial model (the policy
    RL started from, also the reference model's weights)."""
    if not source.exists(LAYOUT.committed(LAYOUT.init_model)):
        raise DerivedRunError(f"{source.uri} has no committed {LAYOUT.init_model}/: it never started RL")
    store.write_text(LAYOUT.config, to_yaml(cfg))
    store.copy_dir(LAYOUT.prompts_dir, LAYOUT.prompts_dir, source=source)
    store.copy_dir(LAYOUT.init_model, LAYOUT.init_model, source=source)
