"""On-policy distillation (areal_core/train/loss/distill.py) against values and gradients computed by hand,
and the teacher's path through the trainer (parts.py loads it like the reference model, step.py
computes its log-probs).

GKD / MiniLLM: minimise D_KL(π_θ‖π_T) = E_{y∼π_θ}[Σ_t log π_θ(y_t) − log π_T(y_t)] on the student's
samples; KDRL: J_GRPO − β·D_KL. Per token d = sg(log π_θ − log π_T), L_KD = agg(w·r·d)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from areal_core.config import ConfigError
from areal_core.config.algorithm import from_preset
from areal_core.context import load_run_config
from areal_core.layout import LAYOUT
from areal_core.models import load_pretrained, save_pretrained
from areal_core.train.algorithm import compute_loss, required_inputs
from areal_core.train.loss import check_algorithm, get_loss
from areal_core.train.loss.distill import DistillSettings, distill_term
from areal_core.train.parts import load_parts
from areal_core.train.step import train_step
from tests.loss_inputs import call, ppo
from tests.test_m2po import trainer_run
from tests.test_trainer_seams import prepared

approx = pytest.approx
ARGS = (torch.zeros(1), torch.zeros(1, dtype=torch.long))


def P(*rows):
    return torch.log(torch.tensor([list(r) for r in rows]))


def test_value_and_gradient_by_hand():
    logp = P([0.5, 0.2, 0.6]).requires_grad_()
    prox = P([0.5, 0.25, 0.6])  # r = 1, 0.8, 1
    behav = P([0.25, 0.25, 0.6])  # w = 2, 1, 1
    teacher = P([0.8, 0.1, 0.6])  # d = log(.5/.8), log(.2/.1), 0
    mask = torch.ones(1, 3)
    kd, st = call(distill_term, logp, prox, behav, None, mask, teacher_logp=teacher)
    d = [math.log(0.5 / 0.8), math.log(2.0), 0.0]
    assert kd.item() == approx((2 * 1 * d[0] + 1 * 0.8 * d[1]) / 3, rel=1e-6)
    (grad,) = torch.autograd.grad(kd, logp)  # w·r·d / N: the score-function gradient, not w·r / N
    assert grad[0].tolist() == approx([2 * d[0] / 3, 0.8 * d[1] / 3, 0.0], rel=1e-6, abs=1e-8)
    assert st["distill_rkl"] == approx(sum(d) / 3, rel=1e-6) and st["distill_importance_weight_max"] == approx(2.0)
    # through the config: distillation alone (algo.distill.rl_coef 0) is β_KD · L_KD
    cfg = from_preset("distill_only")
    loss, m = compute_loss(cfg, logp, prox, behav, *ARGS, mask, advantages=torch.ones(1, 3), teacher_logp=teacher)
    assert loss.item() == approx(kd.item(), rel=1e-6) and "loss_rl" not in m and m["loss_distill"] == kd.item()
    # added to the RL loss: decoupled PPO + 0.1 · L_KD
    adv = torch.tensor([[1.0, -1.0, 0.5]])
    cfg = from_preset("distill")
    loss, m = compute_loss(cfg, logp, prox, behav, *ARGS, mask, advantages=adv, teacher_logp=teacher)
    rl, _ = ppo(logp, prox, behav, adv, mask, eps_high=0.28, behav_high=5.0)
    assert loss.item() == approx(rl.item() + 0.1 * kd.item(), rel=1e-6) and m["loss_rl"] == approx(rl.item())


def test_its_expected_gradient_is_the_gradient_of_the_reverse_kl():
    """On policy, E_{y∼π_θ}[∇L_KD(y)] = ∇ Σ_y π_θ(y)·(log π_θ(y) − log π_T(y)), the exact reverse KL;
    AReaL's joint-loss form β·(log π_θ − log π_T), differentiated through log π_θ, has zero mean."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(5, generator=g, requires_grad=True)
    log_t = torch.log_softmax(torch.randn(5, generator=g), -1)
    log_pi = torch.log_softmax(theta, -1)
    exact = (log_pi.exp() * (log_pi - log_t)).sum()
    (want,) = torch.autograd.grad(exact, theta, retain_graph=True)
    pi = log_pi.detach().exp()
    est = sum(
        pi[y] * call(distill_term, log_pi[y].view(1, 1), log_pi[y].detach().view(1, 1), log_pi[y].detach().view(1, 1),
                     None, torch.ones(1, 1), teacher_logp=log_t[y].view(1, 1))[0]
        for y in range(5)
    )  # fmt: skip
    (got,) = torch.autograd.grad(est, theta, retain_graph=True)
    assert torch.allclose(got, want, atol=1e-6)
    pathwise = sum(pi[y] * (log_pi[y] - log_t[y]) for y in range(5))
    (zero,) = torch.autograd.grad(pathwise, theta)
    assert zero.abs().max() < 1e-6


def test_masked_tokens_the_missing_teacher_and_the_declarations():
    logp = P([0.5, 0.9]).requires_grad_()
    prox = P([0.5, 0.9])
    teacher = P([0.25, 0.9])
    teacher[0, 1] = -math.inf  # a teacher that calls the token impossible is not followed to infinity
    kd, _ = call(distill_term, logp, prox, prox, None, torch.ones(1, 2), teacher_logp=teacher)
    (grad,) = torch.autograd.grad(kd, logp)
    assert kd.item() == approx(math.log(2) / 2, rel=1e-6) and grad[0, 1].item() == 0.0
    cfg = from_preset("distill")
    with pytest.raises(ValueError, match="teacher_logp"):
        compute_loss(cfg, logp, prox, prox, *ARGS, torch.ones(1, 2), advantages=torch.ones(1, 2))
    assert required_inputs(cfg) == {"teacher_logp"} and required_inputs(from_preset("distill_only")) == {"teacher_logp"}
    loss = get_loss("distill")
    assert loss.needs == {"advantages", "teacher_logp"} and loss.distributed and loss.level == "token"
    assert check_algorithm(cfg, distributed=True) == [loss]
    settings = DistillSettings.of(cfg)
    assert (settings.teacher_path, settings.coef, settings.rl_coef) == ("", 0.1, 1.0)
    with pytest.raises(ValueError, match="teacher model"):
        train_step(None, None, [], load_run_config_for("algo.loss=distill"), 0)


def load_run_config_for(*overrides: str):
    from areal_core.config import load_config

    return load_config(None, list(overrides))


def test_the_teacher_is_loaded_like_the_reference_model_and_trains_the_student(tmp_path):
    # a teacher with the student's tokenizer: the same initial checkpoint, perturbed
    _, other = prepared(tmp_path / "t")
    model, tok = load_pretrained(other.url(LAYOUT.init_model))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    teacher_dir = tmp_path / "teacher"
    save_pretrained(model, tok, teacher_dir)
    seen, parts = trainer_run(tmp_path / "s", "algo.loss=distill", f"algo.distill.teacher_path={teacher_dir}")
    assert parts.teacher_model is not None and parts.ref_model is None
    assert not any(p.requires_grad for p in parts.teacher_model.parameters())
    assert torch.equal(next(parts.teacher_model.parameters()), next(model.parameters()))  # not trained
    assert all(m["distill_rkl"] != 0 and "loss_rl" in m and "clip_frac" in m for m in seen)
    # empty teacher_path: the initial checkpoint, so at the first step the student is the teacher
    seen, parts = trainer_run(tmp_path / "d", "algo.loss=distill", "algo.distill.rl_coef=0.0")
    assert seen[0]["distill_rkl"] == approx(0.0, abs=1e-6) and "loss_rl" not in seen[0]
    # another tokenizer is refused, naming the key
    odd = tmp_path / "odd"
    shutil.copytree(teacher_dir, odd)
    tok.add_tokens(["<not-in-the-student>"])
    tok.save_pretrained(odd)
    run_uri, store = prepared(tmp_path / "x", "algo.loss=distill", f"algo.distill.teacher_path={odd}")
    with pytest.raises(ConfigError, match="'algo.distill.teacher_path'"):
        load_parts(store.url(LAYOUT.init_model), load_run_config(store))
