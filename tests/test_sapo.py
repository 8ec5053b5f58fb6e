"""SAPO (areal_core/train/loss/sapo.py) against values and gradients computed by hand.

Qwen, arXiv:2511.20347: J = E[(1/G) Σ_i (1/|y_i|) Σ_t f(r_{i,t}) Â_{i,t}], f(x) = (4/τ)·σ(τ(x − 1)),
τ = τ_pos if Â > 0 else τ_neg; the loss is −J, times the behaviour weight w = π_prox/π_behav here."""

from __future__ import annotations

import math

import pytest
import torch

from areal_core.config import ConfigError
from areal_core.config.algorithm import AlgorithmConfig, from_preset
from areal_core.train.algorithm import compute_loss, required_inputs
from areal_core.train.loss import check_algorithm, get_loss
from areal_core.train.loss.sapo import SapoSettings, sapo_loss
from tests.loss_inputs import call, loss_inputs, ppo
from tests.test_m2po import trainer_run

approx = pytest.approx


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def P(*rows):
    return torch.log(torch.tensor([list(r) for r in rows]))


def test_value_and_gradient_by_hand():
    prox = P([0.5, 0.5, 0.4])
    logp = P([0.6, 0.45, 0.4]).requires_grad_()  # r = 1.2, 0.9, 1.0
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, st = call(sapo_loss, logp, prox, prox, adv, torch.ones(1, 3), sapo={"tau_pos": 1.0, "tau_neg": 1.05})
    f = [4 / 1.0 * sig(1.0 * 0.2), 4 / 1.05 * sig(1.05 * -0.1), 4 / 1.0 * sig(0.0)]
    assert loss.item() == approx(-(f[0] * 1 - f[1] * 1 + f[2] * 2) / 3, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)  # ∂/∂log π_θ = −4σ(1 − σ)·r·A / N
    s0, s1 = sig(0.2), sig(-0.105)
    want = [-4 * s0 * (1 - s0) * 1.2 / 3, 4 * s1 * (1 - s1) * 0.9 / 3, -1.0 * 2 / 3]
    assert grad[0].tolist() == approx(want, rel=1e-5)
    assert st["ratio_mean"] == approx(3.1 / 3, rel=1e-6) and st["clip_frac"] == 0
    gates = [4 * s * (1 - s) for s in (s0, s1, 0.5)]
    assert st["sapo_gate_mean"] == approx(sum(gates) / 3, rel=1e-6)


def test_on_policy_it_is_the_policy_gradient_and_far_tokens_keep_a_small_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[..., 0]
    adv = torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    loss, _ = call(sapo_loss, logp, logp.detach(), logp.detach(), adv, mask)
    pg = -(adv * torch.exp(logp - logp.detach()) * mask).sum() / mask.sum()
    g1, g2 = (torch.autograd.grad(x, logits, retain_graph=True)[0] for x in (loss, pg))
    assert torch.allclose(g1, g2, atol=1e-7)  # 4σ(0)(1 − σ(0)) = 1
    # r = 3 with A > 0: PPO's clip zeroes the gradient, SAPO only damps it (4σ(2)(1 − σ(2))·3 ≈ 1.26)
    logp1 = P([0.9]).requires_grad_()
    prox1 = P([0.3])
    (gs,) = torch.autograd.grad(call(sapo_loss, logp1, prox1, prox1, torch.ones(1, 1), torch.ones(1, 1))[0], logp1)
    (gp,) = torch.autograd.grad(ppo(logp1, prox1, prox1, torch.ones(1, 1), torch.ones(1, 1))[0], logp1)
    assert gp.item() == 0.0 and gs.item() == approx(-4 * sig(2.0) * (1 - sig(2.0)) * 3.0, rel=1e-5)
    # a larger τ damps sooner: the negative side (τ_neg = 1.05) is cut harder at the same ratio
    lo = P([0.3])
    weight = []
    for a in (1.0, -1.0):
        loss, _ = call(sapo_loss, logp1, lo, lo, torch.full((1, 1), a), torch.ones(1, 1), sapo={"tau_neg": 3.0})
        (gr,) = torch.autograd.grad(loss, logp1)
        weight.append(abs(gr.item()))
    assert weight[1] < weight[0]


def test_the_papers_aggregation_and_the_behaviour_weight_by_hand():
    prox = P([0.5, 0.5], [0.4, 0.1])
    behav = P([0.25, 0.5], [0.4, 0.1])  # ρ = 2, 1; 1, (padding)
    logp = P([0.5, 0.6], [0.5, 0.1]).requires_grad_()  # r = 1, 1.2; 1.25, (padding)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    cfg = AlgorithmConfig(loss="sapo", aggregation="seq_mean_token_mean")
    loss, m = compute_loss(cfg, logp, prox, behav, torch.zeros(2), torch.tensor([0, 1]), mask, advantages=adv)
    f = lambda r, a, tau: 4 / tau * sig(tau * (r - 1)) * a  # noqa: E731
    row0 = (2 * f(1.0, 1, 1.0) + 1 * f(1.2, 1, 1.0)) / 2
    row1 = f(1.25, -1, 1.05) / 1
    assert loss.item() == approx(-(row0 + row1) / 2, rel=1e-6)  # (1/G) Σ_i (1/|y_i|) Σ_t
    (grad,) = torch.autograd.grad(loss, logp)
    s = sig(0.2)
    assert grad[0].tolist() == approx([-2 * 1 / 2 / 2, -4 * s * (1 - s) * 1.2 / 2 / 2], rel=1e-5)
    s = sig(1.05 * 0.25)
    assert grad[1, 0].item() == approx(4 * s * (1 - s) * 1.25 / 2, rel=1e-5) and grad[1, 1].item() == 0.0
    assert m["importance_weight_max"] == approx(2.0, rel=1e-6) and m["kl_behav_prox"] == approx(
        -math.log(2) / 3, rel=1e-5
    )


def test_an_impossible_behaviour_token_is_masked_and_bad_temperatures_are_refused():
    logp = P([0.5, 0.9]).requires_grad_()
    prox, behav = P([0.5, 0.6]), P([0.5, 0.6])
    behav[0, 1] = -math.inf
    loss, st = call(sapo_loss, logp, prox, behav, torch.ones(1, 2), torch.ones(1, 2))
    (grad,) = torch.autograd.grad(loss, logp)
    assert math.isfinite(loss.item()) and grad[0, 1].item() == 0.0 and st["behav_nonfinite_frac"] == 0.5
    assert loss.item() == approx(-4 * sig(0.0) / 2, rel=1e-6)
    with pytest.raises(ConfigError, match="'algo.sapo.tau_pos' must be > 0"):
        unvalidated = AlgorithmConfig().model_copy(update={"sapo": {"tau_pos": 0.0}})
        sapo_loss(unvalidated, loss_inputs(logp, prox, prox, torch.ones(1, 2), torch.ones(1, 2)))
    with pytest.raises(ConfigError, match="'algo.sapo.tau_neg' must be > 0"):
        check_algorithm(AlgorithmConfig.from_data({"loss": "sapo", "sapo": {"tau_neg": -1.0}}, prefix="algo"))


def test_the_preset_the_declarations_and_a_trainer_run(tmp_path):
    cfg = from_preset("sapo")
    tau = SapoSettings.of(cfg)
    assert (cfg.loss, tau.tau_pos, tau.tau_neg, cfg.aggregation) == ("sapo", 1.0, 1.05, "token_mean")
    loss = get_loss("sapo")
    assert loss.needs == {"advantages"} and loss.level == "token" and loss.distributed and loss.kl_term
    assert required_inputs(cfg) == set() and check_algorithm(cfg, distributed=True) == [loss]
    seen, _ = trainer_run(tmp_path, "algo.loss=sapo")
    assert all(0 < m["sapo_gate_mean"] <= 1 for m in seen)
