"""KPop (areal_core/train/loss/kpop.py) against values and gradients computed by hand, beside IcePop.

Ant Group (ringtech.notion.site/kpop), as AReaL's docs/en/algorithms/grpo_series.md writes it: with
each token's probability as a Bernoulli parameter, KL(P‖Q) = p·log(p/q) + (1 − p)·log((1 − p)/(1 − q)),
tokens where max(KL(π_prox‖π_behav), KL(π_behav‖π_prox)) > φ are masked; the rest keep
ρ = π_prox/π_behav and decoupled PPO's clipped objective."""

from __future__ import annotations

import math

import pytest
import torch

from areal_core.config.algorithm import AlgorithmConfig, from_preset
from areal_core.train.algorithm import compute_loss, required_inputs
from areal_core.train.loss import check_algorithm, get_loss
from areal_core.train.loss.kpop import KpopSettings, binary_kl, kpop_keep
from tests.loss_inputs import ppo
from tests.test_m2po import trainer_run

approx = pytest.approx


def kl_b(p: float, q: float) -> float:
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def P(*rows):
    return torch.log(torch.tensor([list(r) for r in rows], dtype=torch.float32))


def test_binary_kl_by_hand():
    log_p, log_q = P([0.5, 0.9, 0.99, 0.01]), P([0.25, 0.1, 0.01, 0.005])
    want = [kl_b(0.5, 0.25), kl_b(0.9, 0.1), kl_b(0.99, 0.01), kl_b(0.01, 0.005)]
    assert binary_kl(log_p, log_q)[0].tolist() == approx(want, rel=1e-5)
    assert want[0] == approx(0.1438, abs=1e-4) and want[3] == approx(0.0019, abs=1e-4)  # the docstring's numbers
    assert binary_kl(log_q, log_p)[0, 0].item() == approx(kl_b(0.25, 0.5), rel=1e-5)
    assert binary_kl(P([0.3]), P([0.3])).item() == 0.0
    # p = 1 is clamped to 1 − 1e−8 (AReaL's eps): finite
    assert math.isfinite(binary_kl(torch.zeros(1, 1), P([0.5])).item())


def test_the_mask_by_hand_and_against_icepops_band():
    prox, behav = P([0.5, 0.9, 0.99, 0.02]), P([0.25, 0.1, 0.01, 0.01])  # ρ = 2, 9, 99, 2
    kl = [max(kl_b(p, q), kl_b(q, p)) for p, q in [(0.5, 0.25), (0.9, 0.1), (0.99, 0.01), (0.02, 0.01)]]
    assert kl[1] < 2.0 < kl[2]
    assert kpop_keep(prox, behav, 2.0).tolist() == [[1.0, 1.0, 0.0, 1.0]]
    assert kpop_keep(prox, behav, 0.1).tolist() == [[0.0, 0.0, 0.0, 1.0]]  # .144 > .1 but .005 < .1
    # the same ratio 2 is masked on a likely token and kept on an unlikely one; IcePop's band treats them alike
    assert kl[3] < 0.1 < kl[0]
    behav_nan = behav.clone()
    behav_nan[0, 0] = -math.inf
    assert kpop_keep(prox, behav_nan, 2.0)[0, 0].item() == 0.0


def test_value_and_gradient_by_hand():
    prox, behav = P([0.5, 0.9, 0.99]), P([0.25, 0.1, 0.01])
    logp = P([0.55, 0.9, 0.99]).requires_grad_()  # r = 1.1, 1, 1
    adv = torch.tensor([[1.0, -1.0, 3.0]])
    mask = torch.ones(1, 3)
    cfg = from_preset("kpop")
    loss, m = compute_loss(
        cfg, logp, prox, behav, torch.zeros(1), torch.zeros(1, dtype=torch.long), mask, advantages=adv
    )
    # token 2 masked (KL 4.5 > 2); ρ uncapped: 2 and 9; no ratio leaves [0.8, 1.28]
    assert loss.item() == approx(-(2 * 1.1 * 1 + 9 * 1 * -1) / 3, rel=1e-5)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0].tolist() == approx([-2 * 1.1 / 3, 9 / 3, 0.0], rel=1e-5)
    assert m["kpop_masked_frac"] == approx(1 / 3) and m["behav_masked_frac"] == approx(1 / 3)
    assert m["importance_weight_max"] == approx(9.0, rel=1e-5) and m["importance_weight_min"] == approx(2.0, rel=1e-5)
    assert m["kpop_kl_max"] == approx(max(kl_b(0.99, 0.01), kl_b(0.01, 0.99)), rel=1e-4)
    assert m["ratio_mean"] == approx(2.1 / 2, rel=1e-5)
    # the clip: r = 1.5 with A > 0 gives no gradient, and counts among the kept tokens only
    logp2 = P([0.75, 0.9, 0.99]).requires_grad_()
    loss2, m2 = compute_loss(
        cfg, logp2, prox, behav, torch.zeros(1), torch.zeros(1, dtype=torch.long), mask, advantages=adv
    )
    (grad2,) = torch.autograd.grad(loss2, logp2)
    assert loss2.item() == approx(-(2 * 1.28 * 1 + 9 * -1) / 3, rel=1e-5) and grad2[0, 0].item() == 0.0
    assert m2["clip_frac"] == approx(0.5) and m2["clip_high_frac"] == approx(0.5)


def test_with_nothing_masked_it_is_decoupled_ppo_with_the_raw_weight():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 6, 5, generator=g, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[..., 0]
    prox = logp.detach() + 0.2 * torch.randn(3, 6, generator=g)
    behav = prox + 0.3 * torch.randn(3, 6, generator=g)
    adv = torch.randn(3, 6, generator=g)
    mask = (torch.rand(3, 6, generator=g) > 0.3).float()
    cfg = AlgorithmConfig(loss="kpop", kpop={"threshold": 100.0}, dual_clip=3.0)
    loss, m = compute_loss(
        cfg, logp, prox, behav, torch.zeros(3), torch.zeros(3, dtype=torch.long), mask, advantages=adv
    )
    ref, st = ppo(logp, prox, behav, adv, mask, eps_high=0.28, dual_clip=3.0, behav_correction="mask")  # uncapped ρ
    g1, g2 = (torch.autograd.grad(x, logits, retain_graph=True)[0] for x in (loss, ref))
    assert loss.item() == approx(ref.item(), rel=1e-5) and torch.allclose(g1, g2, atol=1e-6)
    for key in ("clip_frac", "dual_clip_frac", "ratio_mean", "importance_weight_max", "kl_behav_prox"):
        assert m[key] == approx(st[key], rel=1e-5, abs=1e-7), key
    # micro-batches with the batch's denominators add up to the batch loss (KPop runs on several ranks)
    parts = [
        compute_loss(cfg, logp[r], prox[r], behav[r], torch.zeros(n), torch.zeros(n, dtype=torch.long), mask[r],
                     advantages=adv[r], global_tokens=mask.sum().item())[0]
        for r, n in ((slice(0, 1), 1), (slice(1, 3), 2))
    ]  # fmt: skip
    assert sum(p.item() for p in parts) == approx(loss.item(), rel=1e-5)


def test_the_preset_the_declarations_and_a_trainer_run(tmp_path):
    cfg = from_preset("kpop")
    assert (
        cfg.loss == "kpop"
        and KpopSettings.of(cfg).threshold == 2.0
        and from_preset("icepop").behav_correction == "mask"
    )
    loss = get_loss("kpop")
    assert loss.needs == {"advantages"} and loss.level == "token" and loss.distributed
    assert required_inputs(cfg) == set() and check_algorithm(cfg, distributed=True) == [loss]
    seen, _ = trainer_run(tmp_path, "algo.loss=kpop", "algo.kpop.threshold=1e-4")  # tokens near 1/300: KL_b ~ 1e-4
    assert all(0 < m["kpop_masked_frac"] < 1 for m in seen)
