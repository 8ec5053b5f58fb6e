"""Advantages normalised as AReaL normalises them (issue 47): `batch_norm` (its paper) and
`group_batch_norm` (its GSM8K example), by hand."""

from __future__ import annotations

import math

import pytest
import torch

from areal_core.config import ConfigError
from areal_core.config.algorithm import AlgorithmConfig
from areal_core.train import advantages as A
from areal_core.train.algorithm import compute_advantages

approx = pytest.approx


def lengths_mask(*lengths: int, width: int = 4) -> torch.Tensor:
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()


def test_batch_norm_weighs_each_sample_by_its_policy_tokens():
    # rewards 1 (one token) and 0 (three tokens): token values 1, 0, 0, 0 -> μ = 1/4, σ² = 3/16
    mask = lengths_mask(1, 3)
    adv = A.batch_norm_advantages(torch.tensor([1.0, 0.0]), mask, eps=0.0)
    assert adv[0].tolist() == approx([math.sqrt(3), 0, 0, 0], rel=1e-6)  # (1 − 1/4)/√(3/16)
    assert adv[1].tolist() == approx([-1 / math.sqrt(3)] * 3 + [0], rel=1e-6)  # (0 − 1/4)/√(3/16)
    # no group baseline: a group whose rewards are all 1 still gets a positive advantage
    adv = A.batch_norm_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), lengths_mask(1, 1, 1, 1))
    assert adv[:2, 0].tolist() == approx([0.5 / (0.5 + 1e-5)] * 2, rel=1e-6)  # μ = σ = 1/2


def test_group_batch_norm_by_hand():
    # group 0: rewards 1, 0: mean 1/2, unbiased std √(1/2) -> r' = ±√(1/2); group 1: all equal -> 0
    # then over the 5 policy tokens (1, 1, 2, 1): values √½, −√½, 0, 0, 0 -> μ = 0, σ² = 1/5
    mask = lengths_mask(1, 1, 2, 1)
    adv = A.group_batch_norm_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]), mask, eps=0.0)
    want = math.sqrt(0.5) / math.sqrt(0.2)  # √(5/2)
    assert adv[:, 0].tolist() == approx([want, -want, 0.0, 0.0], rel=1e-6)
    assert adv[2].tolist() == [0.0] * 4 and adv[:, 1:].abs().sum().item() == 0.0
    # groups of 2 and 3 (one token each): Bessel's n − 1 matters. Group 0: r' = ±√½; group 1 (1, 0, 0):
    # mean 1/3, std √((4/9 + 1/9 + 1/9)/2) = 1/√3, r' = 2/√3, −1/√3, −1/√3; then μ = 0, σ² = 3/5
    adv = A.group_batch_norm_advantages(
        torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1, 1]), lengths_mask(1, 1, 1, 1, 1), eps=0.0
    )
    s = math.sqrt(0.6)
    want = [math.sqrt(0.5) / s, -math.sqrt(0.5) / s, 2 / math.sqrt(3) / s, -1 / math.sqrt(3) / s, -1 / math.sqrt(3) / s]
    assert adv[:, 0].tolist() == approx(want, rel=1e-6)
    # a group of one sample carries no signal, and no NaN from its n − 1 = 0
    adv = A.group_batch_norm_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]), lengths_mask(1, 1, 1))
    assert torch.isfinite(adv).all() and adv[2, 0].item() == 0.0


def test_they_are_named_config_choices():
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    mask = lengths_mask(1, 1, 2, 1)
    for name, fn in (
        ("batch_norm", lambda: A.batch_norm_advantages(rewards, mask)),
        ("group_batch_norm", lambda: A.group_batch_norm_advantages(rewards, groups, mask)),
    ):
        adv, returns, metrics = compute_advantages(AlgorithmConfig(adv_estimator=name), rewards, groups, mask)
        assert returns is None and torch.equal(adv, fn()) and metrics["adv_mean"] == approx(0.0, abs=1e-6)
    with pytest.raises(ConfigError, match="adv_estimator"):
        AlgorithmConfig.from_data({"adv_estimator": "areal"}, prefix="algo")


def test_the_papers_rule_was_reinforce_pp_at_gamma_1_and_the_examples_is_grpo_then_whitening():
    """What the named choices add is the name, eps 1e-5 and (GSM8K) the unbiased group std: up to
    those, batch_norm is reinforce_pp with γ = 1 and group_batch_norm is grpo with adv_whiten."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (12,), generator=g).float()
    groups = torch.arange(12) // 4
    mask = lengths_mask(*torch.randint(1, 6, (12,), generator=g).tolist(), width=5)
    rpp = A.reinforce_pp_advantages(A.terminal_rewards(rewards, mask), mask, gamma=1.0)
    assert torch.allclose(A.batch_norm_advantages(rewards, mask), rpp, atol=1e-4)
    whitened = A.masked_whiten(A.broadcast(A.grpo_advantages(rewards, groups), mask), mask)
    assert torch.allclose(A.group_batch_norm_advantages(rewards, groups, mask), whitened, atol=1e-4)
