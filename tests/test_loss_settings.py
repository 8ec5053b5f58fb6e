"""A loss owns its settings (issue 56): each loss module declares them (a LossSettings model registered with
the loss), a config gives them under the loss's name (`algo.sapo.tau_neg`), prepare validates them and
writes them out in full, the generated config table lists them, and the previous release's flat keys
(`algo.sapo_tau_neg`) and stored configs still load, with a DeprecationWarning naming the new key."""

from __future__ import annotations

import logging
import math
import sys
import warnings

import pytest
import torch
from pydantic import Field

from areal_core.config import ConfigError, RunConfig, from_yaml_text, load_config, to_yaml
from areal_core.config.algorithm import AlgorithmConfig, from_preset
from areal_core.config.base import Float
from areal_core.context import load_run_config
from areal_core.layout import LAYOUT
from areal_core.run import pipeline
from areal_core.store import Store
from areal_core.train.loss import Loss, LossSettings, check_algorithm, get_loss, register, registry, settings_models
from areal_core.train.loss.distill import DistillSettings
from areal_core.train.loss.dpo import DpoSettings
from areal_core.train.loss.ipo import IpoSettings
from areal_core.train.loss.m2po import M2poSettings
from areal_core.train.loss.sapo import SapoSettings
from tests.conftest import ROOT, TINY
from tests.loss_inputs import loss_inputs

SMALL = ["task.num_train=40", "task.num_eval=8"]


def sapo_on_one_token(cfg: AlgorithmConfig) -> float:
    """SAPO's loss at r = 1, w = 1, A = −1: −(4/τ_neg)·σ(0)·A = 2/τ_neg."""
    x = loss_inputs(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1))
    loss, _ = get_loss(cfg.loss)(cfg, x)
    return loss.item()


# -- the new shape ------------------------------------------------------------------------------
def test_a_setting_given_under_the_loss_name_reaches_the_loss():
    cfg = load_config(None, ["algo.loss=sapo", "algo.sapo.tau_neg=3.0"]).algo
    assert check_algorithm(cfg) == [get_loss("sapo")]
    assert SapoSettings.of(cfg) == SapoSettings(tau_pos=1.0, tau_neg=3.0)
    assert sapo_on_one_token(cfg) == pytest.approx(2 / 3.0)
    assert sapo_on_one_token(load_config(None, ["algo.loss=sapo"]).algo) == pytest.approx(2 / 1.05)  # the default
    # a preset's section merges key by key with an override of the same section
    distill = from_preset("distill_only", distill={"teacher_path": "/t"})
    assert DistillSettings.of(distill) == DistillSettings(teacher_path="/t", coef=1.0, rl_coef=0.0)


def test_every_loss_setting_is_read_from_its_section():
    given = {"dpo": DpoSettings(beta=0.3, label_smoothing=0.2), "ipo": IpoSettings(beta=0.7)}
    cfg = AlgorithmConfig(loss="ipo", **{name: s.model_dump() for name, s in given.items()})
    assert get_loss("ipo").settings(cfg) == given["ipo"] and DpoSettings.of(cfg) == given["dpo"]
    assert set(settings_models()) == {"critic", "decoupled_ppo", "distill", "dpo", "ipo", "kpop", "m2po", "sapo"}
    for name, model in settings_models().items():  # each model is its own loss's, bound to its name
        assert model.section == name and model.of(AlgorithmConfig()) == model()


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["algo.sapo.tau=1.0"], r"unknown config key 'algo\.sapo\.tau'"),
        (["algo.sapo.tau_pos=-1"], r"config key 'algo\.sapo\.tau_pos' must be > 0, got -1"),
        (["algo.sapo.tau_pos=.nan"], r"'algo\.sapo\.tau_pos' must be a finite number"),
        (["algo.loss=dpo", "algo.dpo.label_smoothing=5"], r"'algo\.dpo\.label_smoothing' must be in \[0, 0\.5\)"),
        (["algo.distill.coef=high"], r"'algo\.distill\.coef' must be a number, got 'high'"),
        (["algo.sappo.tau_pos=1.0"], r"config key 'algo\.sappo' is no setting: .*there is no loss 'sappo'"),
        (["algo.gspo.eps=0.1"], r"unknown config key 'algo\.gspo\.eps'"),  # a loss with no settings
    ],
)
def test_a_bad_setting_is_one_config_error_at_prepare(tmp_path, overrides, match):
    load_config(None, overrides)  # the config layer keeps a section as given: the loss's model checks it
    with pytest.raises(ConfigError, match=match) as err:
        pipeline.prepare("", [*TINY, *SMALL, f"store={tmp_path / 'r'}", "algo.loss=sapo", *overrides])
    assert "\n" not in str(err.value) and not (tmp_path / "r").exists()  # before any work


def test_a_scalar_where_a_section_belongs_is_refused_when_loaded():
    for override, match in (("algo.sapo=1", "unknown config key 'algo.sapo'"), ("algo.nosuch=1", "'algo.nosuch'")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, [override])


def test_an_unused_loss_section_is_validated_and_logged(caplog):
    cfg = load_config(None, ["algo.loss=sapo", "algo.m2po.threshold=0.1"]).algo
    with caplog.at_level(logging.WARNING, logger="areal.loss"):
        check_algorithm(cfg)
    assert "'algo.m2po' is set, but algo.loss=sapo does not use it" in caplog.text
    with pytest.raises(ConfigError, match="'algo.m2po.threshold' must be > 0"):
        check_algorithm(load_config(None, ["algo.loss=sapo", "algo.m2po.threshold=0"]).algo)


def test_prepare_writes_the_active_losses_settings_in_full(tmp_path):
    uri, _ = pipeline.prepare("", [*TINY, *SMALL, f"store={tmp_path / 'r'}", "algo.loss=m2po", "algo.sapo.tau_pos=2.0"])
    stored = load_run_config(Store(uri)).algo
    assert stored.section("m2po") == {"threshold": 0.04}  # the default, written out
    assert stored.section("sapo") == {"tau_pos": 2.0}  # not the active loss: as given
    assert M2poSettings.of(stored).threshold == 0.04


def test_a_loss_needs_its_own_settings_class_and_a_name_no_shared_key_has(monkeypatch):
    monkeypatch.setattr(registry, "_LOSSES", dict(registry._LOSSES))  # this test's losses leave with it

    class Shared(LossSettings):
        x: Float = Field(1.0, description="x")

    @register
    class First(Loss):
        name = "test_settings_first"
        Settings = Shared

    class Second(Loss):
        name = "test_settings_second"
        Settings = Shared

    class Gamma(Loss):
        name = "gamma"

    with pytest.raises(TypeError, match=r"its Settings .*Shared are loss 'test_settings_first''s"):
        register(Second)
    with pytest.raises(TypeError, match="a name that is not a shared algo"):
        register(Gamma)
    assert Shared.of(AlgorithmConfig(test_settings_first={"x": 2.0})).x == 2.0


# -- the config table -----------------------------------------------------------------------------
def test_the_config_table_lists_every_loss_setting():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import config_table
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    rows = {key: (default, text) for key, default, text in config_table.rows()}
    for loss, model in settings_models().items():
        for name, field in model.model_fields.items():
            assert rows[f"algo.{loss}.{name}"] == (field.default, field.description)
    assert rows["algo.sapo.tau_neg"][0] == 1.05 and "algo.sapo_tau_neg" not in rows
    assert "| `algo.m2po.threshold` | `0.04` |" in (ROOT / "README.md").read_text()


# -- the previous release's shape -----------------------------------------------------------------
def test_an_old_flat_key_maps_to_its_loss_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"'algo\.sapo_tau_neg' is deprecated .* write algo\.sapo\.tau_neg"):
        cfg = load_config(None, ["algo.loss=sapo", "algo.sapo_tau_neg=3.0"]).algo
    assert cfg.section("sapo") == {"tau_neg": 3.0} and sapo_on_one_token(cfg) == pytest.approx(2 / 3.0)
    with pytest.warns(DeprecationWarning, match=r"write algo\.ipo\.beta"):  # IPO read dpo_beta too
        assert IpoSettings.of(AlgorithmConfig(loss="ipo", dpo_beta=0.5)).beta == 0.5
    with pytest.warns(DeprecationWarning, match=r"write algo\.m2po\.threshold"):
        assert M2poSettings.of(from_preset("m2po", m2_threshold=10.0)).threshold == 10.0
    with pytest.warns(DeprecationWarning, match=r"write algo\.critic\.lr"):
        assert load_config(None, ["algo.critic_lr=1e-3"]).algo.section("critic") == {"lr": 1e-3}
    with pytest.raises(ConfigError, match=r"'algo\.m2_threshold' \(deprecated\) is 0\.1 but algo\.m2po\.threshold"):
        load_config(None, ["algo.m2_threshold=0.1", "algo.m2po.threshold=0.2"])


def old_shape(cfg: RunConfig, **flat: object) -> str:
    """`cfg`'s config.yaml as the previous release wrote it: every moved key flat under algo, at its old
    default unless given in `flat`, and no loss sections."""
    text = to_yaml(cfg)
    defaults = {
        "value_coef": 0.5,
        "value_clip": 0.2,
        "critic_lr": 0.0,
        "m2_threshold": 0.04,
        "sapo_tau_pos": 1.0,
        "sapo_tau_neg": 1.05,
        "kpop_threshold": 2.0,
        "teacher_path": "''",
        "distill_coef": 0.1,
        "distill_rl_coef": 1.0,
        "dpo_beta": 0.1,
        "dpo_label_smoothing": 0.0,
        "behav_clip_drop": "none",
    }
    lines = "".join(f"  {k}: {flat.get(k, v)}\n" for k, v in defaults.items())
    head, sep, rest = text.partition("algo:\n")
    assert sep and "  m2po:" not in rest.split("\n\n")[0]
    return f"{head}{sep}{lines}{rest}"


def test_a_stored_config_of_the_previous_release_loads_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    given = [*TINY, *SMALL, "store=r", "algo.loss=m2po", "algo.m2po.threshold=0.1"]
    uri, _ = pipeline.prepare("", given)
    store = Store(uri)
    text = old_shape(load_config(None, [*TINY, *SMALL, "store=r", "algo.loss=m2po"]), m2_threshold=0.1)
    assert "  m2_threshold: 0.1\n" in text and "  sapo_tau_pos: 1.0\n" in text
    store.write_text(LAYOUT.config, text)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = load_run_config(store)  # as every role, replay, fork and regrade read it
    moved = [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)]
    assert moved == [
        "config key 'algo.m2_threshold' is deprecated and goes in the next release: write algo.m2po.threshold "
        "(read as algo.m2po.threshold=0.1)"
    ]  # the keys at their old default are dropped without a word
    assert cfg.algo.sections() == ["m2po"] and M2poSettings.of(cfg.algo).threshold == 0.1
    assert from_yaml_text(to_yaml(cfg)) == cfg
    # resume, with the new shape or the old one: the same config as the stored run's
    renew_done(store)
    pipeline.prepare("", given, resume=True)
    renew_done(store)
    store.write_text(LAYOUT.config, text)
    pipeline.prepare("", [*TINY, *SMALL, "store=r", "algo.loss=m2po", "algo.m2_threshold=0.1"], resume=True)
    renew_done(store)
    with pytest.raises(ConfigError, match="differs from this config in algo.m2po.threshold"):
        pipeline.prepare("", [*TINY, *SMALL, "store=r", "algo.loss=m2po"], resume=True)
    assert math.isclose(M2poSettings.of(load_run_config(store).algo).threshold, 0.1)


def renew_done(store: Store) -> None:
    from areal_core.run.ownership import read_lease, renew

    renew(store, read_lease(store)[0].run_id, state="done")
