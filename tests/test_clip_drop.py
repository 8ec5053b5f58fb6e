"""The staleness study's mechanism control (issue 47): `algo.decoupled_ppo.behav_clip_drop` (decoupled PPO's own
setting; `algo.behav_clip_drop` before issue 56) drops from decoupled PPO the tokens naive PPO's clip against π_behav
removes, and the step's metrics.

With one minibatch (π_θ = π_prox at the update), naive PPO's gradient is decoupled PPO's with w
uncapped minus those tokens: A > 0 with w > 1 + ε_high and A < 0 with w < 1 − ε_low. So decoupled,
uncapped, `both` must give naive PPO's gradient, and `positive` must differ from it exactly on the
A < 0 side. The same identity through the real trainer step: equal parameters after the step.
"""

from __future__ import annotations

import pytest
import torch

from areal_core.config import ConfigError, load_config
from areal_core.config.algorithm import AlgorithmConfig
from areal_core.train.loss.common import masked_mean
from areal_core.train.loss.registry import LossInputs, get_loss
from tests.test_fsdp import MODEL, fixed_batches, make_model, make_optimizer

UNCAPPED = {"loss": "decoupled_ppo", "behav_correction": "truncate", "behav_high": 0.0}
EPS = {"eps_low": 0.2, "eps_high": 0.2}


def drop(mode: str) -> dict:
    """The setting, as AlgorithmConfig takes it: decoupled PPO's section."""
    return {"decoupled_ppo": {"behav_clip_drop": mode}}


def inputs(seed: int = 0, n: int = 24, t: int = 9, spread: float = 0.5) -> tuple[LossInputs, torch.Tensor]:
    """Random rows at the start of an update (π_θ = π_prox) with π_behav up to e^±spread away; the
    returned leaf is log π_θ, whose gradient the tests compare."""
    g = torch.Generator().manual_seed(seed)
    theta = (-torch.rand(n, t, generator=g) * 3 - 0.1).requires_grad_()
    behav = theta.detach() + (torch.rand(n, t, generator=g) * 2 - 1) * spread
    mask = (torch.rand(n, t, generator=g) > 0.2).float()
    adv = torch.randn(n, 1, generator=g).expand(n, t) * mask
    x = LossInputs(
        logp=theta,
        prox_logp=theta.detach().clone(),
        behav_logp=behav,
        mask=mask,
        rewards=torch.zeros(n),
        group_index=torch.arange(n) // 4,
        advantages=adv.contiguous(),
    )
    return x, theta


def grad_of(cfg: AlgorithmConfig, x: LossInputs, leaf: torch.Tensor) -> tuple[torch.Tensor, dict]:
    leaf.grad = None
    loss, stats = get_loss(cfg.loss)(cfg, x)
    loss.backward()
    return leaf.grad.clone(), stats


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoupled_uncapped_with_both_drops_is_naive_ppo_at_one_minibatch(seed):
    x, leaf = inputs(seed)
    naive, naive_stats = grad_of(AlgorithmConfig(loss="ppo", **EPS), x, leaf)
    both, both_stats = grad_of(AlgorithmConfig(**UNCAPPED, **EPS, **drop("both")), x, leaf)
    plain, _ = grad_of(AlgorithmConfig(**UNCAPPED, **EPS), x, leaf)
    assert torch.allclose(both, naive, atol=1e-7, rtol=1e-6)
    assert not torch.allclose(plain, naive, atol=1e-4)  # without the drop the two differ
    # the dropped share is the share naive PPO clipped (its r = w at the start, the clip binds there)
    assert both_stats["behav_clip_dropped_frac"] == pytest.approx(naive_stats["clip_frac"], abs=1e-6)
    assert 0.05 < both_stats["behav_clip_dropped_frac"] < 0.6


def test_positive_drops_only_the_tokens_whose_probability_rose_and_whose_advantage_is_positive():
    x, leaf = inputs(3)
    rho = torch.exp(x.prox_logp - x.behav_logp)
    rising = (x.advantages > 0) & (rho > 1.2) & (x.mask > 0)
    falling = (x.advantages < 0) & (rho < 0.8) & (x.mask > 0)
    assert rising.any() and falling.any()
    naive, _ = grad_of(AlgorithmConfig(loss="ppo", **EPS), x, leaf)
    plain, _ = grad_of(AlgorithmConfig(**UNCAPPED, **EPS), x, leaf)
    positive, stats = grad_of(AlgorithmConfig(**UNCAPPED, **EPS, **drop("positive")), x, leaf)
    assert torch.count_nonzero(positive[rising]) == 0 and torch.count_nonzero(plain[rising]) > 0
    assert torch.equal(positive[~rising], plain[~rising])
    assert torch.allclose(positive[~falling], naive[~falling], atol=1e-7, rtol=1e-6)  # naive also drops `falling`
    assert stats["behav_clip_dropped_frac"] == pytest.approx(masked_mean(rising.float(), x.mask).item(), abs=1e-6)


def test_the_drop_composes_with_a_truncated_weight_and_leaves_other_tokens_as_they_were():
    x, leaf = inputs(4, spread=2.5)  # w beyond 5 on some tokens
    trunc = {"loss": "decoupled_ppo", "behav_correction": "truncate", "behav_high": 5.0, **EPS}
    plain, plain_stats = grad_of(AlgorithmConfig(**trunc), x, leaf)
    both, stats = grad_of(AlgorithmConfig(**trunc, **drop("both")), x, leaf)
    assert plain_stats["behav_truncated_frac"] > 0
    assert stats["behav_truncated_frac"] == plain_stats["behav_truncated_frac"]
    kept = both != 0
    assert torch.equal(both[kept], plain[kept]) and stats["behav_clip_dropped_frac"] > 0


def test_split_clip_fractions_and_the_sampled_entropy():
    x, leaf = inputs(5)
    _, stats = grad_of(AlgorithmConfig(loss="ppo", **EPS), x, leaf)
    r = torch.exp(x.prox_logp - x.behav_logp)  # naive PPO's ratio at the start of the update
    pos, neg = (x.advantages > 0).float() * x.mask, (x.advantages < 0).float() * x.mask
    assert stats["clip_frac_adv_pos"] == pytest.approx(masked_mean((r > 1.2).float(), pos).item(), abs=1e-6)
    assert stats["clip_frac_adv_neg"] == pytest.approx(masked_mean((r < 0.8).float(), neg).item(), abs=1e-6)
    assert stats["sampled_entropy"] == pytest.approx(masked_mean(-x.behav_logp, x.mask).item(), rel=1e-6)


SETTING = "algo.decoupled_ppo.behav_clip_drop"


def test_the_drop_is_refused_outside_token_level_decoupled_ppo():
    """Decoupled PPO's own setting: set under another loss (its variants too), or the old flat key under
    another loss, it is refused, not a run that trains without the drop; so is a sequence-level correction."""
    from areal_core.train.loss import check_algorithm

    for loss in ("ppo", "gspo", "gspo_token", "distill", "cispo", "sapo"):
        for given in (f"{SETTING}=positive", "algo.behav_clip_drop=positive"):
            cfg = load_config(None, [f"algo.loss={loss}", given]).algo
            with pytest.raises(ConfigError, match=rf"'{SETTING}': algo.loss={loss} does not apply it; .*decoupled_ppo"):
                check_algorithm(cfg)
    with pytest.raises(ConfigError, match=r"'algo\.decoupled_ppo\.behav_clip_drop' applies to a token-level"):
        check_algorithm(load_config(None, ["algo.behav_level=geometric", f"{SETTING}=positive"]).algo)
    with pytest.raises(ConfigError, match=r"'algo\.decoupled_ppo\.behav_clip_drop'"):
        check_algorithm(load_config(None, [f"{SETTING}=sideways"]).algo)
    assert [loss.name for loss in check_algorithm(load_config(None, [f"{SETTING}=both"]).algo)] == ["decoupled_ppo"]
    assert check_algorithm(load_config(None, ["algo.loss=gspo", f"{SETTING}=none"]).algo)  # its default: no drop


def test_the_previous_releases_flat_key_still_drops_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"'algo\.behav_clip_drop' is deprecated .* write algo\.decoupled_ppo"):
        cfg = load_config(None, ["algo.behav_clip_drop=both", "algo.behav_correction=truncate", "algo.behav_high=0"])
    assert cfg.algo.section("decoupled_ppo") == {"behav_clip_drop": "both"}
    x, leaf = inputs(7)
    old, stats = grad_of(cfg.algo.model_copy(update=EPS), x, leaf)
    new, _ = grad_of(AlgorithmConfig(**UNCAPPED, **EPS, **drop("both")), x, leaf)
    assert torch.equal(old, new) and stats["behav_clip_dropped_frac"] > 0
    # a stored config.yaml of the previous release holds `behav_clip_drop: none`: dropped without a word
    assert "behav_clip_drop" not in AlgorithmConfig(behav_clip_drop="none").model_dump()


def trained(algo: list[str]) -> dict[str, torch.Tensor]:
    from areal_core.train.step import train_step

    cfg = load_config(None, [*cfg_overrides(), *algo])
    model = make_model(cfg)
    # SGD: the step is −lr·g, so equal parameters mean equal gradients (AdamW's first step, g/|g|,
    # would turn float noise on near-zero gradients into ±lr)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
    stats = train_step(model, opt, fixed_batches()[0], cfg, 0)
    return dict(model.state_dict()), stats


def cfg_overrides() -> list[str]:
    return [*MODEL, "train.batch_groups=2", "train.lr=3e-3", "algo.eps_low=0.2", "algo.eps_high=0.2"]


def test_through_the_trainer_step_decoupled_with_both_drops_trains_as_naive_ppo():
    torch.set_num_threads(1)
    naive, naive_stats = trained(["algo.loss=ppo"])
    both, stats = trained(["algo.behav_correction=truncate", "algo.behav_high=0", f"{SETTING}=both"])
    plain, _ = trained(["algo.behav_correction=truncate", "algo.behav_high=0"])
    assert stats["behav_clip_dropped_frac"] > 0.05 and naive_stats["clip_frac"] > 0.05
    assert all(torch.allclose(both[k], naive[k], atol=1e-6) for k in naive)
    assert not all(torch.allclose(plain[k], naive[k], atol=1e-6) for k in naive)


def test_the_step_reports_the_whole_batchs_advantage_metrics():
    """train_step's advantage metrics are the whole batch's (compute_advantages), for 1 and 2 minibatches:
    a minibatch's were once added to them, doubling adv_mean/std/min/max."""
    from areal_core.train.algorithm import compute_advantages
    from areal_core.train.step import train_step

    for mb in (1, 2):
        cfg = load_config(None, [*cfg_overrides(), f"train.ppo_minibatches={mb}", "algo.adv_estimator=batch_norm"])
        samples = fixed_batches()[0]
        model = make_model(cfg)
        stats = train_step(model, make_optimizer(model, cfg), samples, cfg, 0)
        rewards = torch.tensor([s.reward for s in samples])
        masks = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples]
        mask = torch.nn.utils.rnn.pad_sequence(masks, batch_first=True)
        _, _, want = compute_advantages(cfg.algo, rewards, torch.arange(len(samples)), mask)
        for key in ("adv_mean", "adv_std", "adv_min", "adv_max"):
            assert stats[key] == pytest.approx(want[key], abs=1e-5), (mb, key)
        assert stats["adv_std"] == pytest.approx(1.0, abs=1e-4)


def test_prepare_refuses_the_drop_for_a_loss_that_ignores_it_before_writing_the_run(tmp_path):
    """A clumsy `algo.loss=ppo algo.behav_clip_drop=positive` is one ConfigError at prepare, before SFT
    and before the run's store exists, not a run that silently trains without the drop."""
    from areal_core.run import pipeline

    store = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^config key 'algo.decoupled_ppo.behav_clip_drop': algo.loss=ppo does not"):
        pipeline.prepare(
            "configs/default.yaml",
            ["algo.loss=ppo", "algo.behav_clip_drop=positive", f"store={store}", "tracking.enabled=false"],
        )
    assert not store.exists()
