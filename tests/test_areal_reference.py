"""Our decoupled PPO against AReaL's own actor loss, on random tensors: loss and gradient to 1e-6 (issue 47).

The reference below restates, step by step and in the same tensor operations, two versions of
AReaL's `ppo_actor_loss_fn` (github.com/inclusionAI/AReaL, Apache-2.0):

  v1.0.4   commit 37d6c6400e99a05fa3409d6a067762a44df40d3b, areal/utils/functional/functional.py:
           `ppo_actor_loss_fn` with `apply_rejection_sampling` (`RejectionSamplingConfig`:
           level token, metric ratio, action mask | clamp, upper, lower), token-level ratio, 2D
           padded tensors; the per-token loss is divided by the loss mask's count taken *before*
           rejection sampling (masked tokens stay in the denominator). The GSM8K example of that
           release (examples/math/gsm8k_grpo.yaml) sets `rejection_sampling: {metric: ratio,
           upper: 5.0}` (action mask, level token by default); `rejection_sampling: null` is no
           behaviour weight at all.
  paper    commit ea12141f2b18fbcd130c6460e8a141c1913354de (July 2025), arealite/utils/functional.py:
           `ppo_actor_loss_fn(..., behav_imp_weight_cap)`: w = π_prox/π_behav, tokens with
           w > cap dropped (w = 0), cap None (the default, and its benchmark config
           benchmark/verl_v0_3_0_post1_76084d3/areal_config.yaml): w uncapped; its example
           configs set the cap to 5.

What is left out of the restatement: the 1D packed layout (cu_seqlens), sequence-level rejection
sampling and the KL metrics (`kl_k1..3`), GSPO's sequence ratio, and the logging dict. One
difference we keep on purpose: AReaL sets a non-finite log-ratio to 0 (w = 1); we mask such a
token (w = 0), so the inputs here are finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from areal_core.config.algorithm import AlgorithmConfig
from areal_core.train.loss import get_loss
from tests.loss_inputs import loss_inputs

N, T = 6, 9


@dataclass
class RejectionSampling:
    """The fields of AReaL v1.0.4's `RejectionSamplingConfig` the token-level ratio path reads."""

    action: str = "mask"  # mask | clamp
    upper: float = 5.0
    lower: float | None = None

    def __post_init__(self) -> None:
        if self.action == "clamp" and self.lower is None:  # AReaL: clamp defaults lower to 0
            self.lower = 0.0


def areal_rejection_sampling(
    prox: torch.Tensor, old: torch.Tensor, loss_mask: torch.Tensor, rs: RejectionSampling
) -> tuple[torch.Tensor, torch.Tensor]:
    """AReaL v1.0.4 `apply_rejection_sampling`, token level, metric ratio: (loss mask, behaviour weight)."""
    log_ratio = prox.detach().float() - old.detach().float()
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)
    metric = torch.exp(log_ratio)
    weight = torch.exp(log_ratio)
    if rs.action == "mask":
        in_bounds = metric <= rs.upper if rs.lower is None else (metric >= rs.lower) & (metric <= rs.upper)
        loss_mask = (loss_mask.bool() & in_bounds).to(loss_mask.dtype)
    else:
        weight = weight.clamp(min=rs.lower if rs.lower is not None else 0.0, max=rs.upper)
    return loss_mask, torch.where(loss_mask.bool(), weight, 0.0)


def areal_ppo_actor_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    loss_mask: torch.Tensor,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling: RejectionSampling | None = None,
) -> torch.Tensor:
    """AReaL v1.0.4 `ppo_actor_loss_fn`, importance_sampling_level token (the loss only)."""
    count = loss_mask.count_nonzero() or 1  # before rejection sampling: the denominator keeps masked tokens
    weight = None
    if rejection_sampling is not None:
        loss_mask, weight = areal_rejection_sampling(proximal_logprobs, old_logprobs, loss_mask, rejection_sampling)
    ratio = torch.where(loss_mask.bool(), torch.exp(logprobs - proximal_logprobs), 0)
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + high)
    pg_loss = torch.max(-advantages * ratio, -advantages * clipped_ratio)
    if c_clip is not None:
        pg_loss = torch.min(pg_loss, torch.sign(advantages) * c_clip * advantages)
    if weight is not None:
        pg_loss = pg_loss * weight
    return torch.where(loss_mask.bool(), pg_loss, 0).sum() / count


def areal_paper_ppo_actor_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    loss_mask: torch.Tensor,
    c_clip: float | None = None,
    behav_imp_weight_cap: float | None = None,
) -> torch.Tensor:
    """AReaL ea12141f2 (paper era) `ppo_actor_loss_fn` (the loss only)."""
    count = loss_mask.count_nonzero() or 1
    ratio = torch.where(loss_mask, torch.exp(logprobs - proximal_logprobs), 0)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip)
    pg_loss = torch.max(-advantages * ratio, -advantages * clipped_ratio)
    if c_clip is not None:
        pg_loss = torch.min(pg_loss, torch.sign(advantages) * c_clip * advantages)
    weight = (proximal_logprobs - old_logprobs).exp()
    keep = (weight <= behav_imp_weight_cap).logical_and(loss_mask) if behav_imp_weight_cap is not None else loss_mask
    pg_loss = pg_loss * torch.where(keep, weight, 0.0)
    return torch.where(loss_mask, pg_loss, 0).sum() / count


def batch(seed: int, spread: float = 1.3) -> dict[str, torch.Tensor]:
    """Random stale-looking tensors: π_θ near π_prox (one minibatch step), π_behav far (w from ~0.05 to ~20)."""
    g = torch.Generator().manual_seed(seed)
    logp = -(torch.rand(N, T, generator=g) * 3 + 0.01)
    prox = logp - 0.25 * torch.randn(N, T, generator=g)
    behav = prox - spread * torch.randn(N, T, generator=g)
    adv = torch.randn(N, 1, generator=g).expand(N, T) + 0.3 * torch.randn(N, T, generator=g)
    lengths = torch.randint(2, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    return {"logp": logp, "prox": prox, "behav": behav, "adv": adv * mask, "mask": mask}


Batch = dict[str, torch.Tensor]


def ours(b: Batch, loss: str = "decoupled_ppo", **algo: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(loss, d loss / d log π_θ, metrics) of our registered loss, token-mean."""
    logp = b["logp"].clone().requires_grad_(True)
    cfg = AlgorithmConfig(loss=loss, aggregation="token_mean", **algo)
    value, metrics = get_loss(loss)(cfg, loss_inputs(logp, b["prox"], b["behav"], b["adv"], b["mask"]))
    (grad,) = torch.autograd.grad(value, logp)
    return value.detach(), grad, metrics


def theirs(b: Batch, fn: Callable[..., torch.Tensor], eps_clip: float, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d loss / d log π_θ) of a reference function above."""
    logp = b["logp"].clone().requires_grad_(True)
    value = fn(logp, b["prox"], b["behav"], b["adv"], eps_clip, b["mask"].bool(), **kw)
    (grad,) = torch.autograd.grad(value, logp)
    return value.detach(), grad


def assert_agree(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert abs(a[0].item() - b[0].item()) <= 1e-6, (a[0].item(), b[0].item())
    assert torch.allclose(a[1], b[1], rtol=0, atol=1e-6), (a[1] - b[1]).abs().max().item()


SEEDS = [0, 1, 2, 3, 4]


@pytest.mark.parametrize("seed", SEEDS)
def test_arealss_token_mask_above_5_is_our_mask_mode_with_behav_high_5(seed):
    b = batch(seed)
    loss, grad, m = ours(b, behav_correction="mask", behav_high=5.0, eps_low=0.2, eps_high=0.2)
    v104 = theirs(b, areal_ppo_actor_loss, 0.2, rejection_sampling=RejectionSampling("mask", 5.0))
    paper = theirs(b, areal_paper_ppo_actor_loss, 0.2, behav_imp_weight_cap=5.0)
    assert_agree((loss, grad), v104)
    assert_agree((loss, grad), paper)
    w = torch.exp(b["prox"] - b["behav"])
    dropped = ((w > 5) * b["mask"]).sum() / b["mask"].sum()
    assert dropped > 0 and m["behav_masked_frac"] == pytest.approx(dropped.item())  # the mask did act


@pytest.mark.parametrize("seed", SEEDS)
def test_the_paper_configs_uncapped_weight_is_ours_with_behav_high_0(seed):
    b = batch(seed)
    for correction in ("truncate", "mask"):  # behav_high 0: no cap, no upper bound
        loss, grad, m = ours(b, behav_correction=correction, behav_high=0.0, eps_low=0.2, eps_high=0.2)
        assert m["importance_weight_max"] > 5  # there was something to cap
        assert_agree((loss, grad), theirs(b, areal_paper_ppo_actor_loss, 0.2, behav_imp_weight_cap=None))
        v104 = theirs(b, areal_ppo_actor_loss, 0.2, rejection_sampling=RejectionSampling("mask", math.inf))
        assert_agree((loss, grad), v104)


@pytest.mark.parametrize("seed", SEEDS)
def test_truncation_at_5_is_arealss_opt_in_clamp_action_not_its_mask(seed):
    b = batch(seed)
    loss, grad, _ = ours(b, behav_correction="truncate", behav_high=5.0, eps_low=0.2, eps_high=0.2)
    assert_agree((loss, grad), theirs(b, areal_ppo_actor_loss, 0.2, rejection_sampling=RejectionSampling("clamp", 5.0)))
    masked = theirs(b, areal_ppo_actor_loss, 0.2, rejection_sampling=RejectionSampling("mask", 5.0))
    assert abs(loss.item() - masked[0].item()) > 1e-3  # the two rules differ on these tensors


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_higher_dual_clip_and_no_rejection_sampling(seed):
    b = batch(seed)
    kw = {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": 3.0}
    loss, grad, _ = ours(b, behav_correction="mask", behav_high=5.0, **kw)
    rs = RejectionSampling("mask", 5.0)
    assert_agree(
        (loss, grad), theirs(b, areal_ppo_actor_loss, 0.2, eps_clip_higher=0.28, c_clip=3.0, rejection_sampling=rs)
    )
    # rejection_sampling null with the decoupled loss: ratio to π_prox, no behaviour weight at all
    loss, grad, _ = ours(b, behav_correction="none", **kw)
    assert_agree((loss, grad), theirs(b, areal_ppo_actor_loss, 0.2, eps_clip_higher=0.28, c_clip=3.0))


@pytest.mark.parametrize("seed", SEEDS)
def test_naive_ppo_is_areal_without_the_decoupled_loss(seed):
    """use_decoupled_loss false, no recompute: π_prox = π_old = π_behav, no weight."""
    b = batch(seed)
    loss, grad, _ = ours(b, loss="ppo", eps_low=0.2, eps_high=0.2)
    b_naive = {**b, "prox": b["behav"]}
    assert_agree((loss, grad), theirs(b_naive, areal_ppo_actor_loss, 0.2))
