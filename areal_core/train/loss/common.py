"""The math every loss shares: pure functions over per-token tensors [N, T] (no registry here).

Notation per policy token t of sample i (mask = 1 on policy tokens):
  π_θ (logp, with gradient), π_prox (prox_logp: the trainer's parameters before this update),
  π_behav (behav_logp: logged by the inference engine), A (advantages).
Aggregation of a per-token term x (see `aggregate`):
  token_mean               Σ_it x·m / Σ_it m                       (DAPO, the default)
  seq_mean_token_mean      (1/N') Σ_i [Σ_t x·m / Σ_t m]            (GRPO paper, GSPO)
  seq_mean_token_sum_norm  (1/N') Σ_i [Σ_t x·m / C], C constant    (Dr.GRPO)
N' counts the rows holding at least one policy token.
The behaviour correction w = π_prox/π_behav (`behaviour_correction`, the formula in its docstring)
is one step every policy loss takes through `LossInputs.behaviour(cfg)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from areal_core.config.algorithm import AGGREGATIONS, BEHAV_CORRECTIONS, BEHAV_LEVELS, KL_ESTIMATORS

# decoupled PPO's control of the staleness study (`algo.decoupled_ppo.behav_clip_drop`, `drop_clipped`)
BehavClipDrop = Literal["none", "positive", "both"]
BEHAV_CLIP_DROPS: tuple[str, ...] = get_args(BehavClipDrop)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ x·m / max(Σ m, 1): the token-mean over the batch."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def aggregate(
    x: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mean",
    norm_const: float = 0.0,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token term to a scalar (modes in the module docstring).

    `norm_const` is Dr.GRPO's C (the generation budget in tokens); 0 falls back to the longest
    row's policy-token count, which is not constant across batches. `global_tokens` /
    `global_seqs` replace the batch's own token / sequence count so that micro-batch losses of
    one batch sum to the full-batch loss (gradient accumulation).
    """
    m = mask.float()
    per_row_tokens = m.sum(1)
    n_seqs = global_seqs if global_seqs is not None else (per_row_tokens > 0).sum().clamp(min=1)
    if mode == "token_mean":
        n_tok = global_tokens if global_tokens is not None else m.sum().clamp(min=1)
        return (x * m).sum() / n_tok
    if mode == "seq_mean_token_mean":
        return ((x * m).sum(1) / per_row_tokens.clamp(min=1)).sum() / n_seqs
    if mode == "seq_mean_token_sum_norm":
        c = norm_const if norm_const > 0 else per_row_tokens.max().clamp(min=1)
        return (x * m).sum() / c / n_seqs
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")


def per_row(log_x: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Token-level log values, or their row sum / row mean broadcast over the row."""
    if level == "token":
        return log_x
    m = mask.float()
    s = (log_x * m).sum(1, keepdim=True)
    if level == "sequence":
        return s.expand_as(log_x)
    if level == "geometric":
        return (s / m.sum(1, keepdim=True).clamp(min=1)).expand_as(log_x)
    raise ValueError(f"unknown level {level!r}; expected one of {BEHAV_LEVELS}")


def usable_behaviour(prox_logp: torch.Tensor, behav_logp: torch.Tensor) -> torch.Tensor:
    """1[log π_behav and log π_prox are finite]: a token an engine reported as impossible (−inf) or
    as NaN has no importance weight and is masked out of the policy loss."""
    return (torch.isfinite(behav_logp) & torch.isfinite(prox_logp)).float()


def behaviour_kl(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """KL(behaviour‖proximal) estimated as mean(log π_behav − log π_prox) over the usable policy tokens."""
    ok = mask.float() * usable_behaviour(prox_logp, behav_logp)
    return masked_mean(torch.where(ok > 0, behav_logp - prox_logp, 0.0).detach(), ok).item()


def behaviour_abs_diff(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """mean |log π_behav − log π_prox| over the usable policy tokens: the engine/trainer mismatch."""
    ok = mask.float() * usable_behaviour(prox_logp, behav_logp)
    return masked_mean(torch.where(ok > 0, behav_logp - prox_logp, 0.0).detach().abs(), ok).item()


@dataclass(frozen=True)
class Behaviour:
    """The behaviour correction of a batch (`behaviour_correction`): what every policy loss reads.

    w       π_prox/π_behav as configured, 0 where keep = 0 (no gradient)
    keep    1 on the tokens that carry weight (not masked, log-probs finite)
    usable  1 where log π_behav and log π_prox are finite
    stats   importance_weight_mean/max/min over the kept policy tokens; behav_truncated_frac,
            behav_masked_frac, behav_nonfinite_frac over the policy tokens; sampled_entropy, the
            mean −log π_behav of the sampled tokens (a Monte Carlo estimate of the sampling
            policy's per-token entropy)
    kl      KL(behaviour‖proximal), `behaviour_kl` (the metric `kl_behav_prox`)
    """

    w: torch.Tensor
    keep: torch.Tensor
    usable: torch.Tensor
    stats: dict[str, float]
    kl: float

    def anchor(self, old_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """log π_old where usable, log π_θ (detached) elsewhere: r = π_θ/π_old = 1 and no NaN where w = 0."""
        return torch.where(self.usable > 0, old_logp, logp.detach())

    def metrics(self) -> dict[str, float]:
        """`stats` and `kl_behav_prox`."""
        return {**self.stats, "kl_behav_prox": self.kl}


def behaviour_correction(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "truncate",
    low: float = 0.0,
    high: float = 0.0,
    level: str = "token",
) -> Behaviour:
    """The behaviour-policy correction w ≈ π_prox/π_behav (no gradient), shared by every policy loss.

    level: token ρ_t = π_prox(t)/π_behav(t); sequence ρ_i = Π_t ρ_t; geometric ρ_i = (Π_t ρ_t)^(1/|y_i|).
    mode:  none      w = 1
           truncate  w = min(ρ, high)   (truncated importance sampling; high ≤ 0: uncapped, w = ρ)
           mask      w = ρ·1[low ≤ ρ ≤ high], keep = 1[low ≤ ρ ≤ high]   (IcePop; AReaL's token mask
                     with low = 0, high = 5; high ≤ 0: no upper bound, low ≤ 0: no lower bound).
                     Masked tokens contribute 0 but stay in the aggregation's denominator.
    In every mode a token whose log π_behav (or log π_prox) is not finite is masked (keep = 0,
    w = 0) and left out of the sequence-level products: ρ = +inf would otherwise hit the cap.
    """
    m = mask.float()
    usable = usable_behaviour(prox_logp, behav_logp)
    log_rho_tok = torch.where(usable > 0, (prox_logp - behav_logp).detach().float(), 0.0)
    log_rho = per_row(log_rho_tok, m * usable, level)
    keep = usable.clone()
    truncated = torch.zeros_like(log_rho)
    if mode == "none":
        w = torch.ones_like(log_rho)
    elif mode == "truncate":
        if high > 0:
            truncated = (log_rho > math.log(high)).float() * usable
            log_rho = log_rho.clamp(max=math.log(high))
        w = torch.exp(log_rho.clamp(max=80.0))
    elif mode == "mask":
        if low > 0:
            keep = keep * (log_rho >= math.log(low)).float()
        if high > 0:
            keep = keep * (log_rho <= math.log(high)).float()
        w = torch.exp(log_rho.clamp(max=80.0))
    else:
        raise ValueError(f"unknown behaviour correction {mode!r}; expected one of {BEHAV_CORRECTIONS}")
    w = torch.where(keep > 0, w, 0.0)
    kept = m * keep
    on = kept > 0
    wm = w[on] if on.any() else w.new_ones(1)
    stats = {
        "importance_weight_mean": masked_mean(w, kept).item(),
        "importance_weight_max": wm.max().item(),
        "importance_weight_min": wm.min().item(),
        "behav_truncated_frac": masked_mean(truncated, m).item(),
        "behav_masked_frac": masked_mean(1 - keep, m).item(),
        "behav_nonfinite_frac": masked_mean(1 - usable, m).item(),
        "sampled_entropy": masked_mean(torch.where(usable > 0, -behav_logp.detach().float(), 0.0), m * usable).item(),
    }
    return Behaviour(w, keep, usable, stats, behaviour_kl(prox_logp, behav_logp, m))


def drop_clipped(
    b: Behaviour,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    eps_low: float,
    eps_high: float,
) -> Behaviour:
    """`b` with the tokens naive PPO's clip against π_behav would remove also dropped (w = 0, keep = 0),
    with the token ratio ρ = π_prox/π_behav (uncapped):

        positive  drop A > 0 with ρ > 1 + ε_high
        both      also A < 0 with ρ < 1 − ε_low

    With one minibatch (π_θ = π_prox at the update) decoupled PPO with w uncapped and `both` has naive
    PPO's gradient (tests/test_clip_drop.py): the control that tells whether naive PPO's clip, acting
    as a one-sided filter on stale tokens, is what separates the two (`algo.decoupled_ppo.behav_clip_drop`).
    The dropped share is `behav_clip_dropped_frac`; dropped tokens stay in the denominator."""
    if mode == "none":
        return b
    rho = torch.exp(torch.where(b.usable > 0, (prox_logp - behav_logp).detach().float(), 0.0))
    drop = (advantages > 0) & (rho > 1 + eps_high)
    if mode == "both":
        drop = drop | ((advantages < 0) & (rho < 1 - eps_low))
    elif mode != "positive":
        raise ValueError(f"unknown behav_clip_drop {mode!r}; expected one of {BEHAV_CLIP_DROPS}")
    drop = drop.float() * b.keep
    keep = b.keep * (1 - drop)
    stats = {**b.stats, "behav_clip_dropped_frac": masked_mean(drop, mask.float()).item()}
    return Behaviour(torch.where(keep > 0, b.w, 0.0), keep, b.usable, stats, b.kl)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3", clamp: float = 10.0) -> torch.Tensor:
    """Per-token estimate of KL(π_θ‖π_ref) from samples of π_θ, with x = log π_θ − log π_ref:

    k1 = x,   k2 = ½ x²,   k3 = e^{−x} − 1 + x   (Schulman's unbiased, non-negative estimator).
    k3 clamps x to [−20, 20] and the result to ≤ `clamp` for stability (≤ 0: no clamp).
    """
    x = logp - ref_logp
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x**2
    if estimator == "k3":
        x = x.clamp(-20, 20)
        k3 = torch.exp(-x) - 1 + x
        return k3.clamp(max=clamp) if clamp > 0 else k3
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def sequence_logprobs(logp: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """log π(y_i) = Σ_t logp·m per row, or the per-token average when `average`."""
    m = mask.float()
    s = (logp * m).sum(1)
    return s / m.sum(1).clamp(min=1) if average else s
