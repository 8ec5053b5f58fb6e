"""Advantage estimators: pure functions over reward tensors.

Scalar-reward estimators take `rewards[N]` and `group_ids[N]` (the n samples of one prompt
share a group id) and return one advantage per sample; the caller broadcasts it over the
sample's policy tokens. Token-level estimators take per-token rewards `[N, T]` and the
policy-token `mask[N, T]` and return `[N, T]` (zero off the mask). Time steps are the
policy tokens of a row in order; non-policy tokens in between (tool output, a user turn)
are skipped, not counted as steps.
"""

from __future__ import annotations

import torch

# estimators that read a critic's values (and give returns): they add the critic's value loss
CRITIC_ESTIMATORS = frozenset({"gae"})


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO group-normalised advantage per sample.

    A_i = (r_i − mean_g(r)) / (std_g(r) + eps), over the samples i of group g (population std).
    A group whose rewards are all equal gets A = 0 for every sample.
    """
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx].float()
        if bool(r.max() == r.min()):  # exactly 0: the float mean of equal values can miss them by an ulp, which
            continue  # divided by (std ≈ 0) + eps is an advantage of ~0.06 (0.7 × 8 in float32)
        adv[idx] = (r - r.mean()) / (r.std(unbiased=False) + eps)
    return adv


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group sum, group size, group mean) of the sample's group, shape [N] each.

    A group whose rewards are all equal has that reward as its mean, exactly: a float sum of n equal values can
    miss n·r by an ulp, and r − mean would then be a nonzero advantage (rescaled by a std of ~0 under GRPO)."""
    r = rewards.float()
    _, inv = torch.unique(group_ids, return_inverse=True)
    k = int(inv.max().item()) + 1 if inv.numel() else 0
    sums = torch.zeros(k, dtype=r.dtype, device=r.device).index_add_(0, inv, r)
    counts = torch.zeros(k, dtype=r.dtype, device=r.device).index_add_(0, inv, torch.ones_like(r))
    hi = torch.full((k,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, inv, r, "amax")
    lo = torch.full((k,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, inv, r, "amin")
    mean = torch.where((hi == lo)[inv], r, (sums / counts)[inv])
    return sums[inv], counts[inv], mean


def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: A_i = r_i − mean_g(r); no division by the group std (removes the difficulty bias).

    Pair with the constant-normaliser aggregation (no per-sequence length normalisation).
    """
    _, _, mean = group_stats(rewards, group_ids)
    return rewards.float() - mean


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: A_i = r_i − (Σ_{j∈g, j≠i} r_j) / (n_g − 1), the leave-one-out mean of the others.

    Equivalently A_i = n_g/(n_g − 1) · (r_i − mean_g(r)); the advantages of a group sum to 0.
    A group of one sample has no baseline and gets A = 0.
    """
    r = rewards.float()
    sums, counts, mean = group_stats(r, group_ids)
    baseline = (sums - r) / (counts - 1).clamp(min=1)
    # r_i = mean_g gives A_i = 0 exactly (an equal-reward group: its float sum may miss n·r by an ulp)
    return torch.where((counts > 1) & (r != mean), r - baseline, torch.zeros_like(r))


def lite_ppo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LitePPO ("Tricks or Traps", 2025): group-mean baseline, batch-level std.

    A_i = (r_i − mean_g(r)) / (std_batch(r) + eps), std over all N samples (population std).
    """
    r = rewards.float()
    _, _, mean = group_stats(r, group_ids)
    return (r - mean) / (r.std(unbiased=False) + eps)


def broadcast(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A[N] -> A[N, T] on the policy tokens, 0 elsewhere."""
    return per_sample.float()[:, None] * mask.float()


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scalar rewards[N] placed on the last policy token of each row: [N, T]."""
    m = mask.float()
    out = torch.zeros_like(m)
    T = m.shape[1]
    has = m.sum(1) > 0
    last = (T - 1) - torch.flip(m, dims=[1]).argmax(1)  # index of the last 1 in each row
    rows = torch.nonzero(has).squeeze(1)
    out[rows, last[rows]] = rewards.float()[rows]
    return out


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, shift_mean: bool = True) -> torch.Tensor:
    """(x − mean) / (std + eps) over the masked entries (population std); 0 off the mask."""
    m = mask.float()
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    out = (x - mean) if shift_mean else x
    return out / (var.sqrt() + eps) * m


def batch_norm_advantages(rewards: torch.Tensor, mask: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """AReaL's paper: the outcome reward normalised over the batch's policy tokens, no group baseline; [N, T].

    A_{i,t} = (r_i − μ) / (σ + eps) on the policy tokens of row i (0 elsewhere), with n_i the row's
    policy tokens,  μ = Σ_i n_i·r_i / Σ_i n_i,  σ² = Σ_i n_i·(r_i − μ)² / Σ_i n_i  (population std).
    This is AReaL's `masked_normalization` (eps 1e-5) of its GAE(γ = 1, λ = 1, V = 0) returns, which
    are r_i on every policy token of row i, so a longer answer weighs more in μ and σ (the paper's
    config: `adv_norm: true`, `group_adv_norm: false`, no group reward normalisation).
    """
    return masked_whiten(broadcast(rewards, mask), mask, eps)


def group_batch_norm_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """AReaL's GSM8K example (v1.0.4 examples/math/gsm8k_grpo.yaml: `reward_norm` mean and std at the
    group level, then `adv_norm` mean and std at the batch level); [N, T].

    r'_i = (r_i − mean_g r) / (std_g r + eps), std_g with Bessel's correction (n_g − 1; AReaL's
    `std_unbiased`), a group of one or of equal rewards giving r' = 0; then
    A = `batch_norm_advantages`(r'): (r'_i − μ') / (σ' + eps) over the batch's policy tokens.
    """
    r = rewards.float()
    _, counts, mean = group_stats(r, group_ids)
    sq, _, _ = group_stats((r - mean) ** 2, group_ids)
    std = (sq / (counts - 1).clamp(min=1)).sqrt()
    centred = r - mean
    return batch_norm_advantages(torch.where(std > 0, centred / (std + eps), 0.0), mask, eps)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = Σ_{s ≥ t} γ^{k(s) − k(t)} r_s over the policy tokens of a row (k counts policy tokens)."""
    m = mask.float()
    out = torch.zeros_like(m)
    running = m.new_zeros(m.shape[0])
    for t in range(m.shape[1] - 1, -1, -1):
        on = m[:, t] > 0
        running = torch.where(on, token_rewards[:, t].float() + gamma * running, running)
        out[:, t] = running * m[:, t]
    return out


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): A_t = whiten_batch(G_t), G_t the discounted return-to-go.

    token_rewards[N, T] holds the outcome reward on the last policy token (see `terminal_rewards`)
    and any per-token shaping (−β·KL); the returns are normalised over all policy tokens of the
    batch: (G − mean) / (std + eps).
    """
    return masked_whiten(discounted_returns(token_rewards, mask, gamma), mask, eps)


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    token_penalty: torch.Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++ with baseline: subtract the group mean from the outcome reward first.

    r'_i = r_i − mean_g(r); token rewards = terminal(r') + token_penalty; A = whiten_batch(G).
    """
    _, _, mean = group_stats(rewards, group_ids)
    tr = terminal_rewards(rewards.float() - mean, mask)
    if token_penalty is not None:
        tr = tr + token_penalty * mask.float()
    return reinforce_pp_advantages(tr, mask, gamma, eps)


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation with a value head; returns (advantages, returns), [N, T].

    Over the policy tokens t of a row (next(t) the next policy token, V = 0 after the last one):
      δ_t = r_t + γ·V_next(t) − V_t,   A_t = δ_t + γλ·A_next(t),   R_t = A_t + V_t.
    `values` are the critic's predictions before the update (no gradient flows through them).
    """
    m = mask.float()
    v = values.detach().float()
    r = token_rewards.float()
    adv = torch.zeros_like(m)
    next_v = m.new_zeros(m.shape[0])
    next_a = m.new_zeros(m.shape[0])
    for t in range(m.shape[1] - 1, -1, -1):
        on = m[:, t] > 0
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * next_a
        next_a = torch.where(on, a, next_a)
        next_v = torch.where(on, v[:, t], next_v)
        adv[:, t] = a * m[:, t]
    return adv, (adv + v) * m
