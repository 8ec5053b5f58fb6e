"""The critic's value loss (PPO with GAE): a term added to the policy loss, not an `algo.loss`.

    V_c = V_old + clip(V − V_old, −c, c),   L_t = ½ · max((V − R)², (V_c − R)²)   (c = `algo.value_clip`;
    c ≤ 0: L_t = ½ (V − R)²),   total += `algo.value_coef` · agg(L)

Schulman et al., "Proximal Policy Optimization Algorithms" (2017), L^VF, with the value clipping
of the OpenAI baselines implementation. Enabled when the advantage estimator reads a critic
(`CRITIC_ESTIMATORS`) and the policy loss uses advantages; the critic is not sharded, so one rank only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from areal_core.train.advantages import CRITIC_ESTIMATORS
from areal_core.train.loss.common import masked_mean
from areal_core.train.loss.registry import Loss, LossInputs, register

if TYPE_CHECKING:
    from areal_core.config.algorithm import AlgorithmConfig


def critic_loss(cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss of `x.values` (with gradient) against `x.returns`, aggregated as `algo.aggregation`:
    V_c = V_old + clip(V − V_old, −c, c), L_t = ½ · max((V − R)², (V_c − R)²), c = `algo.value_clip`
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
    if cfg.value_clip > 0:
        v_clip = old_values + (values - old_values).clamp(-cfg.value_clip, cfg.value_clip)
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
    weighted by `algo.value_coef`; R = the estimator's returns."""

    name = "critic"
    kind = "term"
    needs = frozenset({"values", "old_values", "returns"})
    level = "token"
    distributed = False  # the critic of value_head.py is not sharded

    def enabled(self, cfg: AlgorithmConfig, policy: Loss) -> bool:
        return cfg.adv_estimator in CRITIC_ESTIMATORS and "advantages" in policy.needs

    def coef(self, cfg: AlgorithmConfig) -> float:
        return cfg.value_coef

    def __call__(self, cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return critic_loss(cfg, x)
