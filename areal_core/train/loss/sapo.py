"""SAPO: a soft, sign-dependent sigmoid gate on the ratio instead of PPO's hard clip.

Gao et al. (Qwen), "Soft Adaptive Policy Optimization" (2025, arXiv:2511.20347), the SAPO objective,
as AReaL's docs write it (docs/en/algorithms/grpo_series.md, "SAPO") and its `sapo_loss_fn`
implements it (`areal/utils/functional/functional.py`; `actor.use_sapo_loss`, `sapo_tau_pos`,
`sapo_tau_neg`, defaults 1.0 / 1.05):

    J(θ) = E[ (1/G) Σ_i (1/|y_i|) Σ_t f_{i,t}(r_{i,t}(θ)) · Â_{i,t} ],
    f_{i,t}(x) = (4/τ_{i,t}) · σ(τ_{i,t}·(x − 1)),   τ_{i,t} = τ_pos if Â_{i,t} > 0 else τ_neg,

so ∇f(r) = 4·σ(τ(r − 1))·(1 − σ(τ(r − 1)))·∇r: exactly the policy gradient at r = 1 (4·¼ = 1), a
weight decaying smoothly as r leaves 1, faster for the side whose τ is larger (τ_neg > τ_pos
damps negative-advantage tokens sooner). Nothing is ever cut off, only down-weighted.
Decoupled as the other losses here, r = π_θ/π_prox and the behaviour weight w = π_prox/π_behav
(`algo.behav_correction`, no gradient) corrects for staleness, per policy token

    L_t = −w · (4/τ_t) · σ(τ_t·(r_t − 1)) · A_t,

aggregated as `algo.aggregation` (the paper's is `seq_mean_token_mean`; AReaL's token-mean, the
preset's). AReaL runs SAPO with `use_decoupled_loss: false`, i.e. its ratio is to π_prox (with
`recompute_logprob`) and there is no behaviour weight: `behav_correction: none` here. A token with
a non-finite log π_behav or log π_prox is masked (w = 0, r = 1, no gradient).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field

from areal_core.config.base import Float
from areal_core.train.loss.common import masked_mean
from areal_core.train.loss.registry import Loss, LossInputs, LossSettings, register

if TYPE_CHECKING:
    from areal_core.config.algorithm import AlgorithmConfig


class SapoSettings(LossSettings):
    """`algo.sapo.*`: the gate's temperatures (AReaL's `sapo_tau_pos`, `sapo_tau_neg`)."""

    tau_pos: Float = Field(1.0, gt=0, description="SAPO's gate temperature τ on tokens with A > 0")
    tau_neg: Float = Field(
        1.05, gt=0, description="SAPO's gate temperature τ on tokens with A ≤ 0 (larger: damped sooner)"
    )


def sapo_loss(cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """agg(−w · (4/τ)·σ(τ·(r − 1)) · A), r = π_θ/π_prox, τ = `algo.sapo.tau_pos` where A > 0 else
    `algo.sapo.tau_neg`, w = π_prox/π_behav (`x.behaviour(cfg)`). Returns (loss, stats): the ratio
    mean, `sapo_gate_mean` (mean of the gradient weight 4σ(1 − σ) ∈ (0, 1] relative to the policy
    gradient, 1 at r = 1) over the kept tokens, importance-weight statistics and KL(behaviour‖proximal)."""
    settings = SapoSettings.of(cfg)
    tau_pos, tau_neg = settings.tau_pos, settings.tau_neg
    b = x.behaviour(cfg)
    ratio = torch.exp(x.logp - b.anchor(x.prox_logp, x.logp))  # r = 1 where w = 0
    adv = x.advantages.detach()
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1))
    loss = x.reduce(-b.w * (4 / tau) * gate * adv, cfg)
    kept = x.mask.float() * b.keep
    g = gate.detach()
    stats = {
        "ratio_mean": masked_mean(ratio.detach(), kept).item(),
        "sapo_gate_mean": masked_mean(4 * g * (1 - g), kept).item(),
        "clip_frac": 0.0,  # nothing is clipped: the gate only down-weights
        **b.metrics(),
    }
    return loss, stats


@register
class SAPO(Loss):
    """SAPO: L_t = −w · (4/τ)·σ(τ·(π_θ/π_prox − 1)) · A_t, τ = `algo.sapo.tau_pos` for A_t > 0 else
    `algo.sapo.tau_neg` (arXiv:2511.20347; the module docstring)."""

    name = "sapo"
    Settings = SapoSettings
    needs = frozenset({"advantages"})
    level = "token"
    advantage_weighted = True  # A = 0 on a row: no loss, no gradient

    def __call__(self, cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return sapo_loss(cfg, x)
