"""M2PO (areal_core/train/loss/m2po.py) against values and gradients computed by hand.

Zheng et al. 2025 (arXiv:2510.01161), as AReaL's docs/en/algorithms/m2po.md writes it:
M̂2 = (1/N) Σ_t (log π_θold − log π_behav)², the largest M2 masked until the rest's mean is below
τ_M2, J = (1/Σ|o_i|) Σ_i Σ_t M_{i,t} · π_θ/π_behav · A_{i,t}; the loss is −J."""

from __future__ import annotations

import math
import random

import pytest
import torch

from areal_core.config import ConfigError
from areal_core.config.algorithm import AlgorithmConfig, from_preset
from areal_core.context import load_run_config
from areal_core.layout import LAYOUT
from areal_core.train.algorithm import compute_loss, required_inputs
from areal_core.train.loss import check_algorithm, get_loss
from areal_core.train.loss.m2po import M2poSettings, m2po_mask
from areal_core.train.parts import TrainerParts, load_parts
from areal_core.train.sinks import NullSink
from areal_core.train.sources import Batch
from areal_core.train.trainer import Trainer
from tests.loss_inputs import ppo
from tests.test_lineage import groups
from tests.test_trainer_seams import Listed, prepared

approx = pytest.approx


def L(*probs: float) -> torch.Tensor:
    return torch.log(torch.tensor([list(probs)]))


def test_the_largest_second_moments_are_masked_until_the_mean_is_below_the_threshold():
    prox = L(0.5, 0.4, 0.3, 0.6)
    delta = torch.tensor([[0.5, 0.1, 0.0, -0.3]])  # M2 = .25, .01, 0, .09: mean .0875 ≥ .04
    behav = prox + delta
    keep = m2po_mask(prox, behav, torch.ones(1, 4), 0.04)
    assert keep.tolist() == [[0.0, 1.0, 1.0, 1.0]]  # without the .25: (.01 + 0 + .09)/3 = .033 < .04
    assert m2po_mask(prox, behav, torch.ones(1, 4), 0.02).tolist() == [[0.0, 1.0, 1.0, 0.0]]  # .005 < .02
    assert m2po_mask(prox, behav, torch.ones(1, 4), 0.1).tolist() == [[1.0] * 4]  # .0875 < .1: none
    # no k < N brings the mean below τ: all but the smallest are masked (AReaL's rule)
    assert m2po_mask(prox, prox + 1.0, torch.ones(1, 4), 0.5).sum().item() == 1.0
    # padding and non-finite tokens are neither kept nor counted in M̂2
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    behav_nan = behav.clone()
    behav_nan[0, 1] = -math.inf
    assert m2po_mask(prox, behav_nan, mask, 0.04).tolist() == [[0.0, 0.0, 1.0, 0.0]]  # .25, 0 → 0 < .04


def test_the_mask_is_the_smallest_k_by_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        prox = torch.log(torch.rand(3, 7, generator=g).clamp(min=0.05))
        behav = prox + 0.4 * torch.randn(3, 7, generator=g)
        mask = (torch.rand(3, 7, generator=g) > 0.2).float()
        tau = 0.02 + 0.1 * torch.rand(1, generator=g).item()
        keep = m2po_mask(prox, behav, mask, tau)
        m2 = sorted(((behav - prox)[mask > 0] ** 2).tolist(), reverse=True)
        k = next((i for i in range(len(m2)) if sum(m2[i:]) / (len(m2) - i) < tau), len(m2) - 1)
        assert keep.sum().item() == len(m2) - k and (keep * (1 - mask)).sum() == 0
        dropped = ((behav - prox) ** 2)[(mask > 0) & (keep == 0)]
        kept = ((behav - prox) ** 2)[keep > 0]
        assert dropped.numel() == 0 or dropped.min() >= kept.max()  # the largest ones go


def test_value_and_gradient_by_hand_against_the_paper_formula():
    prox = L(0.5, 0.4, 0.3, 0.6)
    delta = torch.tensor([[0.5, 0.1, 0.0, -0.3]])
    behav = prox + delta
    logp = L(0.55, 0.4, 0.33, 0.6).requires_grad_()  # r = π_θ/π_prox = 1.1, 1, 1.1, 1
    adv = torch.tensor([[1.0, 1.0, -1.0, 2.0]])
    mask = torch.ones(1, 4)
    cfg = from_preset("m2po")
    loss, m = compute_loss(
        cfg, logp, prox, behav, torch.zeros(1), torch.zeros(1, dtype=torch.long), mask, advantages=adv
    )
    # the paper: −(1/N) Σ_t M_t · π_θ/π_behav · A_t with M = [0, 1, 1, 1]
    want = -(math.exp(-0.1) * 1 + 1.1 * -1 + math.exp(0.3) * 2) / 4
    paper = -(torch.tensor([[0.0, 1, 1, 1]]) * torch.exp(logp - behav) * adv).sum() / 4
    assert loss.item() == approx(want, rel=1e-6) and loss.item() == approx(paper.item(), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)  # ∂/∂log π_θ(t) = −M_t · w_t · r_t · A_t / N
    assert grad[0].tolist() == approx([0.0, -math.exp(-0.1) / 4, 1.1 / 4, -2 * math.exp(0.3) / 4], rel=1e-6)
    assert m["m2_masked_frac"] == approx(0.25) and m["m2_before"] == approx(0.0875, rel=1e-5)
    assert m["m2_after"] == approx(0.1 / 3, rel=1e-5) and m["behav_masked_frac"] == approx(0.25)
    assert m["importance_weight_max"] == approx(math.exp(0.3), rel=1e-6)  # over the kept tokens only
    assert m["importance_weight_min"] == approx(math.exp(-0.1), rel=1e-6)
    assert m["ratio_mean"] == approx((1 + 1.1 + 1) / 3, rel=1e-6)


def test_with_nothing_masked_it_is_decoupled_ppo_and_the_clip_counts_kept_tokens():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 6, 5, generator=g, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[..., 0]
    prox = logp.detach() + 0.3 * torch.randn(4, 6, generator=g)
    behav = prox + 0.05 * torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    args = (torch.zeros(4), torch.zeros(4, dtype=torch.long), mask)
    loss, m = compute_loss(from_preset("m2po", m2po={"threshold": 10.0}), logp, prox, behav, *args, advantages=adv)
    ref, st = ppo(logp, prox, behav, adv, mask, eps_high=0.28, behav_high=5.0)
    g1, g2 = (torch.autograd.grad(x, logits, retain_graph=True)[0] for x in (loss, ref))
    assert loss.item() == approx(ref.item(), rel=1e-6) and torch.allclose(g1, g2, atol=1e-7)
    assert m["m2_masked_frac"] == 0 and m["clip_frac"] == approx(st["clip_frac"], rel=1e-6)
    # masking: the fractions count the kept tokens, and the masked ones give no gradient
    loss, m = compute_loss(from_preset("m2po", m2po={"threshold": 1e-3}), logp, prox, behav, *args, advantages=adv)
    keep = m2po_mask(prox, behav, mask, 1e-3)
    (grad,) = torch.autograd.grad(loss, logits)
    assert 0 < m["m2_masked_frac"] < 1 and grad[(keep == 0) & (mask > 0)].abs().sum() == 0
    assert 0.0 <= m["clip_frac"] <= 1.0


def test_the_preset_the_declarations_and_a_trainer_run(tmp_path):
    cfg = from_preset("m2po")
    assert cfg.loss == "m2po" and M2poSettings.of(cfg).threshold == 0.04 and required_inputs(cfg) == set()
    loss = get_loss("m2po")
    assert loss.needs == {"advantages"} and loss.level == "token" and not loss.distributed
    assert check_algorithm(cfg) == [loss]
    with pytest.raises(ConfigError, match="cannot run on more than one rank"):
        check_algorithm(cfg, distributed=True)
    with pytest.raises(ConfigError, match="'algo.m2po.threshold' must be > 0"):
        check_algorithm(AlgorithmConfig.from_data({"loss": "m2po", "m2po": {"threshold": 0.0}}, prefix="algo"))
    seen, _ = trainer_run(tmp_path, "algo.loss=m2po")  # end to end
    assert all(0 < m["m2_masked_frac"] < 1 and m["m2_after"] < 0.04 for m in seen)


def trainer_run(tmp_path, *overrides: str, steps: int = 2) -> tuple[list[dict], TrainerParts]:
    """`steps` steps of a Trainer on the tiny model (its parts loaded by `load_parts`, random groups
    of 4 samples, nothing published) with `overrides`: each step's metrics, all finite, and the parts."""
    run_uri, store = prepared(tmp_path, f"train.steps={steps}", *overrides)
    cfg = load_run_config(store)
    vocab = store.read_json(f"{LAYOUT.init_model}/config.json")["vocab_size"]
    seen: list[dict] = []
    source = Listed([Batch(groups(random.Random(i), "a", 2, 0, vocab)) for i in range(steps)])
    parts = load_parts(store.url(LAYOUT.init_model), cfg)
    Trainer(parts, source, NullSink(), store, cfg, on_step=lambda b, m: seen.append(m)).fit()
    assert len(seen) == steps and all(math.isfinite(v) for m in seen for v in m.values())
    return seen, parts
