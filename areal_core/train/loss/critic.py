"""The critic's value loss (PPO with GAE): a term added to the policy loss, not an `algo.loss`.

    V_c = V_old + clip(V − V_old, −c, c),   L_t = ½ · max((V − R)², (V_c − R)²)   (c = `algo.critic.clip`;
    c ≤ 0: L_t = ½ (V − R)²),   total += `algo.critic.coef` · agg(L)

Schulman et al., "Proximal Policy Optimization Algorithms" (2017), L^VF, with the value clipping
of the OpenAI baselines implementation. Enabled when the advantage estimator reads a critic
(`CRITIC_ESTIMATORS`) and the policy loss uses advantages; the critic is not sharded, so one rank only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field

from areal_core.config.base import Float
from areal_core.train.advantages import CRITIC_ESTIMATORS
from areal_core.train.loss.common import masked_mean
from areal_core.train.loss.registry import Loss, LossInputs, LossSettings, register

if TYPE_CHECKING:
    from areal_core.config.algorithm import AlgorithmConfig


class CriticSettings(LossSettings):
    """`algo.critic.*`: the critic's value loss and its optimizer (train/value_head.py)."""

    coef: Float = Field(0.5, ge=0, description="the weight of the critic's value loss in the total loss")
    clip: Float = Field(0.2, ge=0, description="c in the value clipping V_old + clip(V − V_old, −c, c); 0 disables it")
    lr: Float = Field(0.0, ge=0, description="the critic's AdamW learning rate; 0: train.lr")


def critic_loss(cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss of `x.values` (with gradient) against `x.returns`, aggregated as `algo.aggregation`:
    V_c = V_old + clip(V − V_old, −c, c), L_t = ½ · max((V − R)², (V_c − R)²), c = `algo.critic.clip`
    (c ≤ 0: L_t = ½ (V − R)²); V_old = `x.old_values` (None: V, detached)."""
    if x.values is None or x.returns is None:
        raise ValueError(
            f"algo.adv_estimator={cfg.adv_estimator} needs values (with gradient), old_values, and returns "
            "when advantages are passed in (both come from compute_advantages)"
        )
    values, returns, m = x.values, x.returns.detach(), x.mask.float()
    old_values = (x.old_values if x.old_values is not None else values).detach()
    err = (values - returns) ** 2
    clip_hit = torch.zeros_like(err)
    clip = CriticSettings.of(cfg).clip
    if clip > 0:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err_clip = (v_clip - returns) ** 2
        clip_hit = (err_clip > err).float()
        err = torch.maximum(err, err_clip)
    loss = x.reduce(0.5 * err, cfg)
    v, r = values.detach(), returns
    ret_var = masked_mean((r - masked_mean(r, m)) ** 2, m)
    res_var = masked_mean((r - v - masked_mean(r - v, m)) ** 2, m)
    stats = {
        "value_loss": loss.item(),
        "value_clip_frac": masked_mean(clip_hit, m).item(),
        "value_mean": masked_mean(v, m).item(),
        "explained_variance": (1 - res_var / ret_var.clamp(min=1e-8)).item(),
    }
    return loss, stats


@register
class CriticTerm(Loss):
    """Clipped value loss L_t = ½ · max((V − R)², (V_c − R)²), V_c = V_old + clip(V − V_old, −c, c),
    weighted by `algo.critic.coef`; R = the estimator's returns."""

    name = "critic"
    Settings = CriticSettings
    kind = "term"
    needs = frozenset({"values", "old_values", "returns"})
    level = "token"
    distributed = False  # the critic of value_head.py is not sharded

    def enabled(self, cfg: AlgorithmConfig, policy: Loss) -> bool:
        return cfg.adv_estimator in CRITIC_ESTIMATORS and "advantages" in policy.needs

    def coef(self, cfg: AlgorithmConfig) -> float:
        return CriticSettings.of(cfg).coef

    def __call__(self, cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return critic_loss(cfg, x)
