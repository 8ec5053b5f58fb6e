"""An RL algorithm as configuration: advantage estimator + normalisation + aggregation + loss.

    cfg = AlgorithmConfig(**PRESETS["dapo"])
    adv, returns, m1 = compute_advantages(cfg, rewards, group_index, loss_mask)       # whole batch
    loss, m2 = compute_loss(cfg, logp, prox_logp, behav_logp, rewards, group_index, loss_mask,
                            advantages=adv)                                          # per minibatch

`required_inputs(cfg)` says which optional tensors the trainer must compute (reference-model
log-probs, critic values, entropy). Module import stays torch-free so that `areal_core.config`
can embed `AlgorithmConfig`; the tensor code is imported inside the functions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ADV_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "lite_ppo", "gae")
TOKEN_LEVEL_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")
LOSSES = ("decoupled_ppo", "ppo", "gspo", "dpo", "ipo")


@dataclass
class AlgorithmConfig:
    # advantages
    adv_estimator: str = "grpo"  # grpo|dr_grpo|rloo|reinforce_pp|reinforce_pp_baseline|lite_ppo|gae
    adv_whiten: bool = False  # extra masked batch whitening of token advantages (PPO with critic)
    adv_clip: float = 0.0  # clamp |A| to this; 0 disables
    gamma: float = 1.0  # discount (reinforce_pp*, gae)
    lam: float = 1.0  # GAE λ
    # policy loss
    loss: str = "decoupled_ppo"  # decoupled_ppo|ppo (naive, ratio to π_behav)|gspo|dpo|ipo
    aggregation: str = "token_mean"  # token_mean|seq_mean_token_mean|seq_mean_token_sum_norm
    norm_const: float = 0.0  # Dr.GRPO constant C in tokens (0: longest response in the batch)
    eps_low: float = 0.2
    eps_high: float = 0.28  # DAPO clip-higher
    dual_clip: float = 0.0  # 0 disables; else c > 1
    # behaviour-policy correction w = π_prox/π_behav
    behav_correction: str = "truncate"  # none|truncate|mask (IcePop)
    behav_low: float = 0.0  # mask: lower bound on w (0: none)
    behav_high: float = 5.0  # truncate: cap on w; mask: upper bound (0: none)
    behav_level: str = "token"  # token|sequence|geometric
    # regularisers
    kl_coef: float = 0.0  # β for KL(π_θ‖π_ref); needs reference log-probs when > 0
    kl_estimator: str = "k3"  # k1|k2|k3
    kl_as_reward: bool = False  # True: −β·KL shapes the reward; False: +β·KL is a loss term
    entropy_coef: float = 0.0  # loss −= coef · entropy
    # critic (adv_estimator = gae)
    value_coef: float = 0.5
    value_clip: float = 0.2  # 0 disables value clipping
    critic_lr: float = 0.0  # critic's AdamW learning rate; 0: train.lr (areal_core/train/value_head.py)
    # preference pairs (loss = dpo|ipo)
    dpo_beta: float = 0.1
    dpo_label_smoothing: float = 0.0
    # data shaping
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal
    overlong_max_len: int = 0  # DAPO L_max in response tokens; 0 disables the overlong penalty
    overlong_buffer: int = 0  # DAPO L_cache
    overlong_penalty: float = 1.0  # penalty factor
    reward_scale: float = 1.0
    reward_bias: float = 0.0
    reward_clip: float = 0.0  # 0 disables

    def validate(self) -> AlgorithmConfig:
        """Raise ValueError naming the first bad key (as `algo.<key>`)."""
        from areal_core.train.losses import AGGREGATIONS, BEHAV_CORRECTIONS, BEHAV_LEVELS, KL_ESTIMATORS

        choices = {
            "adv_estimator": ADV_ESTIMATORS,
            "loss": LOSSES,
            "aggregation": AGGREGATIONS,
            "behav_correction": BEHAV_CORRECTIONS,
            "behav_level": BEHAV_LEVELS,
            "kl_estimator": KL_ESTIMATORS,
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"config key 'algo.{key}' must be one of {list(allowed)}, got {getattr(self, key)!r}")
        non_negative = [
            "adv_clip", "norm_const", "behav_low", "behav_high", "kl_coef", "entropy_coef", "value_coef",
            "value_clip", "critic_lr", "overlong_max_len", "overlong_buffer", "reward_clip", "dual_clip",
        ]  # fmt: skip
        for key in non_negative:
            if getattr(self, key) < 0:
                raise ValueError(f"config key 'algo.{key}' must be >= 0, got {getattr(self, key)!r}")
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ValueError("config keys 'algo.eps_low' must be in [0, 1) and 'algo.eps_high' >= 0")
        if self.dual_clip and self.dual_clip <= 1:
            raise ValueError(f"config key 'algo.dual_clip' must be 0 (off) or > 1, got {self.dual_clip}")
        if not (0 < self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError("config keys 'algo.gamma' must be in (0, 1] and 'algo.lam' in [0, 1]")
        if self.behav_correction == "mask" and self.behav_high and self.behav_low >= self.behav_high:
            raise ValueError("config key 'algo.behav_low' must be < 'algo.behav_high' for masking")
        if self.overlong_buffer > self.overlong_max_len:
            raise ValueError("config key 'algo.overlong_buffer' must be <= 'algo.overlong_max_len'")
        if self.dpo_beta <= 0:
            raise ValueError(f"config key 'algo.dpo_beta' must be > 0, got {self.dpo_beta}")
        return self


PRESETS: dict[str, dict[str, Any]] = {
    # today's trainer: GRPO advantages, decoupled PPO, token-mean, DAPO clip-higher, w capped at 5
    "grpo": {},
    "dr_grpo": {
        "adv_estimator": "dr_grpo",
        "aggregation": "seq_mean_token_sum_norm",
        "eps_high": 0.2,
    },
    # overlong sizes fit the embedded task (rollout.max_new_tokens = 24); scale with the budget
    "dapo": {
        "adv_estimator": "grpo",
        "eps_high": 0.28,
        "dynamic_sampling": True,
        "overlong_max_len": 24,
        "overlong_buffer": 6,
        "overlong_penalty": 1.0,
    },
    "rloo": {"adv_estimator": "rloo", "eps_high": 0.2},
    "reinforce_pp": {
        "adv_estimator": "reinforce_pp",
        "eps_high": 0.2,
        "kl_coef": 0.01,
        "kl_estimator": "k1",
        "kl_as_reward": True,
    },
    "reinforce_pp_baseline": {
        "adv_estimator": "reinforce_pp_baseline",
        "eps_high": 0.2,
        "kl_coef": 0.01,
        "kl_estimator": "k2",
    },
    "gspo": {
        "loss": "gspo",
        "aggregation": "seq_mean_token_mean",
        "eps_low": 3e-4,
        "eps_high": 4e-4,
        "behav_level": "geometric",
    },
    "lite_ppo": {"adv_estimator": "lite_ppo", "aggregation": "token_mean", "eps_high": 0.2},
    "ppo_critic": {
        "adv_estimator": "gae",
        "gamma": 1.0,
        "lam": 0.95,
        "adv_whiten": True,
        "eps_high": 0.2,
        "value_coef": 0.5,
        "value_clip": 0.2,
    },
    # baselines and offline alignment
    "naive_ppo": {"loss": "ppo"},
    "icepop": {"behav_correction": "mask", "behav_low": 0.5, "behav_high": 2.0},
    "dpo": {"loss": "dpo", "dpo_beta": 0.1},
    "ipo": {"loss": "ipo", "dpo_beta": 0.1},
}


def from_preset(name: str, **overrides: Any) -> AlgorithmConfig:
    """AlgorithmConfig of a named preset, with keyword overrides; validated."""
    if name not in PRESETS:
        raise ValueError(f"unknown algorithm preset {name!r}; expected one of {sorted(PRESETS)}")
    return AlgorithmConfig(**{**PRESETS[name], **overrides}).validate()


def to_dict(cfg: AlgorithmConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


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
    from areal_core.train.losses import aggregate, critic_loss, decoupled_ppo_loss, kl_penalty, masked_mean

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
            ratio_level="sequence" if cfg.loss == "gspo" else "token",
            **common,
        )
        metrics.update(m)
        metrics["kl_behav_prox"] = masked_mean((behav_logp - prox_logp).detach(), mask).item()
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
