"""M2PO: decoupled PPO on the tokens that keep the second moment of the behaviour log-ratio below τ_M2.

Zheng et al., "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on
LLMs?" (2025, arXiv:2510.01161), the M2PO objective as AReaL's docs write it
(docs/en/algorithms/m2po.md) and its implementation (`areal/trainer/ppo/actor.py`:
`_apply_m2po_masking`, `_get_m2po_loss_mask`, `actor.m2_threshold`, 0.04 in its GSM8K example).
Per policy token, with log-ratio δ_t = log π_behav(t) − log π_prox(t) and M2_t = δ_t²:

    M̂2 = (1/N) Σ_t M2_t                                      (the batch's second moment)
    sort the tokens by M2_t, largest first; mask the k largest, k the smallest number for which
    the mean M2 of the other N − k tokens is below τ_M2 (k = 0 when M̂2 < τ_M2 already; when no
    k < N does it, all but the smallest one are masked);
    J = (1 / Σ_i |o_i|) Σ_i Σ_t M_{i,t} · π_θ(t)/π_behav(t) · A_{i,t}.

Here the ratio is decoupled as in the other losses, π_θ/π_behav = (π_θ/π_prox)·(π_prox/π_behav):
L_t = M_t · w · max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)), r = π_θ/π_prox, w = π_prox/π_behav as
`algo.behav_correction` says (AReaL's M2PO example also keeps its ratio filter, upper 5). With
one minibatch per step r = 1 when the loss is taken, so the clip never binds and the second
moment is the only trust region, as in the paper (AReaL's example sets eps_clip 0).
Masked tokens contribute 0 and stay in the denominator, Σ_i |o_i| as the paper writes it (AReaL's
code divides a micro-batch by its kept tokens, a factor N/(N − k) larger). The mask is a statistic
of the rows the loss is given, so M2PO runs on one rank only (a rank would see its share).
Tokens with a non-finite log π_behav or log π_prox are masked and left out of M̂2.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from pydantic import Field

from areal_core.config.base import Float
from areal_core.train.loss.common import masked_mean, usable_behaviour
from areal_core.train.loss.decoupled_ppo import decoupled_ppo_loss
from areal_core.train.loss.registry import Loss, LossInputs, LossSettings, register

if TYPE_CHECKING:
    from areal_core.config.algorithm import AlgorithmConfig


class M2poSettings(LossSettings):
    """`algo.m2po.*` (AReaL's `actor.m2_threshold`)."""

    threshold: Float = Field(
        0.04,
        gt=0,
        description="M2PO's τ_M2: the largest (log π_behav − log π_prox)² are masked until the rest's mean is below it",
    )


def m2po_mask(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """1 on the policy tokens M2PO keeps, 0 elsewhere (AReaL's `_apply_m2po_masking` semantics)."""
    on = (mask.float() * usable_behaviour(prox_logp, behav_logp)) > 0
    keep = torch.zeros_like(mask, dtype=torch.float32)
    n = int(on.sum())
    if n == 0:
        return keep
    m2 = (behav_logp[on].detach().float() - prox_logp[on].detach().float()) ** 2
    order = torch.sort(m2, descending=True, stable=True).indices
    suffix_mean = m2[order].flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=m2.dtype, device=m2.device)
    below = torch.nonzero(suffix_mean < threshold)
    k = int(below[0]) if len(below) else n - 1  # mask the k largest
    kept = torch.ones(n, dtype=torch.float32, device=m2.device)
    kept[order[:k]] = 0.0
    keep[on] = kept
    return keep


def masked_decoupled_ppo(
    cfg: AlgorithmConfig, x: LossInputs, w: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """agg(keep · w · max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high))), r = π_θ/π_prox, for a given behaviour
    weight w ≥ 0 and keep mask (no gradient through either): `decoupled_ppo_loss` with no correction
    and w·keep folded into the advantage (w·max(a, b) = max(w·a, w·b) for w ≥ 0; the dual clip
    −c·A·w likewise), so masked tokens give 0 and stay in the denominator. The clip fractions, the
    ratio mean and the importance-weight statistics count the kept tokens only; `behav_masked_frac`
    is over all policy tokens."""
    none = x.behaviour(cfg, "none")
    m = x.mask.float()
    keep = keep * none.usable
    w = torch.where(keep > 0, w.detach(), 0.0)
    loss, stats = decoupled_ppo_loss(cfg, dataclasses.replace(x, advantages=x.advantages * w), behaviour=none)
    kept = m * keep
    n_kept = kept.sum().clamp(min=1)
    scale = ((m * none.usable).sum() / n_kept).item()  # masked tokens never clip
    for key in ("clip_frac", "clip_low_frac", "clip_high_frac", "dual_clip_frac"):
        stats[key] *= scale
    log_r = torch.where(kept > 0, x.logp.detach() - x.prox_logp, 0.0)
    wk = w[kept > 0] if (kept > 0).any() else w.new_ones(1)
    stats.update(
        ratio_mean=masked_mean(torch.exp(log_r), kept).item(),
        importance_weight_mean=masked_mean(w, kept).item(),
        importance_weight_max=wk.max().item(),
        importance_weight_min=wk.min().item(),
        behav_masked_frac=masked_mean(1 - keep, m).item(),
    )
    return loss, stats


def m2po_loss(cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """M2PO on `x` (the formula in the module docstring). Metrics: decoupled PPO's, `m2_masked_frac`
    (policy tokens M2PO masked), `m2_before` / `m2_after` (mean M2 over the usable / kept tokens)."""
    m = x.mask.float()
    b = x.behaviour(cfg)
    keep_m2 = m2po_mask(x.prox_logp, x.behav_logp, m, M2poSettings.of(cfg).threshold)
    usable = m * b.usable
    loss, stats = masked_decoupled_ppo(cfg, x, b.w, b.keep * keep_m2)
    m2 = torch.where(usable > 0, x.behav_logp - x.prox_logp, 0.0).detach().float() ** 2
    stats.update(
        behav_truncated_frac=b.stats["behav_truncated_frac"],
        m2_masked_frac=masked_mean(usable * (1 - keep_m2), m).item(),
        m2_before=masked_mean(m2, usable).item(),
        m2_after=masked_mean(m2, usable * keep_m2).item(),
    )
    return loss, stats


@register
class M2PO(Loss):
    """M2PO: decoupled PPO on the tokens left after masking the largest squared behaviour log-ratios
    until their mean is below `algo.m2po.threshold` (Zheng et al. 2025; the module docstring)."""

    name = "m2po"
    Settings = M2poSettings
    needs = frozenset({"advantages"})
    level = "token"
    distributed = False  # the mask is a statistic of all rows of the minibatch

    def __call__(self, cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return m2po_loss(cfg, x)
