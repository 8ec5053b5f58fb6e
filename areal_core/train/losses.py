"""Policy losses: pure functions over per-token tensors of shape [N, T]."""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ x·m / max(Σ m, 1): the token-mean over the batch."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float = 0.0,
    behav_weight_cap: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO (AReaL), token-mean aggregated.

    r = π_θ/π_prox,  w = π_prox/π_behav (capped at `behav_weight_cap` when > 0, no gradient),
    L_t = w · max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)),
    with dual clip (c > 1): for A < 0, L_t = w · min(L_t/w, −c·A).
    Returns (loss, stats) with clip fraction, dual-clip fraction, importance-weight mean and
    KL(behaviour‖proximal) estimated as mean(log π_behav − log π_prox).
    """
    mask = mask.float()
    ratio = torch.exp(logp - prox_logp)
    log_w = (prox_logp - behav_logp).detach()
    w = torch.exp(log_w)
    if behav_weight_cap > 0:
        w = w.clamp(max=behav_weight_cap)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_hit = (clipped > unclipped).float()
    dual_hit = torch.zeros_like(per_token)
    if dual_clip > 0:
        bound = -dual_clip * advantages
        dual_hit = ((advantages < 0) & (per_token > bound)).float()
        per_token = torch.where(advantages < 0, torch.minimum(per_token, bound), per_token)
    loss = masked_mean(w * per_token, mask)
    stats = {
        "clip_frac": masked_mean(clip_hit, mask).item(),
        "dual_clip_frac": masked_mean(dual_hit, mask).item(),
        "importance_weight_mean": masked_mean(w, mask).item(),
        "kl_behav_prox": masked_mean(-log_w, mask).item(),
    }
    return loss, stats
