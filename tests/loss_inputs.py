"""Tests' shorthand for calling a loss `(cfg, LossInputs)` with bare tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from areal_core.config.algorithm import AlgorithmConfig
from areal_core.train.loss.registry import LossInputs

# the keyword arguments that go to LossInputs; every other one is an `algo.*` key
INPUT_KEYS = {"teacher_logp", "ref_logp", "values", "old_values", "returns", "entropy", "global_tokens", "global_seqs"}


def loss_inputs(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor | None,
    mask: torch.Tensor,
    **extra: Any,
) -> LossInputs:
    """LossInputs of these tensors; rewards 0 and one group per row (no loss here reads them)."""
    n = mask.shape[0]
    return LossInputs(
        logp=logp,
        prox_logp=prox_logp,
        behav_logp=behav_logp,
        mask=mask.float(),
        rewards=torch.zeros(n),
        group_index=torch.arange(n),
        advantages=advantages,
        **extra,
    )


def call(
    loss: Callable[..., tuple[torch.Tensor, dict[str, float]]],
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    loss_kwargs: dict[str, Any] | None = None,
    **kw: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`loss(AlgorithmConfig(**algo keys), loss_inputs(...))`: keyword arguments named in INPUT_KEYS go
    to LossInputs, the others are `algo.*` keys; `loss_kwargs` go to the loss function itself."""
    extra = {k: kw.pop(k) for k in list(kw) if k in INPUT_KEYS}
    x = loss_inputs(logp, prox_logp, behav_logp, advantages, mask, **extra)
    return loss(AlgorithmConfig(**kw), x, **(loss_kwargs or {}))


def ppo(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **kw: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`decoupled_ppo_loss` with ε = 0.2 both sides and w uncapped unless given (`call`'s keywords;
    `level` and `seq_advantage` go to the loss function)."""
    from areal_core.train.loss.decoupled_ppo import decoupled_ppo_loss

    loss_kwargs = {k: kw.pop(k) for k in ("level", "seq_advantage") if k in kw}
    kw = {"eps_high": 0.2, "behav_high": 0.0, **kw}
    return call(decoupled_ppo_loss, logp, prox_logp, behav_logp, advantages, mask, loss_kwargs=loss_kwargs, **kw)
