"""Every advantage estimator, loss and shaping function against values computed by hand on
small tensors, plus property tests; and the AlgorithmConfig / compute_loss entry point."""

import math
from pathlib import Path

import pytest
import torch
import yaml

from areal_core.config import ConfigError
from areal_core.config.algorithm import PRESETS, AlgorithmConfig, from_preset
from areal_core.train import advantages as A
from areal_core.train.algorithm import compute_advantages, compute_loss, required_inputs
from areal_core.train.entropy import entropy_from_logits, logprobs_and_entropy_from_logits
from areal_core.train.loss import (
    aggregate,
    behaviour_correction,
    check_algorithm,
    critic_loss,
    kl_penalty,
    masked_mean,
    preference_loss,
    sequence_logprobs,
)
from areal_core.train.shaping import informative_groups, overlong_penalty, select_groups, shape_rewards
from tests.loss_inputs import call, ppo

ROOT = Path(__file__).resolve().parent.parent
approx = pytest.approx


def close(x: torch.Tensor, expected, tol: float = 1e-5) -> bool:
    """Element-wise |x − expected| ≤ tol·(1 + |expected|) for nested lists."""
    e = torch.tensor(expected, dtype=torch.float32)
    return x.shape == e.shape and torch.allclose(x.float(), e, rtol=tol, atol=tol)


def L(*probs):
    """log of a [1, T] tensor of probabilities."""
    return torch.log(torch.tensor([list(probs)]))


# ---------------------------------------------------------------- advantage estimators


def test_dr_grpo_is_mean_centred_without_std():
    adv = A.dr_grpo_advantages(torch.tensor([1.0, 0, 0, 0, 1, 1]), torch.tensor([0, 0, 0, 0, 1, 1]))
    assert adv.tolist() == approx([0.75, -0.25, -0.25, -0.25, 0, 0])


@pytest.mark.parametrize("est", ["grpo", "dr_grpo", "rloo", "lite_ppo"])  # group_batch_norm then shifts by the batch
@pytest.mark.parametrize("n", [2, 3, 6, 7, 8, 16])
@pytest.mark.parametrize("value", [0.7, 0.1, 0.3, 0.9, 1 / 3, 2 / 3, -0.7, 1e-8, 123.456, 0.0, 1.0])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(est, n, value):
    """Eight rewards of 0.7 have a float32 sum that misses 8 × 0.7 by an ulp: (r − mean)/(std + 1e-6) was then
    0.056 on every row of the group (a push the data does not ask for, and rows the trainer could not skip)."""
    from areal_core.train.zero_advantage import inert_rows

    rewards = torch.tensor([value] * n + [0.0, 1.0, 0.25, 1.0])
    groups = torch.tensor([0] * n + [1] * 4)
    mask = torch.ones(n + 4, 5)
    adv, _, _ = compute_advantages(AlgorithmConfig(adv_estimator=est), rewards, groups, mask)
    assert adv[:n].abs().max().item() == 0.0, adv[:n, 0].tolist()
    assert adv[n:].abs().min().item() > 0  # the mixed group still learns
    assert inert_rows(adv, mask).tolist() == [True] * n + [False] * 4


def test_rloo_by_hand_and_group_of_one():
    adv = A.rloo_advantages(torch.tensor([1.0, 0, 0, 1, 5.0]), torch.tensor([0, 0, 0, 0, 1]))
    # A_0 = 1 − (0+0+1)/3, A_1 = 0 − (1+0+1)/3; a lone sample has no baseline
    assert adv.tolist() == approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0])


def test_rloo_leave_one_out_property():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(12, generator=g)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3])
    adv = A.rloo_advantages(rewards, groups)
    for i in range(12):
        others = [rewards[j] for j in range(12) if groups[j] == groups[i] and j != i]
        assert adv[i].item() == approx((rewards[i] - sum(others) / len(others)).item(), abs=1e-6)
    for k in range(4):  # a group's advantages sum to zero
        assert adv[groups == k].sum().item() == approx(0.0, abs=1e-6)
    n = torch.tensor([3, 3, 3, 4, 4, 4, 4, 2, 2, 3, 3, 3]).float()  # A = n/(n−1)·Dr.GRPO
    assert torch.allclose(adv, n / (n - 1) * A.dr_grpo_advantages(rewards, groups), atol=1e-6)


def test_lite_ppo_group_mean_batch_std():
    adv = A.lite_ppo_advantages(torch.tensor([1.0, 0, 1, 1]), torch.tensor([0, 0, 1, 1]))
    std = math.sqrt(0.1875)  # population std of [1, 0, 1, 1]
    assert adv.tolist() == approx([0.5 / std, -0.5 / std, 0, 0], rel=1e-5)


def test_grpo_unchanged_and_matches_group_stats():
    rewards, groups = torch.tensor([3.0, 1.0, 2.0, 2.0]), torch.tensor([1, 1, 7, 7])
    assert A.grpo_advantages(rewards, groups).tolist() == approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)
    s, n, m = A.group_stats(rewards, groups)
    assert s.tolist() == [4, 4, 4, 4] and n.tolist() == [2, 2, 2, 2] and m.tolist() == [2, 2, 2, 2]


def test_terminal_rewards_and_discounted_returns():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    tr = A.terminal_rewards(torch.tensor([2.0, 3.0, 5.0]), mask)
    assert tr.tolist() == [[0, 0, 2, 0], [0, 0, 0, 3], [0, 0, 0, 0]]
    # a gap in the mask (a tool reply) is skipped: the reward 9 there is not a step
    g = A.discounted_returns(torch.tensor([[1.0, 0, 9, 4]]), torch.tensor([[1, 1, 0, 1]]), gamma=0.5)
    assert close(g, [[2.0, 2.0, 0.0, 4.0]])


def test_reinforce_pp_batch_normalised_returns():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = A.reinforce_pp_advantages(A.terminal_rewards(torch.tensor([1.0, 0.0]), mask), mask)
    std = math.sqrt(0.24)  # returns [1, 1, 0, 0, 0] over 5 tokens: mean 0.4
    assert close(adv, [[0.6 / std, 0.6 / std, 0], [-0.4 / std] * 3])


def test_reinforce_pp_with_group_baseline():
    mask = torch.ones(4, 2)
    adv = A.reinforce_pp_baseline_advantages(torch.tensor([1.0, 0, 0, 0]), torch.zeros(4, dtype=torch.long), mask)
    std = math.sqrt(0.1875)  # r − mean = [.75, −.25, −.25, −.25], each on 2 tokens: mean 0
    assert adv[:, 0].tolist() == approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rel=1e-5)
    assert torch.equal(adv[:, 0], adv[:, 1])


def test_gae_by_hand():
    mask = torch.tensor([[0, 1, 1, 1]])
    values = torch.tensor([[9.0, 0.5, 0.6, 0.8]])
    adv, ret = A.gae_advantages(A.terminal_rewards(torch.tensor([1.0]), mask), values, mask, gamma=0.9, lam=0.8)
    # δ3 = 1 − .8 = .2; δ2 = .9·.8 − .6 = .12; δ1 = .9·.6 − .5 = .04; A_t = δ_t + .72·A_{t+1}
    assert close(adv, [[0.0, 0.04 + 0.72 * 0.264, 0.264, 0.2]])
    assert close(ret, [[0.0, 0.23008 + 0.5, 0.864, 1.0]])


def test_gae_limits():
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(3, 6, generator=g) > 0.3).float()
    r = torch.randn(3, 6, generator=g) * mask
    v = torch.randn(3, 6, generator=g)
    mc, _ = A.gae_advantages(r, v, mask, gamma=0.9, lam=1.0)  # λ = 1: G_t − V_t
    assert torch.allclose(mc, (A.discounted_returns(r, mask, 0.9) - v) * mask, atol=1e-5)
    td, _ = A.gae_advantages(r, v, mask, gamma=0.9, lam=0.0)  # λ = 0: the one-step TD error
    for i in range(3):
        idx = torch.nonzero(mask[i]).squeeze(1).tolist()
        for k, t in enumerate(idx):
            nxt = v[i, idx[k + 1]].item() if k + 1 < len(idx) else 0.0
            assert td[i, t].item() == approx(r[i, t].item() + 0.9 * nxt - v[i, t].item(), abs=1e-5)


def test_masked_whiten():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    out = A.masked_whiten(x, torch.tensor([[1, 1, 0]]))
    assert close(out, [[-1.0, 1.0, 0.0]])


# ---------------------------------------------------------------- aggregation and behaviour correction


X = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
M = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def test_aggregation_modes_by_hand():
    assert aggregate(X, M, "token_mean").item() == approx(10 / 4)
    assert aggregate(X, M, "seq_mean_token_mean").item() == approx((2 + 4) / 2)
    assert aggregate(X, M, "seq_mean_token_sum_norm", norm_const=4).item() == approx((6 / 4 + 4 / 4) / 2)
    assert aggregate(X, M, "seq_mean_token_sum_norm").item() == approx((6 / 3 + 4 / 3) / 2)  # C = longest
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(X, M, "nope")


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_global_denominators_make_micro_batches_sum_to_batch(mode):
    full = aggregate(X, M, mode, norm_const=4)
    parts = [aggregate(X[i : i + 1], M[i : i + 1], mode, 4, global_tokens=4, global_seqs=2) for i in range(2)]
    assert sum(p.item() for p in parts) == approx(full.item())


def weights(*args, **kw):
    b = behaviour_correction(*args, **kw)
    return b.w, b.keep, b.stats


def test_behaviour_weights_truncate_and_mask_by_hand():
    rho = torch.tensor([[0.25, 0.5, 1.0, 3.0, 8.0]])
    behav = torch.zeros(1, 5)
    prox = torch.log(rho)
    mask = torch.ones(1, 5)
    w, keep, st = weights(prox, behav, mask, "truncate", high=2.0)
    assert close(w, [[0.25, 0.5, 1.0, 2.0, 2.0]]) and keep.tolist() == [[1.0] * 5]
    assert st["behav_truncated_frac"] == approx(2 / 5) and st["importance_weight_max"] == approx(2.0)
    w, keep, st = weights(prox, behav, mask, "mask", low=0.5, high=2.0)
    assert keep.tolist() == [[0.0, 1.0, 1.0, 0.0, 0.0]] and close(w, [[0, 0.5, 1.0, 0, 0]])
    assert st["behav_masked_frac"] == approx(3 / 5)
    w, _, st = weights(prox, behav, mask, "none")
    assert w.tolist() == [[1.0] * 5] and st["importance_weight_mean"] == 1.0


def test_behaviour_weights_sequence_levels():
    prox = torch.log(torch.tensor([[2.0, 0.5, 4.0, 9.0]]))  # last token is padding
    behav = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, _, _ = weights(prox, behav, mask, "truncate", high=0.0, level="sequence")
    assert w[0, :3].tolist() == approx([4.0] * 3)  # 2 · 0.5 · 4
    w, _, _ = weights(prox, behav, mask, "truncate", high=0.0, level="geometric")
    assert w[0, :3].tolist() == approx([4 ** (1 / 3)] * 3, rel=1e-5)
    _, keep, _ = weights(prox, behav, mask, "mask", low=0.5, high=2.0, level="sequence")
    assert keep[0, :3].tolist() == [0.0, 0.0, 0.0]  # the whole sequence goes


def test_masking_removes_exactly_the_out_of_range_tokens():
    g = torch.Generator().manual_seed(3)
    logp = torch.log(torch.rand(4, 6, generator=g)).requires_grad_()
    prox = logp.detach() + 0.1 * torch.randn(4, 6, generator=g)
    behav = prox + torch.randn(4, 6, generator=g)  # large behaviour gap: many tokens out of range
    adv = torch.randn(4, 1, generator=g).expand(4, 6)
    mask = (torch.rand(4, 6, generator=g) > 0.2).float()
    rho = torch.exp(prox - behav)
    inside = ((rho >= 0.5) & (rho <= 2.0)).float()
    assert 0 < (inside * mask).sum() < mask.sum()
    loss, st = ppo(logp, prox, behav, adv, mask, behav_correction="mask", behav_low=0.5, behav_high=2.0)
    # same as the uncapped importance-weighted loss over the in-range tokens, same denominator
    ref, _ = ppo(logp, prox, behav, adv, mask * inside, global_tokens=mask.sum())
    assert loss.item() == approx(ref.item(), rel=1e-6)
    assert st["behav_masked_frac"] == approx(((1 - inside) * mask).sum().item() / mask.sum().item())
    (grad,) = torch.autograd.grad(loss, logp)
    out = (mask * (1 - inside)).bool()
    assert grad[out].abs().max().item() == 0.0 and grad[(mask * inside).bool()].abs().min().item() > 0


# ---------------------------------------------------------------- policy losses


def test_clip_fractions_split_by_side():
    logp = L(0.9, 0.3, 0.5, 0.5)
    prox = L(0.6, 0.6, 0.5, 0.5)  # r = 1.5, 0.5, 1, 1
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, st = ppo(logp, prox, prox, adv, torch.ones(1, 4), eps_low=0.2, eps_high=0.28)
    # per token: max(−1.5, −1.28) = −1.28; max(0.5, 0.8) = 0.8; −1; 1
    assert loss.item() == approx((-1.28 + 0.8 - 1 + 1) / 4, rel=1e-5)
    assert st["clip_frac"] == approx(0.5) and st["clip_high_frac"] == approx(0.25)
    assert st["clip_low_frac"] == approx(0.25) and st["ratio_mean"] == approx(1.0, rel=1e-5)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_ratio_one_no_behaviour_gap_is_vanilla_policy_gradient(aggregation):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, generator=g, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[:, :5]
    adv = torch.randn(4, 1, generator=g).expand(4, 5)
    mask = (torch.rand(4, 5, generator=g) > 0.3).float()
    loss, st = ppo(logp, logp.detach(), logp.detach(), adv, mask, aggregation=aggregation, norm_const=5)
    pg = -aggregate(adv * logp, mask, aggregation, norm_const=5)
    g1, g2 = (torch.autograd.grad(x, logits, retain_graph=True)[0] for x in (loss, pg))
    assert torch.allclose(g1, g2, atol=1e-6) and st["clip_frac"] == 0 and st["kl_behav_prox"] == 0


def test_naive_ppo_uses_behaviour_as_old_policy():
    logp, behav = L(0.5, 0.2), L(0.4, 0.25)
    adv = torch.tensor([[1.0, -1.0]])
    # what compute_loss does for algo.loss=ppo: π_old = π_behav, no behaviour correction
    loss, _ = ppo(logp, behav, behav, adv, torch.ones(1, 2), behav_correction="none")
    ref, _ = ppo(logp, behav, behav, adv, torch.ones(1, 2))
    assert loss.item() == approx(ref.item())
    assert loss.item() == approx((-1.2 + 0.8) / 2, rel=1e-5)  # r = 1.25 clipped to 1.2; r = 0.8


def test_gspo_sequence_ratio_by_hand():
    logp, prox = L(0.55, 0.65), L(0.5, 0.5)  # token ratios 1.1, 1.3: s = sqrt(1.43)
    s = math.sqrt(1.1 * 1.3)
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    gspo = {"level": "sequence", "seq_advantage": True, "aggregation": "seq_mean_token_mean"}  # algo.loss=gspo
    loss, st = ppo(logp, prox, prox, adv, mask, eps_low=0.1, eps_high=0.3, **gspo)
    assert loss.item() == approx(-s, rel=1e-5) and st["ratio_mean"] == approx(s, rel=1e-5)
    loss, st = ppo(logp, prox, prox, adv, mask, eps_low=0.1, eps_high=0.1, **gspo)
    assert loss.item() == approx(-1.1, rel=1e-5) and st["clip_frac"] == 1.0


def test_gspo_equals_ppo_when_token_ratios_are_equal():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, generator=g, requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    c = torch.tensor([[0.1], [-0.4], [0.02]])  # one log-ratio per row
    prox = logp.detach() - c
    behav = prox + 0.05 * torch.randn(3, 5, generator=g)
    adv = torch.tensor([[1.0], [-2.0], [0.5]]).expand(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]).float()
    kw = {"aggregation": "seq_mean_token_mean", "behav_level": "geometric"}
    a, sa = ppo(logp, prox, behav, adv, mask, eps_high=0.28, level="sequence", seq_advantage=True, **kw)
    b, sb = ppo(logp, prox, behav, adv, mask, eps_high=0.28, **kw)
    assert a.item() == approx(b.item(), rel=1e-5) and sa["clip_frac"] == sb["clip_frac"] > 0
    ga, gb = (torch.autograd.grad(x, logits, retain_graph=True)[0] for x in (a, b))
    assert torch.allclose(ga, gb, atol=1e-6)


def value_loss(values, old_values, returns, mask, value_clip):
    x = dict(values=values, old_values=old_values, returns=returns)
    return call(critic_loss, values, values, values, None, mask, critic={"clip": value_clip}, **x)


def test_critic_loss_with_value_clipping():
    loss, st = value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), 0.2)
    assert loss.item() == approx(0.5 * 0.8**2) and st["value_clip_frac"] == 1.0  # V_c = 0.2
    loss, st = value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), 0.0)
    assert loss.item() == 0.0 and st["value_clip_frac"] == 0.0
    v = torch.tensor([[1.0, 2.0]], requires_grad=True)  # unclipped side wins: ½·mean(1, 1)
    loss, _ = value_loss(v, torch.tensor([[0.5, 2.0]]), torch.tensor([[0.0, 3.0]]), torch.ones(1, 2), 0.2)
    assert loss.item() == approx(0.5)
    loss.backward()
    assert close(v.grad, [[0.5, -0.5]])


def test_kl_estimators_by_hand_and_unbiased():
    x = math.log(2)  # log π − log π_ref with π = 0.5, π_ref = 0.25
    logp, ref = L(0.5), L(0.25)
    assert kl_penalty(logp, ref, "k1").item() == approx(x)
    assert kl_penalty(logp, ref, "k2").item() == approx(0.5 * x * x)
    assert kl_penalty(logp, ref, "k3").item() == approx(0.5 - 1 + x)
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.2, 0.6])
    kl = (p * (p / q).log()).sum().item()
    for est in ("k1", "k3"):  # E_p[k] = KL(p‖q)
        assert (p * kl_penalty(p.log(), q.log(), est)).sum().item() == approx(kl, rel=1e-5)
    assert (kl_penalty(p.log(), q.log(), "k3") >= 0).all()
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k9")


def test_dpo_and_ipo():
    z = torch.zeros(3)
    loss, st = preference_loss(z, z, z, z, beta=0.1, loss_type="dpo")
    assert loss.item() == approx(math.log(2)) and st["pref_accuracy"] == 0.0
    # h = (−1 − −2) − (−3 − −2) = 2; β h = 1
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -3.0, -2.0, -2.0))
    loss, st = preference_loss(pc, pr, rc, rr, beta=0.5, loss_type="dpo")
    assert loss.item() == approx(-math.log(1 / (1 + math.exp(-1))), rel=1e-6)
    assert st["pref_margin"] == approx(1.0) and st["pref_accuracy"] == 1.0
    loss, _ = preference_loss(pc, pr, rc, rr, beta=0.5, loss_type="dpo", label_smoothing=0.1)
    sig = 1 / (1 + math.exp(-1))
    assert loss.item() == approx(-0.9 * math.log(sig) - 0.1 * math.log(1 - sig), rel=1e-6)
    assert preference_loss(z, z, z, z, beta=0.5, loss_type="ipo")[0].item() == approx(1.0)  # (0 − 1/(2β))²
    assert preference_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo")[0].item() == approx(1.0)  # (2 − 1)²
    with pytest.raises(ValueError):
        preference_loss(z, z, z, z, loss_type="kto")
    logp, mask = torch.tensor([[9.0, -1.0, -2.0]]), torch.tensor([[0.0, 1.0, 1.0]])
    assert sequence_logprobs(logp, mask).item() == -3.0
    assert sequence_logprobs(logp, mask, average=True).item() == -1.5


def test_entropy_from_logits():
    assert entropy_from_logits(torch.zeros(2, 8)).tolist() == approx([math.log(8)] * 2)
    assert entropy_from_logits(torch.tensor([[0.0, -1e4]])).item() == approx(0.0, abs=1e-6)
    z = torch.randn(3, 5)
    p = torch.softmax(z, -1)
    assert torch.allclose(entropy_from_logits(z), -(p * p.log()).sum(-1), atol=1e-6)
    logits = torch.randn(2, 4, 6)
    ids = torch.randint(0, 6, (2, 4))
    lp, h = logprobs_and_entropy_from_logits(logits, ids, temperature=2.0)
    want = torch.log_softmax(logits[:, :-1] / 2, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(lp[:, 1:], want, atol=1e-6) and (lp[:, 0] == 0).all() and (h[:, 0] == 0).all()
    assert torch.allclose(h[:, 1:], entropy_from_logits(logits[:, :-1] / 2), atol=1e-6)


# ---------------------------------------------------------------- data shaping


def test_reward_shaping_and_overlong_penalty():
    r = torch.tensor([-2.0, 0.0, 1.0, 3.0])
    assert shape_rewards(r, scale=2.0, bias=0.5).tolist() == [-3.5, 0.5, 2.5, 6.5]
    assert shape_rewards(r, scale=2.0, bias=0.5, clip=3.0).tolist() == [-3.0, 0.5, 2.5, 3.0]
    pen = overlong_penalty(torch.tensor([10, 16, 18, 20, 21]), max_len=20, buffer=4, factor=1.0)
    assert pen.tolist() == approx([0.0, 0.0, -0.5, -1.0, -1.0])
    assert overlong_penalty(torch.tensor([10, 21]), 20, 0, 0.5).tolist() == [0.0, -0.5]
    assert overlong_penalty(torch.tensor([500]), 0, 0).tolist() == [0.0]


def test_informative_groups():
    keep = informative_groups(torch.tensor([1.0, 1, 0, 1, 0.5, 0.5]), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert keep.tolist() == [False, False, True, True, False, False]


def _groups(spec):
    """spec: key -> (rewards, versions); samples are (reward, version) tuples."""
    return {k: list(zip(r, v)) for k, (r, v) in spec.items()}


def test_dynamic_sampling_drops_uniform_groups_and_waits_for_refill():
    groups = _groups({"a": ([1, 1], [0, 0]), "b": ([1, 0], [1, 1]), "c": ([0, 0], [0, 0]), "d": ([0, 1], [2, 2])})
    sel = select_groups(groups, 2, lambda s: s[0], lambda s: s[1])
    assert sel.batch == ["b", "d"] and sel.dropped == ["a", "c"] and sel.keep == []
    sel = select_groups(groups, 3, lambda s: s[0], lambda s: s[1])
    assert not sel.ready and sel.keep == ["b", "d"] and sel.dropped == ["a", "c"]
    sel = select_groups(groups, 3, lambda s: s[0], lambda s: s[1], dynamic_sampling=False)
    assert sel.batch == ["a", "c", "b"] and sel.keep == ["d"]


def test_dynamic_sampling_never_starves_slow_prompts():
    # a slow prompt's group arrives last but was generated under an old policy version: it goes first
    groups = _groups(
        {
            "fast1": ([1, 0], [5, 5]),
            "fast2": ([0, 1], [5, 6]),
            "fast3": ([0, 1], [6, 6]),
            "slow": ([1, 0], [2, 6]),
            "partial": ([1], [1]),  # still arriving: kept, not trained, not dropped
        }
    )
    sel = select_groups(groups, 2, lambda s: s[0], lambda s: s[1])
    assert sel.batch == ["slow", "fast1"] and sel.keep == ["partial", "fast2", "fast3"]


# ---------------------------------------------------------------- AlgorithmConfig and compute_loss


def _batch(seed=0, n_groups=3, size=4, t=7):
    g = torch.Generator().manual_seed(seed)
    n = n_groups * size
    logits = torch.randn(n, t, 5, generator=g, requires_grad=True)
    ids = torch.randint(0, 5, (n, t), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    prox = logp.detach() + 0.05 * torch.randn(n, t, generator=g)
    behav = prox + 0.2 * torch.randn(n, t, generator=g)
    ref = prox + 0.1 * torch.randn(n, t, generator=g)
    mask = torch.zeros(n, t)
    for i in range(n):
        mask[i, 2 : 2 + 1 + (i * 3) % (t - 2)] = 1
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    group_index = torch.arange(n) // size
    return logits, logp, prox, behav, ref, rewards, group_index, mask


def test_default_config_reproduces_todays_trainer():
    _, logp, prox, behav, _, rewards, gi, mask = _batch()
    loss, m = compute_loss(AlgorithmConfig(), logp, prox, behav, rewards, gi, mask)
    adv = A.grpo_advantages(rewards, gi)[:, None].expand_as(mask)
    ref, st = ppo(logp, prox, behav, adv, mask, eps_high=0.28, behav_high=5.0)
    assert loss.item() == approx(ref.item(), rel=1e-6)
    for key in ("clip_frac", "importance_weight_mean", "kl_behav_prox", "behav_masked_frac", "adv_std"):
        assert key in m
    assert m["clip_frac"] == st["clip_frac"]


def test_every_preset_validates_and_gives_a_finite_loss_with_gradient():
    for name in PRESETS:
        cfg = from_preset(name)
        logits, logp, prox, behav, ref, rewards, gi, mask = _batch(seed=1, n_groups=4, size=2)
        need = required_inputs(cfg)
        kw = {"ref_logp": ref if "ref_logp" in need else None}
        if "teacher_logp" in need:  # on-policy distillation: any other model's log-probs
            kw["teacher_logp"] = ref
        if "values" in need:
            kw["values"] = torch.randn(*mask.shape, requires_grad=True)
            kw["old_values"] = kw["values"].detach() + 0.1
        loss, metrics = compute_loss(cfg, logp, prox, behav, rewards, gi, mask, **kw)
        (grad,) = torch.autograd.grad(loss, logits)
        assert math.isfinite(loss.item()) and grad.abs().sum() > 0, name
        assert all(math.isfinite(v) for v in metrics.values()), name


def test_required_inputs():
    assert required_inputs(AlgorithmConfig()) == set()
    assert required_inputs(from_preset("ppo_critic")) == {"values", "old_values"}
    assert required_inputs(from_preset("reinforce_pp")) == {"ref_logp"}
    assert required_inputs(from_preset("dpo")) == {"ref_logp"}
    assert required_inputs(AlgorithmConfig(entropy_coef=0.01)) == {"entropy"}
    with pytest.raises(ValueError, match="ref_logp"):
        _, logp, prox, behav, _, rewards, gi, mask = _batch()
        compute_loss(AlgorithmConfig(kl_coef=0.1), logp, prox, behav, rewards, gi, mask)


def test_validation_names_the_key():
    for bad, key in [
        ({"adv_estimator": "ppo2"}, "adv_estimator"),
        ({"aggregation": "sum"}, "aggregation"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"behav_correction": "mask", "behav_low": 3.0, "behav_high": 2.0}, "behav_low"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"overlong_max_len": 4, "overlong_buffer": 8}, "overlong_buffer"),
    ]:
        with pytest.raises(ConfigError, match=f"algo.{key}"):
            AlgorithmConfig.from_data(bad, prefix="algo")
    with pytest.raises(ConfigError, match="preset"):
        from_preset("a2c")


def test_kl_loss_term_and_entropy_bonus_add_up():
    _, logp, prox, behav, ref, rewards, gi, mask = _batch()
    base, _ = compute_loss(AlgorithmConfig(), logp, prox, behav, rewards, gi, mask)
    ent = torch.rand(*mask.shape)
    cfg = AlgorithmConfig(kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01)
    loss, m = compute_loss(cfg, logp, prox, behav, rewards, gi, mask, ref_logp=ref, entropy=ent)
    kl = masked_mean(0.5 * (logp - ref) ** 2, mask)
    want = base + 0.1 * kl - 0.01 * masked_mean(ent, mask)
    assert loss.item() == approx(want.item(), rel=1e-6)
    assert m["kl_ref"] == approx(kl.item(), rel=1e-6) and m["entropy"] == approx(masked_mean(ent, mask).item())


def test_kl_as_reward_for_scalar_and_token_estimators():
    _, logp, prox, behav, ref, rewards, gi, mask = _batch()
    cfg = AlgorithmConfig(adv_estimator="dr_grpo", kl_coef=0.5, kl_estimator="k1", kl_as_reward=True)
    adv, _, _ = compute_advantages(cfg, rewards, gi, mask, prox_logp=prox, ref_logp=ref)
    shaped = rewards - 0.5 * ((prox - ref) * mask).sum(1)
    assert torch.allclose(adv, A.broadcast(A.dr_grpo_advantages(shaped, gi), mask), atol=1e-6)
    cfg = AlgorithmConfig(adv_estimator="reinforce_pp", kl_coef=0.5, kl_estimator="k1", kl_as_reward=True)
    adv, _, _ = compute_advantages(cfg, rewards, gi, mask, prox_logp=prox, ref_logp=ref)
    tr = A.terminal_rewards(rewards, mask) - 0.5 * (prox - ref) * mask
    assert torch.allclose(adv, A.reinforce_pp_advantages(tr, mask), atol=1e-6)


def test_reward_shaping_applies_before_the_estimator():
    mask = torch.zeros(2, 30)
    mask[0, :10], mask[1, :22] = 1, 1  # lengths 10 and 22
    cfg = AlgorithmConfig(
        adv_estimator="dr_grpo", reward_scale=2.0, reward_bias=-1.0, overlong_max_len=24, overlong_buffer=4
    )
    adv, _, m = compute_advantages(cfg, torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), mask)
    # rewards 2·1 − 1 = 1 each; penalty (20 − 22)/4 = −0.5 on the long one: [1, 0.5], mean 0.75
    assert adv[:, 0].tolist() == approx([0.25, -0.25]) and m["reward_mean"] == approx(0.75)


def test_micro_batches_with_global_denominators_sum_to_the_batch_loss():
    for name in ("grpo", "gspo", "dr_grpo"):
        cfg = from_preset(name, norm_const=8.0)
        _, logp, prox, behav, _, rewards, gi, mask = _batch(seed=4)
        adv, _, _ = compute_advantages(cfg, rewards, gi, mask)
        full, _ = compute_loss(cfg, logp, prox, behav, rewards, gi, mask, advantages=adv)
        n_tok, n_seq = mask.sum().item(), float((mask.sum(1) > 0).sum())
        total = 0.0
        for rows in (slice(0, 5), slice(5, 12)):
            part, _ = compute_loss(
                cfg, logp[rows], prox[rows], behav[rows], rewards[rows], gi[rows], mask[rows],
                advantages=adv[rows], global_tokens=n_tok, global_seqs=n_seq,
            )  # fmt: skip
            total += part.item()
        assert total == approx(full.item(), rel=1e-5), name


def test_ppo_critic_trains_the_value_head():
    _, logp, prox, behav, _, rewards, gi, mask = _batch()
    values = torch.zeros(*mask.shape, requires_grad=True)
    cfg = from_preset("ppo_critic")
    loss, m = compute_loss(cfg, logp, prox, behav, rewards, gi, mask, values=values, old_values=values.detach())
    (gv,) = torch.autograd.grad(loss, values)
    # zero values: returns = rewards on every policy token (γ = 1), ∂/∂V of 0.5·½(V − R)² token-mean
    _, ret = A.gae_advantages(A.terminal_rewards(rewards, mask), values.detach(), mask, 1.0, 0.95)
    assert torch.allclose(gv, 0.5 * (values.detach() - ret) * mask / mask.sum(), atol=1e-7)
    assert "explained_variance" in m and "value_clip_frac" in m


def test_dpo_through_compute_loss_uses_group_pairs():
    _, logp, _, _, _, _, _, mask = _batch(n_groups=3, size=2)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # third pair is a tie: ignored
    gi = torch.tensor([0, 0, 1, 1, 2, 2])
    loss, m = compute_loss(from_preset("dpo"), logp, logp, logp, rewards, gi, mask, ref_logp=logp.detach())
    assert loss.item() == approx(math.log(2)) and m["pref_pairs"] == 2.0
    ref = logp.detach().clone()
    ref[0] -= 1.0 / mask[0].sum()  # chosen of pair 0 gains exactly 1 nat over the reference
    loss, _ = compute_loss(from_preset("dpo", dpo={"beta": 1.0}), logp, logp, logp, rewards, gi, mask, ref_logp=ref)
    want = (-math.log(1 / (1 + math.exp(-1))) + math.log(2)) / 2
    assert loss.item() == approx(want, rel=1e-5)


def test_yaml_examples_are_the_presets():
    folder = ROOT / "configs" / "algorithms"
    names = {p.stem for p in folder.glob("*.yaml")}
    assert {"grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo", "lite_ppo", "ppo_critic"} <= names
    assert set(PRESETS) == names
    for name in names:
        data = yaml.safe_load((folder / f"{name}.yaml").read_text())
        assert set(data) == {"algo"}, name
        cfg = AlgorithmConfig.from_data(data["algo"] or {}, prefix="algo")
        assert cfg == from_preset(name), name
        check_algorithm(cfg)  # its loss is a registered one
