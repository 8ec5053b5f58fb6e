"""The loss registry (areal_core/train/loss/): what each loss declares, how `algo.loss` is
validated, that a loss is one module, and that no code outside the registry tests a loss's name."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch

from areal_core.config import ConfigError
from areal_core.config.algorithm import PRESETS, AlgorithmConfig, from_preset
from areal_core.train.algorithm import compute_loss, required_inputs, total_loss
from areal_core.train.loss import registry
from areal_core.train.loss.registry import Loss, LossInputs, check_algorithm, get_loss, known_losses, register

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "areal_core" / "train" / "loss"


def test_the_losses_of_issue_22_are_registered_with_their_declarations():
    assert {"decoupled_ppo", "ppo", "gspo", "gspo_token", "dpo", "ipo"} <= set(known_losses())
    declared = {
        name: (loss.needs, loss.level, loss.distributed, loss.kl_term)
        for name in ("decoupled_ppo", "ppo", "gspo", "gspo_token", "dpo", "ipo")
        for loss in [get_loss(name)]
    }
    adv = frozenset({"advantages"})
    pairs = frozenset({"ref_logp", "pairs"})
    assert declared == {
        "decoupled_ppo": (adv, "token", True, True),
        "ppo": (adv, "token", True, True),
        "gspo": (adv, "sequence", True, True),
        "gspo_token": (adv, "sequence", True, True),
        "dpo": (pairs, "sequence", False, False),
        "ipo": (pairs, "sequence", False, False),
    }
    (critic,) = registry.terms(from_preset("ppo_critic"), get_loss("decoupled_ppo"))
    assert critic.name == "critic" and critic.kind == "term" and not critic.distributed
    assert critic.needs == {"values", "old_values", "returns"} and critic.coef(from_preset("ppo_critic")) == 0.5
    assert "critic" not in known_losses()  # a term, not a value of algo.loss
    # the critic joins only a loss that uses advantages, and only under a critic-reading estimator
    assert registry.terms(AlgorithmConfig(adv_estimator="gae", loss="dpo"), get_loss("dpo")) == []
    assert registry.terms(AlgorithmConfig(), get_loss("decoupled_ppo")) == []


def test_an_unknown_loss_is_a_config_error_naming_the_known_losses_before_any_work():
    cfg = AlgorithmConfig(loss="a2c")  # the config layer only knows it is a string
    for check in (check_algorithm, required_inputs):
        with pytest.raises(ConfigError, match=r"config key 'algo.loss' must be one of .*'decoupled_ppo'.*got 'a2c'"):
            check(cfg)
    from areal_core.config import load_config
    from areal_core.train.step import train_step

    run_cfg = load_config(None, ["algo.loss=a2c"])
    with pytest.raises(ConfigError, match="algo.loss"):  # no model, no samples: it fails first
        train_step(None, None, [], run_cfg, 0)


def test_losses_that_cannot_be_sharded_are_refused_on_more_than_one_rank():
    for name in ("dpo", "ipo", "ppo_critic"):
        with pytest.raises(ConfigError, match="cannot run on more than one rank"):
            check_algorithm(from_preset(name), distributed=True)
        check_algorithm(from_preset(name))
    for name in ("grpo", "gspo", "naive_ppo", "dr_grpo"):
        assert [loss.name for loss in check_algorithm(from_preset(name), distributed=True)] == [from_preset(name).loss]


def test_every_loss_class_in_the_package_is_registered():
    """A module that defines a named Loss subclass without @register would be a silent no-op."""
    named = {}
    for info in pkgutil.iter_modules([str(PACKAGE)]):
        module = importlib.import_module(f"areal_core.train.loss.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Loss) and cls.__module__ == module.__name__ and "name" in vars(cls):
                named[cls.name] = cls
    table = {**registry._LOSSES, **registry._TERMS}
    assert named and {n: type(table.get(n)) for n in named} == named


def test_every_policy_loss_has_a_preset():
    """Adding a loss is one module plus one preset: the algorithm matrix runs each preset."""
    named = {from_preset(name).loss for name in PRESETS}
    assert set(known_losses()) <= named


def test_no_code_outside_the_registry_tests_a_loss_name():
    names = set(known_losses()) | set(registry._TERMS)
    found = []
    for path in (ROOT / "areal_core").rglob("*.py"):
        if PACKAGE in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append((str(path.relative_to(ROOT)), node.value))
    # the default of algo.loss; the previous release's flat keys name the section each moved to, for one release
    moved = "areal_core/config/moved_keys.py"
    assert [f for f in found if f[0] != moved] == [("areal_core/config/algorithm.py", "decoupled_ppo")]


def test_registration_checks_the_declarations():
    class Bad(Loss):
        name = "not a name"
        level = "row"
        needs = frozenset({"teacher"})

    with pytest.raises(TypeError, match=r"a name.*level in.*needs within"):
        register(Bad)

    class Clash(Loss):
        name = "dpo"

    with pytest.raises(TypeError, match="registered twice"):
        register(Clash)


@pytest.fixture
def test_loss():
    """A REINFORCE loss registered for one test: L = −agg(A·log π_θ)."""

    @register
    class Reinforce(Loss):
        name = "test_reinforce"

        def __call__(self, cfg, x):
            return x.reduce(-x.advantages * x.logp, cfg), {"test_reinforce_calls": 1.0}

    yield Reinforce
    del registry._LOSSES["test_reinforce"]


def test_a_registered_loss_runs_through_the_trainer_entry_points(test_loss):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, 5, generator=g, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[..., 0]
    mask = torch.tensor([[0.0, 1, 1], [0, 1, 0], [0, 1, 1], [1, 1, 1]])
    rewards, gi = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1])
    cfg = AlgorithmConfig(loss="test_reinforce", adv_estimator="dr_grpo")
    assert required_inputs(cfg) == set() and "test_reinforce" in known_losses()
    loss, m = compute_loss(cfg, logp, logp.detach(), logp.detach(), rewards, gi, mask)
    adv = torch.tensor([0.5, -0.5, -0.5, 0.5])[:, None] * mask  # Dr.GRPO: r − mean_g r
    assert loss.item() == pytest.approx((-(adv * logp).sum() / mask.sum()).item(), rel=1e-6)
    assert m["test_reinforce_calls"] == 1.0 and m["loss"] == loss.item() and "adv_mean" in m
    x = LossInputs(logp=logp, prox_logp=logp, behav_logp=logp, mask=mask, rewards=rewards, group_index=gi)
    assert total_loss(cfg, x)[0].item() == loss.item()
