"""An RL algorithm as configuration: advantage estimator + normalisation + aggregation + loss.

    cfg = from_preset("dapo")                            # the config: areal_core/config/algorithm.py
    adv, returns, m1 = compute_advantages(cfg, rewards, group_index, loss_mask)       # whole batch
    loss, m2 = total_loss(cfg, LossInputs(logp=..., prox_logp=..., ..., advantages=adv[rows]))  # per minibatch
    loss, m2 = compute_loss(cfg, logp, prox_logp, behav_logp, rewards, group_index, loss_mask,
                            advantages=adv)                      # the same, tensors as arguments

The losses are the registry's (areal_core/train/loss/): `algo.loss` names one, and no code here
tests a loss's name. `required_inputs(cfg)` says which optional tensors the trainer must compute
(reference-model or teacher log-probs, critic values, entropy), as the active losses declare them. The tensor
code is imported inside the functions.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from areal_core.config.algorithm import AlgorithmConfig

if TYPE_CHECKING:
    import torch

    from areal_core.train.loss.registry import LossInputs

TOKEN_LEVEL_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")
# what the trainer computes for a loss (the rest of `Loss.needs` comes from the batch or the estimator)
TRAINER_INPUTS = frozenset({"ref_logp", "values", "old_values", "teacher_logp"})
_WHAT = {
    "ref_logp": "reference-model log-probs",
    "teacher_logp": "the teacher's log-probs (algo.distill.teacher_path)",
    "values": "the critic's values, with gradient",
    "old_values": "the critic's values before the update",
}


def check_for_model(cfg: AlgorithmConfig, model_kind: str) -> None:
    """ConfigError when the model cannot train with the algorithm: a VLM (model.kind vlm) has no
    critic path on image batches yet (docs/vlm.md)."""
    from areal_core.config import ConfigError

    if model_kind == "vlm" and (unsupported := required_inputs(cfg) & {"values"}):
        raise ConfigError(f"config key 'algo': model.kind vlm does not train with {sorted(unsupported)} yet")


def required_inputs(cfg: AlgorithmConfig) -> set[str]:
    """Optional tensors the trainer must provide: 'ref_logp', 'values' (+ 'old_values'), 'teacher_logp', 'entropy',
    as the registered losses `cfg` activates declare them (`check_algorithm`: ConfigError for an
    unknown `algo.loss`)."""
    from areal_core.train.loss.registry import active_losses

    need = {"ref_logp"} if cfg.kl_coef > 0 else set()
    for loss in active_losses(cfg):
        need |= loss.needs & TRAINER_INPUTS
    if cfg.entropy_coef > 0:
        need.add("entropy")
    return need


def _masked_stats(prefix: str, x: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    on = mask > 0
    v = x[on].detach().float() if on.any() else x.new_zeros(1).float()
    return {
        f"{prefix}_mean": v.mean().item(),
        f"{prefix}_std": v.std(unbiased=False).item(),
        f"{prefix}_min": v.min().item(),
        f"{prefix}_max": v.max().item(),
    }


def shaped_rewards(cfg: AlgorithmConfig, rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Rewards after scale/bias/clip and DAPO's overlong penalty (length = policy tokens per row)."""
    from areal_core.train.shaping import overlong_penalty, shape_rewards

    r = shape_rewards(rewards, cfg.reward_scale, cfg.reward_bias, cfg.reward_clip)
    if cfg.overlong_max_len > 0:
        r = r + overlong_penalty(
            loss_mask.float().sum(1), cfg.overlong_max_len, cfg.overlong_buffer, cfg.overlong_penalty
        )
    return r


def compute_advantages(
    cfg: AlgorithmConfig,
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    prox_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    old_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """Per-token advantages [N, T] (0 off the mask), GAE returns (else None), and metrics.

    Call on the whole batch (group and batch statistics), then slice rows per minibatch.
    With kl_as_reward, the per-token KL estimate of π_prox against π_ref (no gradient) shapes
    the reward: token-level estimators get −β·kl_t on every policy token; scalar estimators get
    r_i −= β·Σ_t kl_t before the group statistics.
    """
    from areal_core.train import advantages as A
    from areal_core.train.loss import kl_penalty

    mask = loss_mask.float()
    r = shaped_rewards(cfg, rewards, mask)
    metrics = {"reward_raw_mean": rewards.float().mean().item(), "reward_mean": r.mean().item()}
    token_penalty = None
    if cfg.kl_as_reward and cfg.kl_coef > 0:
        if ref_logp is None or prox_logp is None:
            raise ValueError("algo.kl_as_reward needs ref_logp and prox_logp")
        kl = kl_penalty(prox_logp.detach(), ref_logp.detach(), cfg.kl_estimator) * mask
        token_penalty = -cfg.kl_coef * kl
        metrics["kl_ref_reward"] = (kl.sum() / mask.sum().clamp(min=1)).item()
        if cfg.adv_estimator not in TOKEN_LEVEL_ESTIMATORS:
            r = r + token_penalty.sum(1)
    returns = None
    est = cfg.adv_estimator
    if est in ("grpo", "dr_grpo", "rloo", "lite_ppo"):
        fn = {
            "grpo": A.grpo_advantages,
            "dr_grpo": A.dr_grpo_advantages,
            "rloo": A.rloo_advantages,
            "lite_ppo": A.lite_ppo_advantages,
        }[est]
        adv = A.broadcast(fn(r, group_index), mask)
    elif est == "batch_norm":
        adv = A.batch_norm_advantages(r, mask)
    elif est == "group_batch_norm":
        adv = A.group_batch_norm_advantages(r, group_index, mask)
    elif est == "reinforce_pp":
        tr = A.terminal_rewards(r, mask) + (token_penalty if token_penalty is not None else 0)
        adv = A.reinforce_pp_advantages(tr, mask, cfg.gamma)
    elif est == "reinforce_pp_baseline":
        adv = A.reinforce_pp_baseline_advantages(r, group_index, mask, token_penalty, cfg.gamma)
    elif est == "gae":
        if old_values is None:
            raise ValueError("algo.adv_estimator=gae needs old_values (the critic before the update)")
        tr = A.terminal_rewards(r, mask) + (token_penalty if token_penalty is not None else 0)
        adv, returns = A.gae_advantages(tr, old_values, mask, cfg.gamma, cfg.lam)
    else:
        raise ValueError(f"unknown advantage estimator {est!r}")
    if cfg.adv_whiten:
        adv = A.masked_whiten(adv, mask)
    if cfg.adv_clip > 0:
        adv = adv.clamp(-cfg.adv_clip, cfg.adv_clip)
    metrics.update(_masked_stats("adv", adv, mask))
    metrics["adv_zero_frac"] = ((adv.abs() < 1e-8).float() * mask).sum().item() / max(mask.sum().item(), 1.0)
    return adv, returns, metrics


def total_loss(cfg: AlgorithmConfig, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """Total loss of one (mini/micro-)batch and its metrics, from the registered losses:

      loss = policy [`algo.loss`] + β_kl·KL(π_θ‖π_ref) [unless kl_as_reward, or the loss holds its
             own β] − c_ent·H + Σ_terms coef·term [the critic's value loss under gae]

    A loss that needs advantages gets `x.advantages`, or, when None, advantages (and returns)
    computed here from these rows (`compute_advantages` on the whole batch is recommended when
    the batch is split)."""
    from areal_core.train.loss.common import kl_penalty, masked_mean
    from areal_core.train.loss.registry import get_loss, terms

    policy = get_loss(cfg.loss)
    mask = x.mask
    metrics: dict[str, float] = {}
    if cfg.kl_coef > 0 and x.ref_logp is None:
        raise ValueError("algo.kl_coef > 0 needs ref_logp (reference-model log-probs)")
    for key in sorted(policy.needs & TRAINER_INPUTS):
        if getattr(x, key) is None:
            raise ValueError(f"algo.loss={cfg.loss} needs {key} ({_WHAT[key]})")
    if "advantages" in policy.needs:
        if x.advantages is None:
            vals0 = x.old_values if x.old_values is not None else (x.values.detach() if x.values is not None else None)
            adv, returns, m = compute_advantages(
                cfg, x.rewards, x.group_index, mask, prox_logp=x.prox_logp, ref_logp=x.ref_logp, old_values=vals0
            )
            metrics.update(m)
            x = dataclasses.replace(x, advantages=adv, returns=returns)
        else:
            metrics.update(_masked_stats("adv", x.advantages, mask))
    policy_loss, m = policy(cfg, x)
    metrics.update(m)
    loss = policy_loss
    metrics["loss_policy"] = policy_loss.item()
    if x.ref_logp is not None:
        kl = kl_penalty(x.logp, x.ref_logp.detach(), cfg.kl_estimator)
        metrics["kl_ref"] = masked_mean(kl.detach(), mask).item()
        if cfg.kl_coef > 0 and not cfg.kl_as_reward and policy.kl_term:
            kl_term = x.reduce(kl, cfg)
            loss = loss + cfg.kl_coef * kl_term
            metrics["loss_kl"] = kl_term.item()
    if x.entropy is not None:
        ent = x.reduce(x.entropy, cfg)
        metrics["entropy"] = masked_mean(x.entropy.detach(), mask).item()
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent
    for term in terms(cfg, policy):
        value, m = term(cfg, x)
        metrics.update(m)
        loss = loss + term.coef(cfg) * value
    metrics["loss"] = loss.item()
    metrics["policy_tokens"] = mask.sum().item()
    return loss, metrics


def compute_loss(
    cfg: AlgorithmConfig,
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    loss_mask: torch.Tensor,
    **optional: torch.Tensor | float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`total_loss` with the tensors as arguments: `optional` holds the other `LossInputs` fields
    (ref_logp, values, old_values, entropy, teacher_logp, advantages, returns, global_tokens, global_seqs)."""
    from areal_core.train.loss.registry import LossInputs

    x = LossInputs(
        logp=logp,
        prox_logp=prox_logp,
        behav_logp=behav_logp,
        mask=loss_mask.float(),
        rewards=rewards,
        group_index=group_index,
        **optional,
    )
    return total_loss(cfg, x)
