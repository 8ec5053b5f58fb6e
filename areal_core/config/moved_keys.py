"""The flat `algo.*` keys of single losses that moved under their loss's name (`algo.<loss>.<key>`), read for
one more release: a config of the previous shape (a YAML file, an override, a stored run's config.yaml)
loads as the new shape.

    move_flat_keys({"loss": "m2po", "m2_threshold": 0.1})   # {"loss": "m2po", "m2po": {"threshold": 0.1}}
                                                            # and a DeprecationWarning naming algo.m2po.threshold

A moved key holding the previous release's default is dropped without a word: the new section's
default is the same value, and every config.yaml that release wrote holds all of them. Any other
value moves, with a DeprecationWarning and a log warning naming the new key; set beside the new key
to another value, it is a ConfigError (which one wins would be a guess). `dpo_beta` is IPO's β when
`algo.loss` is ipo (both read it), DPO's otherwise. Delete this module, and its one call in
algorithm.py, in the release after.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from areal_core.config.base import Invalid

log = logging.getLogger("areal.config")

# old flat key: (the loss's section, its key there, the previous release's default)
MOVED_KEYS: dict[str, tuple[str, str, Any]] = {
    "m2_threshold": ("m2po", "threshold", 0.04),
    "sapo_tau_pos": ("sapo", "tau_pos", 1.0),
    "sapo_tau_neg": ("sapo", "tau_neg", 1.05),
    "kpop_threshold": ("kpop", "threshold", 2.0),
    "teacher_path": ("distill", "teacher_path", ""),
    "distill_coef": ("distill", "coef", 0.1),
    "distill_rl_coef": ("distill", "rl_coef", 1.0),
    "dpo_beta": ("dpo", "beta", 0.1),
    "dpo_label_smoothing": ("dpo", "label_smoothing", 0.0),
    "value_coef": ("critic", "coef", 0.5),
    "value_clip": ("critic", "clip", 0.2),
    "critic_lr": ("critic", "lr", 0.0),
    "behav_clip_drop": ("decoupled_ppo", "behav_clip_drop", "none"),
}
_warned: set[str] = set()


def new_key(old: str, loss: str) -> tuple[str, str]:
    """(section, key) where the flat key `old` now lives, `loss` being `algo.loss`."""
    section, key, _ = MOVED_KEYS[old]
    if old == "dpo_beta" and loss == "ipo":
        section = "ipo"
    return section, key


def _warn(old: str, section: str, key: str, value: Any) -> None:
    text = (
        f"config key 'algo.{old}' is deprecated and goes in the next release: "
        f"write algo.{section}.{key} (read as algo.{section}.{key}={value!r})"
    )
    warnings.warn(text, DeprecationWarning, stacklevel=2)
    if text not in _warned:  # each role loads the config: once per process
        _warned.add(text)
        log.warning(text)


def move_flat_keys(data: Any, keep_defaults: bool = False) -> Any:
    """`data` (an `algo:` mapping) with every moved flat key under its loss's section (module docstring);
    `keep_defaults`: move a key holding the old default too (an explicit override laid over a preset)."""
    if not isinstance(data, dict) or not data.keys() & MOVED_KEYS.keys():
        return data
    out = dict(data)
    loss = out.get("loss", "decoupled_ppo")
    for old in [k for k in out if k in MOVED_KEYS]:
        value = out.pop(old)
        section, key = new_key(old, loss)
        target = out.get(section, {})
        if not isinstance(target, dict):
            continue  # the section itself is refused (it must be a mapping)
        if key in target:
            if target[key] != value:
                raise Invalid(
                    old, f"(deprecated) is {value!r} but algo.{section}.{key} is {target[key]!r}: keep only the latter"
                )
            continue
        if not keep_defaults and value == MOVED_KEYS[old][2] and type(value) is type(MOVED_KEYS[old][2]):
            continue
        out[section] = {**target, key: value}
        _warn(old, section, key, value)
    return out
