"""An RL algorithm as configuration: advantage estimator + normalisation + aggregation + loss.

    cfg = from_preset("dapo")                            # the config: areal_core/config/algorithm.py
    adv, returns, m1 = compute_advantages(cfg, rewards, group_index, loss_mask)       # whole batch
    loss, m2 = compute_loss(cfg, logp, prox_logp, behav_logp, rewards, group_index, loss_mask,
                            advantages=adv)                                          # per minibatch

`required_inputs(cfg)` says which optional tensors the trainer must compute (reference-model
log-probs, critic values, entropy). The tensor code is imported inside the functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_core.config.algorithm import AlgorithmConfig

if TYPE_CHECKING:
    import torch

TOKEN_LEVEL_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")


def required_inputs(cfg: AlgorithmConfig) -> set[str]:
    """Optional tensors the trainer must provide: 'ref_logp', 'values' (+ 'old_values'), 'entropy'."""
    need = set()
    if cfg.kl_coef > 0 or cfg.loss in ("dpo", "ipo"):
        need.add("ref_logp")
    if cfg.adv_estimator == "gae" and cfg.loss not in ("dpo", "ipo"):
        need |= {"values", "old_values"}
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
    from areal_core.train.losses import kl_penalty

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


def _preference(cfg, logp, ref_logp, rewards, group_index, mask):
    """Rows as preference pairs: each group of exactly two samples with different rewards; the
    higher reward is the chosen response. Other groups are ignored."""
    import torch

    from areal_core.train.losses import preference_loss, sequence_logprobs

    avg = cfg.loss == "ipo"
    pi = sequence_logprobs(logp, mask, average=avg)
    ref = sequence_logprobs(ref_logp.detach(), mask, average=avg)
    chosen, rejected = [], []
    for g in torch.unique(group_index):
        idx = torch.nonzero(group_index == g).squeeze(1)
        if idx.numel() != 2 or rewards[idx[0]] == rewards[idx[1]]:
            continue
        hi = int(rewards[idx[1]] > rewards[idx[0]])
        chosen.append(idx[hi])
        rejected.append(idx[1 - hi])
    if not chosen:
        return logp.sum() * 0.0, {"pref_pairs": 0.0}
    c, r = torch.stack(chosen), torch.stack(rejected)
    loss, stats = preference_loss(pi[c], pi[r], ref[c], ref[r], cfg.dpo_beta, cfg.loss, cfg.dpo_label_smoothing)
    return loss, {**stats, "pref_pairs": float(len(chosen))}


def compute_loss(
    cfg: AlgorithmConfig,
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    old_values: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    returns: torch.Tensor | None = None,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Total loss of one (mini/micro-)batch and its metrics.

    Tensors are [N, T] aligned with input positions (logp[:, t] = log π(x_t | x_<t)), rewards and
    group_index [N]. logp carries the gradient; prox_logp, behav_logp, ref_logp and old_values
    are constants. values[:, t] is the critic's estimate for the state that emits token t (with
    gradient), entropy[:, t] the policy entropy there (with gradient, for the bonus).
    `advantages` / `returns`: precomputed on the whole batch by `compute_advantages` (recommended
    when the batch is split); otherwise computed here from these rows.
    `global_tokens` / `global_seqs`: denominators of the whole batch for gradient accumulation.
      loss = policy + β_kl·KL(π_θ‖π_ref) [unless kl_as_reward] − c_ent·H + c_v·critic
    """
    from areal_core.train.losses import (
        aggregate,
        behaviour_kl,
        critic_loss,
        decoupled_ppo_loss,
        kl_penalty,
        masked_mean,
    )

    mask = loss_mask.float()
    agg = {
        "mode": cfg.aggregation,
        "norm_const": cfg.norm_const,
        "global_tokens": global_tokens,
        "global_seqs": global_seqs,
    }
    metrics: dict[str, float] = {}
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError("algo.kl_coef > 0 needs ref_logp (reference-model log-probs)")
    if cfg.loss in ("dpo", "ipo"):
        if ref_logp is None:
            raise ValueError(f"algo.loss={cfg.loss} needs ref_logp (reference-model log-probs)")
        loss, m = _preference(cfg, logp, ref_logp, rewards, group_index, mask)
        metrics.update(m)
        policy = loss
    else:
        if advantages is None:
            vals0 = old_values if old_values is not None else (values.detach() if values is not None else None)
            advantages, returns, m = compute_advantages(
                cfg, rewards, group_index, mask, prox_logp=prox_logp, ref_logp=ref_logp, old_values=vals0
            )
            metrics.update(m)
        else:
            metrics.update(_masked_stats("adv", advantages, mask))
        common = {
            "behav_correction": cfg.behav_correction,
            "behav_low": cfg.behav_low,
            "behav_high": cfg.behav_high,
            "behav_level": cfg.behav_level,
            "aggregation": cfg.aggregation,
            "norm_const": cfg.norm_const,
            "global_tokens": global_tokens,
            "global_seqs": global_seqs,
        }
        old = prox_logp
        if cfg.loss == "ppo":  # naive PPO: the behaviour policy is the old policy, no correction
            old, common["behav_correction"] = behav_logp, "none"
        policy, m = decoupled_ppo_loss(
            logp,
            old,
            behav_logp,
            advantages,
            mask,
            cfg.eps_low,
            cfg.eps_high,
            cfg.dual_clip,
            ratio_level="sequence" if cfg.loss in ("gspo", "gspo_token") else "token",
            seq_advantage=cfg.loss == "gspo",
            **common,
        )
        metrics.update(m)
        metrics["kl_behav_prox"] = behaviour_kl(prox_logp, behav_logp, mask)
    loss = policy
    metrics["loss_policy"] = policy.item()
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp.detach(), cfg.kl_estimator)
        metrics["kl_ref"] = masked_mean(kl.detach(), mask).item()
        if cfg.kl_coef > 0 and not cfg.kl_as_reward and cfg.loss not in ("dpo", "ipo"):
            kl_term = aggregate(kl, mask, **agg)
            loss = loss + cfg.kl_coef * kl_term
            metrics["loss_kl"] = kl_term.item()
    if entropy is not None:
        ent = aggregate(entropy, mask, **agg)
        metrics["entropy"] = masked_mean(entropy.detach(), mask).item()
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent
    if cfg.adv_estimator == "gae" and cfg.loss not in ("dpo", "ipo"):
        if values is None or returns is None:
            raise ValueError(
                "algo.adv_estimator=gae needs values (with gradient), old_values, and returns "
                "when advantages are passed in (both come from compute_advantages)"
            )
        old_v = old_values if old_values is not None else values.detach()
        vloss, m = critic_loss(
            values,
            old_v.detach(),
            returns.detach(),
            mask,
            cfg.value_clip,
            cfg.aggregation,
            norm_const=cfg.norm_const,
            global_tokens=global_tokens,
            global_seqs=global_seqs,
        )
        metrics.update(m)
        loss = loss + cfg.value_coef * vloss
    metrics["loss"] = loss.item()
    metrics["policy_tokens"] = mask.sum().item()
    return loss, metrics
