"""On-policy distillation: a teacher's per-token log-probs as a reverse-KL signal, alone or added to the RL loss.

Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes"
(GKD, ICLR 2024, arXiv:2306.13649) and Gu et al., "MiniLLM" (ICLR 2024, arXiv:2306.08543): train
the student π_θ on its own samples to minimise the reverse KL to the teacher π_T,

    D_KL(π_θ‖π_T) = E_{y∼π_θ}[ Σ_t log π_θ(y_t|y_<t) − log π_T(y_t|y_<t) ],

and Xu et al., "KDRL: Post-Training Reasoning LLMs via Unified Knowledge Distillation and
Reinforcement Learning" (2025, arXiv:2506.02208), J_KDRL = J_GRPO − β·D_KL(π_θ‖π_T), as AReaL
implements both (docs/en/algorithms/distillation.md; `teacher.rl_loss_weight`,
`teacher.distill_loss_weight`). Per sampled token, with d_t = sg(log π_θ(t) − log π_T(t)), the
per-token reverse-KL estimate, r = π_θ/π_prox and w = π_prox/π_behav (`algo.behav_correction`):

    L_KD = agg( w · r · d_t ),      ∇L_KD = agg( w · r · d_t · ∇log π_θ(t) ),
    L    = c_RL · L_decoupled_PPO + β_KD · L_KD,     c_RL = `algo.distill.rl_coef`, β_KD = `algo.distill.coef`.

On policy (w = r = 1) ∇L_KD = mean_t (log π_θ − log π_T)·∇log π_θ, the score-function gradient of
the per-token reverse KL (E_{y_t∼π_θ}[∇log π_θ(y_t)] = 0 removes the pathwise term), i.e.
REINFORCE with −d_t as each token's advantage; its value is the k1 estimate mean_t d_t. This is
AReaL's pure-distillation form (`rl_loss_weight: 0`: −coef·Σ iw·(log π_T − sg log π_θ), iw =
π_θ/π_behav). With the RL loss AReaL adds β·mean_t (log π_θ − log π_T) with the gradient through
log π_θ, whose gradient β·∇log π_θ has zero mean on policy (Tang & Munos, "On a few pitfalls in
KL divergence gradient estimation for RL", 2025): here the joint loss uses the score-function term
above for both. `c_RL = 0` is distillation alone (the RL advantages are still
computed, and unused).
The teacher is any model with the policy's tokenizer (`algo.distill.teacher_path`; empty: the initial
checkpoint, as the reference model); the trainer computes its log-probs at the rollout
temperature like π_ref's. A token with a non-finite log π_behav, log π_prox or log π_T is masked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field

from areal_core.config.base import Float, Str
from areal_core.train.loss.common import masked_mean
from areal_core.train.loss.decoupled_ppo import decoupled_ppo_loss
from areal_core.train.loss.registry import Loss, LossInputs, LossSettings, register

if TYPE_CHECKING:
    from areal_core.config.algorithm import AlgorithmConfig


class DistillSettings(LossSettings):
    """`algo.distill.*` (AReaL's `teacher.distill_loss_weight`, `teacher.rl_loss_weight`)."""

    teacher_path: Str = Field(
        "",
        description="the teacher: a folder or URI of an HF checkpoint with the policy's tokenizer, loaded like "
        "π_ref; empty: the initial checkpoint",
    )
    coef: Float = Field(0.1, ge=0, description="β_KD, the weight of the reverse-KL distillation term")
    rl_coef: Float = Field(1.0, ge=0, description="the weight of the RL (decoupled PPO) loss; 0: distillation alone")


def distill_term(cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """L_KD = agg(w · r · sg(log π_θ − log π_T)), r = π_θ/π_prox, w = π_prox/π_behav (`x.behaviour(cfg)`),
    π_T = `x.teacher_logp`. Returns (L_KD, stats): `distill_rkl` (mean_t log π_θ − log π_T over the
    kept tokens, the k1 estimate of the per-token reverse KL), importance-weight statistics
    (prefixed `distill_`) and KL(behaviour‖proximal)."""
    b = x.behaviour(cfg)
    ok = b.usable * torch.isfinite(x.teacher_logp).float()
    w, keep = torch.where(ok > 0, b.w, 0.0), b.keep * ok
    prox_logp = torch.where(ok > 0, x.prox_logp, x.logp.detach())  # r = 1, d = 0 where w = 0
    d = torch.where(ok > 0, x.logp.detach() - x.teacher_logp, 0.0)
    ratio = torch.exp(x.logp - prox_logp)
    loss = x.reduce(w * ratio * d, cfg)
    stats = {
        "distill_rkl": masked_mean(d, x.mask.float() * keep).item(),
        **{f"distill_{k}": v for k, v in b.stats.items()},
        "kl_behav_prox": b.kl,
    }
    return loss, stats


@register
class OnPolicyDistillation(Loss):
    """L = `algo.distill.rl_coef` · decoupled PPO + `algo.distill.coef` · agg(w·r·sg(log π_θ − log π_T))
    on the student's own samples (the module docstring); the teacher's log-probs come from
    `algo.distill.teacher_path`, computed by the trainer like the reference model's."""

    name = "distill"
    Settings = DistillSettings
    needs = frozenset({"advantages", "teacher_logp"})
    level = "token"

    def __call__(self, cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        settings = DistillSettings.of(cfg)
        kd, stats = distill_term(cfg, x)
        loss = settings.coef * kd
        stats["loss_distill"] = kd.item()
        if settings.rl_coef > 0:
            rl, rl_stats = decoupled_ppo_loss(cfg, x)
            loss = loss + settings.rl_coef * rl
            stats.update(rl_stats, loss_rl=rl.item())
        return loss, stats
