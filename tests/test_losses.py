import math

import pytest
import torch

from areal_core.train.advantages import grpo_advantages
from areal_core.train.loss import behaviour_correction, masked_mean
from tests.loss_inputs import ppo


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
    loss, stats = ppo(logp, prox, behav, adv, mask, eps_low=0.2, eps_high=0.2, behav_high=0)
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
    loss, _ = ppo(logp, logp.detach(), logp.detach(), adv, mask)
    (g1,) = torch.autograd.grad(loss, logits, retain_graph=True)
    pg = -masked_mean(adv * logp, mask)
    (g2,) = torch.autograd.grad(pg, logits)
    assert torch.allclose(g1, g2, atol=1e-6)


def test_behaviour_weight_cap_and_dual_clip():
    logp = torch.log(torch.tensor([[0.1]]))
    prox = torch.log(torch.tensor([[0.5]]))
    behav = torch.log(torch.tensor([[0.01]]))  # w = 50, capped to 5
    loss, stats = ppo(logp, prox, behav, torch.tensor([[-1.0]]), torch.ones(1, 1), behav_high=5.0)
    assert stats["importance_weight_mean"] == pytest.approx(5.0)
    assert loss.item() == pytest.approx(5.0 * 0.8, rel=1e-5)  # max(0.2, 0.8)
    ratio_big = torch.log(torch.tensor([[0.9]]))
    prox_small = torch.log(torch.tensor([[0.1]]))  # r = 9, A = -1: PPO term 9, dual clip caps at 3
    loss, stats = ppo(ratio_big, prox_small, prox_small, torch.tensor([[-1.0]]), torch.ones(1, 1), dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0, rel=1e-5)
    assert stats["dual_clip_frac"] == 1.0


def test_masked_tokens_do_not_contribute():
    logp = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, 100.0]])
    loss, _ = ppo(logp, logp, logp, adv, torch.tensor([[1.0, 1.0, 0.0]]))
    assert loss.item() == pytest.approx(-1.0)


# ------------------------------------------------ edge cases (held-out comparison with AReaL)


def _case(seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 6, 7, generator=g, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[..., 0]
    prox = logp.detach() + 0.05 * torch.randn(3, 6, generator=g)
    behav = prox + 0.3 * torch.randn(3, 6, generator=g)
    adv = torch.randn(3, 6, generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]).float()
    return logits, logp, prox, behav, adv, mask


@pytest.mark.parametrize("correction", ["truncate", "mask", "none"])
@pytest.mark.parametrize("bad", [-math.inf, math.nan])
def test_impossible_behaviour_token_is_masked_not_capped(correction, bad):
    """log π_behav = −inf gives ρ = +inf: truncation would weight the token by the cap (5). It is
    masked instead: finite loss and gradient, the token contributes 0, the others are unchanged."""
    logits, logp, prox, behav, adv, mask = _case()
    kw = {"behav_correction": correction, "behav_low": 0.2, "behav_high": 5.0}
    clean, clean_st = ppo(logp, prox, behav, adv, mask, **kw)
    bad_behav = behav.clone()
    bad_behav[1, 2] = bad
    loss, st = ppo(logp, prox, bad_behav, adv, mask, **kw)
    assert torch.isfinite(loss)
    # the same as dropping the token from the mask while keeping the denominator
    only = mask.clone()
    only[1, 2] = 0
    ref, _ = ppo(logp, prox, behav, adv, only, global_tokens=mask.sum().item(), **kw)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6, abs=1e-7)
    assert loss.item() != pytest.approx(clean.item(), rel=1e-3)  # the token did count when finite
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    (grad_ref,) = torch.autograd.grad(ref, logits)
    assert torch.isfinite(grad).all() and grad[1, 2].abs().max().item() == 0.0
    assert torch.allclose(grad, grad_ref, atol=1e-7)
    assert st["behav_nonfinite_frac"] == pytest.approx(1 / mask.sum().item())
    assert st["behav_masked_frac"] >= st["behav_nonfinite_frac"]
    assert math.isfinite(st["kl_behav_prox"]) and math.isfinite(st["importance_weight_max"])
    assert st["importance_weight_max"] <= 5.0 + 1e-6 or correction == "none"


def test_impossible_behaviour_token_under_naive_ppo_and_sequence_levels():
    """π_old = π_behav (loss=ppo) and the sequence-level weights must not turn −inf into NaN/cap."""
    logits, logp, prox, behav, adv, mask = _case(7)
    behav[1, 3] = -math.inf
    loss, st = ppo(logp, behav, behav, adv, mask, behav_correction="none")  # loss=ppo
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad[1, 3].abs().max() == 0
    for level in ("sequence", "geometric"):
        b = behaviour_correction(prox, behav, mask, "truncate", high=0.0, level=level)
        w, keep = b.w, b.keep
        fine = behav.clone()
        fine[1, 3] = prox[1, 3]  # ρ_t = 1: the product over the other tokens
        w_ref = behaviour_correction(prox, fine, mask, "truncate", high=0.0, level=level).w
        assert keep[1, 3] == 0 and w[1, 3] == 0 and torch.isfinite(w).all()
        if level == "sequence":
            assert w[1, :3].tolist() == pytest.approx(w_ref[1, :3].tolist(), rel=1e-6)


def test_mask_mode_metrics_count_only_kept_tokens():
    """IcePop keeps 2 of 4 tokens: clip fraction, ratio mean and weight mean are over those 2."""
    #                 token:  0 (kept)  1 (kept)  2 (ρ = 4, out) 3 (ρ = 0.1, out)
    logp = torch.log(torch.tensor([[0.60, 0.40, 0.90, 0.10]]))
    prox = torch.log(torch.tensor([[0.40, 0.40, 0.40, 0.10]]))  # r = 1.5, 1.0, 2.25, 1.0
    behav = torch.log(torch.tensor([[0.40, 0.50, 0.10, 1.00]]))  # ρ = 1.0, 0.8, 4.0, 0.1
    adv = torch.ones(1, 4)
    kw = {"eps_low": 0.2, "eps_high": 0.2, "behav_correction": "mask", "behav_low": 0.5, "behav_high": 2.0}
    loss, st = ppo(logp, prox, behav, adv, torch.ones(1, 4), **kw)
    # kept: token 0 clipped (r = 1.5 > 1.2), token 1 not; the masked token 2 is clipped too but not counted
    assert st["clip_frac"] == pytest.approx(0.5) and st["clip_high_frac"] == pytest.approx(0.5)
    assert st["ratio_mean"] == pytest.approx((1.5 + 1.0) / 2, rel=1e-5)
    assert st["importance_weight_mean"] == pytest.approx((1.0 + 0.8) / 2, rel=1e-5)
    assert st["importance_weight_min"] == pytest.approx(0.8, rel=1e-5)
    assert st["behav_masked_frac"] == pytest.approx(0.5)
    # the loss itself: kept tokens' terms over all 4 tokens (IcePop keeps the denominator)
    assert loss.item() == pytest.approx((1.0 * -1.2 + 0.8 * -1.0) / 4, rel=1e-5)
    # truncate mode keeps every token: the same metrics count all 4
    _, st = ppo(logp, prox, behav, adv, torch.ones(1, 4), eps_low=0.2, eps_high=0.2, behav_high=5.0)
    assert st["clip_frac"] == pytest.approx(0.5) and st["ratio_mean"] == pytest.approx(5.75 / 4, rel=1e-5)
    assert st["importance_weight_mean"] == pytest.approx((1.0 + 0.8 + 4.0 + 0.1) / 4, rel=1e-5)


def test_gspo_averages_per_token_advantages_over_the_sequence_like_areal():
    """GSPO (loss=gspo) uses Ā_i = mean_t A_t with the sequence ratio (AReaL); gspo_token keeps A_t."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(2, 4, 5, generator=g, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[..., 0]
    prox = logp.detach() + 0.01 * torch.randn(2, 4, generator=g)
    adv = torch.tensor([[0.5, -1.0, 2.0, 9.0], [1.0, 1.0, -3.0, 0.0]])  # per-token (GAE, REINFORCE++)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv = adv * mask
    kw = {"level": "sequence", "aggregation": "seq_mean_token_mean", "eps_low": 0.2, "eps_high": 0.2}
    loss, _ = ppo(logp, prox, prox, adv, mask, seq_advantage=True, **kw)
    mean_adv = torch.tensor([[0.5], [-0.25]]).expand(2, 4)  # (0.5 − 1 + 2)/3, (1 + 1 − 3 + 0)/4
    ref, _ = ppo(logp, prox, prox, mean_adv, mask, seq_advantage=False, **kw)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    # AReaL's form: s_i = exp(mean_t log r_t) with its own gradient, loss −Ā_i·s_i (unclipped here)
    s = torch.exp(((logp - prox) * mask).sum(1) / mask.sum(1))
    areal = (-torch.tensor([0.5, -0.25]) * s).mean()
    assert loss.item() == pytest.approx(areal.item(), rel=1e-5)
    g1, g2 = (torch.autograd.grad(x, logits, retain_graph=True)[0] for x in (loss, areal))
    assert torch.allclose(g1, g2, atol=1e-6)
    # GSPO-token: the same value unclipped (mean_t A_t·s_i = Ā_i·s_i) but each token's gradient is
    # weighted by its own A_t, not Ā_i
    token, _ = ppo(logp, prox, prox, adv, mask, seq_advantage=False, **kw)
    (g3,) = torch.autograd.grad(token, logits)
    assert token.item() == pytest.approx(loss.item(), rel=1e-5)
    assert (g3 - g1).abs().max().item() > 1e-2


def test_compute_loss_names_the_gspo_variants():
    from areal_core.config.algorithm import from_preset
    from areal_core.train.algorithm import compute_loss

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 5, generator=g, requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 4.0], [0.5, 0.5, -1.0]])
    grads = {}
    for loss in ("gspo", "gspo_token"):
        logp = torch.log_softmax(logits, -1)[..., 0]
        args = (logp, logp.detach(), logp.detach(), torch.zeros(2), torch.tensor([0, 0]), torch.ones(2, 3))
        out, _ = compute_loss(from_preset("gspo", loss=loss), *args, advantages=adv)
        (grads[loss],) = torch.autograd.grad(out, logits)
    # r = 1 (π_prox = π_θ): d/dlogit of −mean_i mean_t Ā·logπ_t vs −mean_i mean_t A_t·logπ_t
    expected = {"gspo": torch.tensor([[1.0], [0.0]]).expand(2, 3), "gspo_token": adv}
    for loss, a in expected.items():
        ref_logp = torch.log_softmax(logits, -1)[..., 0]
        (ref,) = torch.autograd.grad(-(a * ref_logp).mean(), logits)
        assert torch.allclose(grads[loss], ref, atol=1e-6), loss


@pytest.mark.parametrize("preset", ["grpo", "naive_ppo", "icepop", "gspo"])
def test_compute_loss_with_an_impossible_behaviour_token_is_finite(preset):
    from areal_core.config.algorithm import from_preset
    from areal_core.train.algorithm import compute_loss

    logits, logp, prox, behav, adv, mask = _case(9)
    behav[0, 2] = -math.inf
    loss, metrics = compute_loss(
        from_preset(preset), logp, prox, behav, torch.zeros(3), torch.tensor([0, 0, 1]), mask, advantages=adv
    )
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad[0, 2].abs().max() == 0
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["behav_nonfinite_frac"] == pytest.approx(1 / mask.sum().item())
