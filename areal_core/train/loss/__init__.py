"""Policy, critic, preference and regulariser losses: one module per loss, found through the registry.

    from areal_core.train.loss import get_loss, LossInputs
    loss, metrics = get_loss(cfg.loss)(cfg, LossInputs(logp=..., prox_logp=..., ...))

`registry.py` holds the API (`Loss`, `LossInputs`, `register`, `get_loss`, `known_losses`,
`active_losses`, `check_algorithm`); `common.py` the shared math (aggregation, the behaviour
correction w = π_prox/π_behav, KL estimators). Each other module is one loss, its formula in its
docstring, a pure function `(cfg, LossInputs) -> (loss, metrics)` that reads the tensors, the shared
`algo.*` keys and its own settings (`algo.<loss>.<key>`, a `LossSettings` model the module declares);
the behaviour correction is one step, `x.behaviour(cfg)`. Adding a loss is one module here (its
formula, its settings, its class) plus, optionally, a preset in configs/algorithms/. The pure
functions are re-exported below.
"""

from areal_core.train.loss.common import (
    Behaviour,
    aggregate,
    behaviour_correction,
    behaviour_kl,
    kl_penalty,
    masked_mean,
    per_row,
    sequence_logprobs,
    usable_behaviour,
)
from areal_core.train.loss.critic import critic_loss
from areal_core.train.loss.decoupled_ppo import decoupled_ppo_loss
from areal_core.train.loss.preference import preference_loss, preference_pairs
from areal_core.train.loss.registry import (
    Loss,
    LossInputs,
    LossSettings,
    active_losses,
    check_algorithm,
    check_settings,
    complete_settings,
    get_loss,
    known_losses,
    register,
    settings_models,
    terms,
)

__all__ = [
    "Behaviour",
    "Loss",
    "LossInputs",
    "LossSettings",
    "active_losses",
    "aggregate",
    "behaviour_correction",
    "behaviour_kl",
    "check_algorithm",
    "check_settings",
    "complete_settings",
    "critic_loss",
    "decoupled_ppo_loss",
    "get_loss",
    "kl_penalty",
    "known_losses",
    "masked_mean",
    "per_row",
    "preference_loss",
    "preference_pairs",
    "register",
    "sequence_logprobs",
    "settings_models",
    "terms",
    "usable_behaviour",
]
