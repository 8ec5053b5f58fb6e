"""CISPO (areal_core/train/loss/cispo.py) against values and gradients computed by hand.

MiniMax-M1 (arXiv:2506.13585): J = E[ sg(clip(r_t, 1−ε_low, 1+ε_high)) · A_t · log π_θ(a_t|s_t) ],
token-mean; the loss is −J, times the behaviour weight w = π_prox/π_behav here."""

import math

import pytest
import torch

from areal_core.config.algorithm import AlgorithmConfig, from_preset
from areal_core.train.algorithm import compute_loss, required_inputs
from areal_core.train.loss import check_algorithm, get_loss
from areal_core.train.loss.cispo import cispo_loss
from tests.loss_inputs import call
from tests.loss_inputs import ppo as decoupled

approx = pytest.approx


def P(*rows):
    """log of a [N, T] tensor of probabilities."""
    return torch.log(torch.tensor([list(r) for r in rows]))


def test_value_and_gradient_by_hand_and_no_token_loses_its_gradient():
    logp = P([0.5, 0.9, 0.2]).requires_grad_()
    prox = P([0.4, 0.6, 0.2])  # r = 1.25, 1.5, 1: the second leaves [0.8, 1.28] and is weighted 1.28
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    mask = torch.ones(1, 3)
    loss, st = call(cispo_loss, logp, prox, prox, adv, mask, eps_low=0.2, eps_high=0.28)
    want = -(1.25 * math.log(0.5) + 1.28 * math.log(0.9) - 2 * math.log(0.2)) / 3
    assert loss.item() == approx(want, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0].tolist() == approx([-1.25 / 3, -1.28 / 3, 2 / 3], rel=1e-6)  # −sg(r̂)·A / N
    assert st["clip_frac"] == approx(1 / 3) and st["clip_high_frac"] == approx(1 / 3) and st["clip_low_frac"] == 0
    assert st["ratio_mean"] == approx((1.25 + 1.5 + 1) / 3, rel=1e-6) and st["kl_behav_prox"] == 0
    # PPO's clip drops the clipped token's gradient (A > 0, r > 1 + ε); CISPO only caps its weight
    ppo, _ = decoupled(logp, prox, prox, adv, mask, eps_low=0.2, eps_high=0.28)
    (ppo_grad,) = torch.autograd.grad(ppo, logp)
    assert ppo_grad[0, 1].item() == 0.0 and grad[0, 1].item() != 0.0


def test_lower_clip_behaviour_weight_and_padding_by_hand():
    logp = P([0.3, 0.5], [0.4, 0.7]).requires_grad_()
    prox = P([0.5, 0.5], [0.4, 0.1])  # r = 0.6 (weighted 0.8), 1; 1, (padding)
    behav = P([0.2, 0.5], [0.1, 0.1])  # ρ = 2.5 -> 2 (cap), 1; 4 -> 2
    adv = torch.tensor([[0.5, 0.5], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    kw = {"eps_low": 0.2, "eps_high": 0.28, "behav_high": 2.0}
    loss, st = call(cispo_loss, logp, prox, behav, adv, mask, **kw)
    want = -(2 * 0.8 * 0.5 * math.log(0.3) + 1 * 1 * 0.5 * math.log(0.5) + 2 * 1 * -1 * math.log(0.4)) / 3
    assert loss.item() == approx(want, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.tolist() == [approx([-0.8 / 3, -0.5 / 3], rel=1e-6), approx([2 / 3, 0.0], abs=1e-7)]
    assert st["clip_low_frac"] == approx(1 / 3) and st["clip_high_frac"] == 0
    assert st["importance_weight_max"] == approx(2.0) and st["behav_truncated_frac"] == approx(2 / 3)
    # through the registry and the config: the same value
    cfg = AlgorithmConfig(loss="cispo", behav_high=2.0, eps_low=0.2, eps_high=0.28)
    via, m = compute_loss(cfg, logp, prox, behav, torch.zeros(2), torch.tensor([0, 1]), mask, advantages=adv)
    assert via.item() == loss.item() and m["loss_policy"] == loss.item() and m["policy_tokens"] == 3


def test_on_policy_it_is_reinforce_and_micro_batches_add_up():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 6, generator=g, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[..., 0]
    adv = torch.randn(4, 5, generator=g)
    mask = (torch.rand(4, 5, generator=g) > 0.3).float()
    loss, st = call(cispo_loss, logp, logp.detach(), logp.detach(), adv, mask)
    pg = -(adv * logp * mask).sum() / mask.sum()  # r = 1, w = 1: −mean_t A_t log π_θ
    g1, g2 = (torch.autograd.grad(x, logits, retain_graph=True)[0] for x in (loss, pg))
    assert loss.item() == approx(pg.item(), rel=1e-6) and torch.allclose(g1, g2, atol=1e-7)
    assert st["clip_frac"] == 0 and st["importance_weight_mean"] == 1.0
    prox = logp.detach() + 0.3 * torch.randn(4, 5, generator=g)
    full, _ = call(cispo_loss, logp, prox, prox, adv, mask)
    halves = (slice(0, 1), slice(1, 4))
    parts = [call(cispo_loss, logp[r], prox[r], prox[r], adv[r], mask[r], global_tokens=mask.sum())[0] for r in halves]
    assert sum(p.item() for p in parts) == approx(full.item(), rel=1e-5)  # so it may run on several ranks


def test_an_impossible_behaviour_token_is_masked():
    logp = P([0.5, 0.9, 0.2]).requires_grad_()
    prox, behav = P([0.4, 0.6, 0.2]), P([0.4, 0.6, 0.2])
    behav[0, 1] = -math.inf
    loss, st = call(cispo_loss, logp, prox, behav, torch.ones(1, 3), torch.ones(1, 3))
    (grad,) = torch.autograd.grad(loss, logp)
    assert math.isfinite(loss.item()) and torch.isfinite(grad).all() and grad[0, 1].item() == 0.0
    assert loss.item() == approx(-(1.25 * math.log(0.5) + math.log(0.2)) / 3, rel=1e-6)
    assert st["behav_nonfinite_frac"] == approx(1 / 3)


def test_the_preset_and_the_declarations():
    cfg = from_preset("cispo")
    assert cfg.loss == "cispo" and cfg.aggregation == "token_mean" and cfg.eps_low == 0.99
    loss = get_loss("cispo")
    assert loss.needs == {"advantages"} and loss.level == "token" and loss.distributed and loss.kl_term
    assert required_inputs(cfg) == set() and check_algorithm(cfg, distributed=True) == [loss]
