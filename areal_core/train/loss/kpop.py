"""KPop: decoupled PPO that masks the tokens whose bidirectional binary KL between π_prox and π_behav exceeds φ.

Guo, Sun et al. (Ant Group), "Taming Training-Inference Mismatch in Reinforcement Learning with
Adaptive Masking Regions" (2026, https://ringtech.notion.site/kpop), the successor of IcePop's fixed
ratio band [α, β] (here `behav_correction: mask`, preset `icepop`), as AReaL implements it
(`rejection_sampling.metric: binary_kl`, `areal/utils/functional/functional.py`:
`compute_binary_kl_divergence`, `apply_rejection_sampling`; docs/en/algorithms/grpo_series.md, KPop).
Each token's probability is the parameter of a Bernoulli, p = π_prox(t), q = π_behav(t), both
clamped to [1e−8, 1 − 1e−8]:

    KL_b(p‖q) = p·log(p/q) + (1 − p)·log((1 − p)/(1 − q)),
    keep_t = 1[max(KL_b(p‖q), KL_b(q‖p)) ≤ φ],                     φ = `algo.kpop.threshold`
    L_t = keep_t · ρ_t · max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)),  r = π_θ/π_prox, ρ = π_prox/π_behav,

ρ uncapped (AReaL's mask mode keeps the raw weight), token-mean by default; masked tokens give 0
and stay in the denominator, as IcePop's do. Unlike a ratio band, the bound depends on the token's
probability: π_prox/π_behav = 2 is KL_b ≈ 0.14 at π_prox = 0.5 and ≈ 0.002 at π_prox = 0.01, so the
same ratio counts for more on a likely token than on an unlikely one. `algo.behav_correction` is
not read: KPop is the behaviour correction. A non-finite log π_behav or log π_prox is masked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field

from areal_core.config.base import Float
from areal_core.train.loss.common import masked_mean, usable_behaviour
from areal_core.train.loss.m2po import masked_decoupled_ppo
from areal_core.train.loss.registry import Loss, LossInputs, LossSettings, register

if TYPE_CHECKING:
    from areal_core.config.algorithm import AlgorithmConfig

EPS = 1e-8  # AReaL's clamp of the Bernoulli parameters


class KpopSettings(LossSettings):
    """`algo.kpop.*`."""

    threshold: Float = Field(
        2.0, gt=0, description="KPop's φ: tokens whose bidirectional binary KL(π_prox, π_behav) exceeds it are masked"
    )


def binary_kl(log_p: torch.Tensor, log_q: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """KL(Bern(p)‖Bern(q)) = p·log(p/q) + (1 − p)·log((1 − p)/(1 − q)), p = e^{log_p}, q = e^{log_q},
    both clamped to [eps, 1 − eps] (computed in float64 so that 1 − p keeps its digits)."""
    p = torch.exp(log_p.detach().double()).clamp(eps, 1 - eps)
    q = torch.exp(log_q.detach().double()).clamp(eps, 1 - eps)
    return (p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))).to(log_p.dtype)


def kpop_keep(prox_logp: torch.Tensor, behav_logp: torch.Tensor, threshold: float) -> torch.Tensor:
    """1[max(KL_b(π_prox‖π_behav), KL_b(π_behav‖π_prox)) ≤ φ] on the usable tokens, 0 elsewhere."""
    usable = usable_behaviour(prox_logp, behav_logp)
    prox = torch.where(usable > 0, prox_logp, 0.0)
    behav = torch.where(usable > 0, behav_logp, 0.0)
    kl = torch.maximum(binary_kl(prox, behav), binary_kl(behav, prox))
    return usable * (kl <= threshold).float()


def kpop_loss(cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """KPop on `x` (the formula in the module docstring). Metrics: decoupled PPO's over the kept
    tokens, `kpop_masked_frac` (policy tokens KPop masked) and `kpop_kl_max` (the largest
    bidirectional binary KL among the usable policy tokens)."""
    m = x.mask.float()
    usable = usable_behaviour(x.prox_logp, x.behav_logp)
    keep = kpop_keep(x.prox_logp, x.behav_logp, KpopSettings.of(cfg).threshold)
    log_rho = torch.where(usable > 0, x.prox_logp - x.behav_logp, 0.0).detach().float()
    rho = torch.exp(log_rho.clamp(max=80.0))
    loss, stats = masked_decoupled_ppo(cfg, x, rho, keep)
    on = (m * usable) > 0
    prox, behav = torch.where(on, x.prox_logp, 0.0), torch.where(on, x.behav_logp, 0.0)
    kl = torch.maximum(binary_kl(prox, behav), binary_kl(behav, prox))
    stats.update(
        kpop_masked_frac=masked_mean(usable * (1 - keep), m).item(),
        kpop_kl_max=kl[on].max().item() if on.any() else 0.0,
    )
    return loss, stats


@register
class KPop(Loss):
    """KPop: decoupled PPO with ρ = π_prox/π_behav, masking tokens whose bidirectional binary KL
    between π_prox and π_behav exceeds `algo.kpop.threshold` (the module docstring)."""

    name = "kpop"
    Settings = KpopSettings
    needs = frozenset({"advantages"})
    level = "token"
    advantage_weighted = True  # A = 0 on a row: no loss, no gradient

    def __call__(self, cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return kpop_loss(cfg, x)
