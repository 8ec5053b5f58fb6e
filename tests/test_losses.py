import math

import pytest
import torch

from areal_core.train.advantages import grpo_advantages
from areal_core.train.losses import decoupled_ppo_loss, masked_mean


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = grpo_advantages(rewards, groups)
    # group 0: mean 0.25, population std sqrt(0.1875)
    std = math.sqrt(0.1875)
    assert adv[0].item() == pytest.approx(0.75 / std, rel=1e-4)
    assert adv[1].item() == pytest.approx(-0.25 / std, rel=1e-4)
    assert adv[4].item() == 0 and adv[5].item() == 0  # all-equal group carries no signal
    assert adv[:4].sum().item() == pytest.approx(0.0, abs=1e-5)


def test_decoupled_ppo_by_hand():
    # one sequence, three tokens; A = 1
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.2]]))
    prox = torch.log(torch.tensor([[0.4, 0.6, 0.2]]))
    behav = torch.log(torch.tensor([[0.4, 0.3, 0.1]]))
    adv = torch.ones(1, 3)
    mask = torch.ones(1, 3)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_low=0.2, eps_high=0.2, behav_weight_cap=0)
    r = torch.tensor([0.5 / 0.4, 0.9 / 0.6, 1.0])
    w = torch.tensor([1.0, 2.0, 2.0])
    expected = (w * torch.maximum(-r, -r.clamp(0.8, 1.2))).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert stats["clip_frac"] == pytest.approx(2 / 3)  # r = 1.25 and 1.5 exceed 1.2
    assert stats["importance_weight_mean"] == pytest.approx(5 / 3, rel=1e-5)


def test_ratio_one_and_no_behaviour_gap_is_vanilla_policy_gradient():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[:, :5]
    adv = torch.randn(4, 1).expand(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    loss, _ = decoupled_ppo_loss(logp, logp.detach(), logp.detach(), adv, mask)
    (g1,) = torch.autograd.grad(loss, logits, retain_graph=True)
    pg = -masked_mean(adv * logp, mask)
    (g2,) = torch.autograd.grad(pg, logits)
    assert torch.allclose(g1, g2, atol=1e-6)


def test_behaviour_weight_cap_and_dual_clip():
    logp = torch.log(torch.tensor([[0.1]]))
    prox = torch.log(torch.tensor([[0.5]]))
    behav = torch.log(torch.tensor([[0.01]]))  # w = 50, capped to 5
    loss, stats = decoupled_ppo_loss(logp, prox, behav, torch.tensor([[-1.0]]), torch.ones(1, 1), behav_weight_cap=5.0)
    assert stats["importance_weight_mean"] == pytest.approx(5.0)
    assert loss.item() == pytest.approx(5.0 * 0.8, rel=1e-5)  # max(0.2, 0.8)
    ratio_big = torch.log(torch.tensor([[0.9]]))
    prox_small = torch.log(torch.tensor([[0.1]]))  # r = 9, A = -1: PPO term 9, dual clip caps at 3
    loss, stats = decoupled_ppo_loss(
        ratio_big, prox_small, prox_small, torch.tensor([[-1.0]]), torch.ones(1, 1), dual_clip=3.0
    )
    assert loss.item() == pytest.approx(3.0, rel=1e-5)
    assert stats["dual_clip_frac"] == 1.0


def test_masked_tokens_do_not_contribute():
    logp = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, 100.0]])
    loss, _ = decoupled_ppo_loss(logp, logp, logp, adv, torch.tensor([[1.0, 1.0, 0.0]]))
    assert loss.item() == pytest.approx(-1.0)
