"""The staleness study's scripts (issue 47): every rule and setting is a valid config that runs the loss
it names, the cells planned are the ones documented, and the tables read the recorded cells."""

from __future__ import annotations

import json

import pytest

from areal_core.config import load_config
from areal_core.train.loss import check_algorithm
from areal_core.train.loss.decoupled_ppo import DecoupledPpoSettings
from benchmarks import staleness_ablation as ablation
from benchmarks import staleness_mechanism as mechanism


@pytest.mark.parametrize("setting", sorted(ablation.SETTINGS))
@pytest.mark.parametrize("rule", sorted(ablation.RULES))
def test_every_rule_in_every_setting_is_a_valid_config_with_the_documented_correction(setting, rule):
    args = ablation.parse_args(["--setting", setting, "--rules", rule])
    cfg = load_config("configs/default.yaml", [*ablation.overrides_of(args), *ablation.RULES[rule][1]])
    algo = cfg.algo
    assert [loss.name for loss in check_algorithm(algo)] == [algo.loss]
    want = {
        "naive": ("ppo", None, None, "none"),
        "ppo": ("ppo", None, None, "none"),
        "mask5": ("decoupled_ppo", "mask", 5.0, "none"),
        "uncapped": ("decoupled_ppo", "truncate", 0.0, "none"),
        "trunc5": ("decoupled_ppo", "truncate", 5.0, "none"),
        "decoupled_ppo": ("decoupled_ppo", "truncate", 5.0, "none"),
        "drop_pos": ("decoupled_ppo", "truncate", 0.0, "positive"),
        "drop_both": ("decoupled_ppo", "truncate", 0.0, "both"),
    }[rule]
    assert algo.loss == want[0] and DecoupledPpoSettings.of(algo).behav_clip_drop == want[3]
    if want[1] is not None:
        assert (algo.behav_correction, algo.behav_high) == want[1:3]
    if setting == "faithful":
        assert (cfg.train.batch_groups, cfg.train.ppo_minibatches, algo.eps_low, algo.eps_high) == (32, 4, 0.2, 0.2)
        assert (algo.aggregation, algo.adv_estimator, cfg.train.lr) == ("token_mean", "batch_norm", 1e-4)
    else:
        assert (cfg.train.batch_groups, cfg.train.ppo_minibatches, algo.adv_estimator) == (8, 1, "grpo")


def test_eta_zero_runs_once_per_seed_and_infinity_never_binds():
    args = ablation.parse_args(["--etas", "0", "2", "inf", "--seeds", "1", "2"])
    cells = ablation.plan(args)
    assert [c for c in cells if c[1] == 0] == [("mask5", 0, 1), ("mask5", 0, 2)]
    assert len(cells) == 2 * (1 + 2 * len(ablation.FAITHFUL_RULES))
    assert ablation.eta_value("inf") == ablation.INF and ablation.eta_label(ablation.INF) == "∞"


def fake(rule: str, eta: int, seed: int, final: float, **extra) -> dict:
    base = {
        "loss": rule, "eta": eta, "seed": seed, "final": final, "curve": {"50": final - 0.1, "100": final},
        "clock": {"50": 10.0, "100": 20.0}, "kl_behav_prox": 0.01 * eta, "w_min_median": 0.5, "w_max_median": 2.0,
        "w_min": 0.1, "w_max": 5.0, "clip_frac": 0.01, "masked_frac": 0.0, "truncated_frac": 0.0,
        "staleness_max": eta, "staleness_mean": eta * 0.9, "non_finite": [],
        "clip_frac_adv_pos": 0.02, "clip_frac_adv_neg": 0.05, "dropped_frac": 0.003,
        "entropy_first": 0.3, "entropy_last": 0.2,
    }  # fmt: skip
    return {**base, **extra}


def test_the_ablation_tables_hold_every_cell_and_reach_the_threshold_in_steps():
    args = ablation.parse_args(["--etas", "0", "8", "--seeds", "1", "2", "--threshold", "0.5"])
    results = [fake("mask5", 0, s, 0.6) for s in (1, 2)]
    results += [fake(rule, 8, s, 0.5 + 0.01 * s) for rule in ablation.FAITHFUL_RULES for s in (1, 2)]
    text = ablation.markdown(results, args)
    assert "| 0 | 0.600 ± 0.000 | 0.600 ± 0.000 | 0.600 ± 0.000 | 0.600 ± 0.000 |" in text  # η = 0 stands for all
    assert "| 8 | 0.515 ± 0.007 |" in text
    assert "100 (2/2 reached)" in text and "0.30%" in text and "(0.0200 / 0.0500)" in text
    assert "0.300 → 0.200" in text


def test_the_mechanism_summary_reads_every_control(tmp_path):
    for name, _, etas, rules, _, _ in mechanism.CONTROLS:
        rows = [fake(rule, ablation.eta_value(e), s, 0.5) for rule in rules for e in etas for s in (1, 2, 3)]
        (tmp_path / name).mkdir(exist_ok=True)
        with (tmp_path / name / "results.jsonl").open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    text = mechanism.summary(tmp_path, [1, 2])
    body = [line for line in text.splitlines()[2:] if line]
    # control 1: η = 0 once and 3 η × 2 rules, at two rates; controls 2-3: 4 rules at 2e-4, and 6 at
    # 3e-4 at two η; control 4: 2 × 2 at each of two rates
    assert len(body) == 2 * 7 + 4 + 4 + 2 * 6 + 4
    assert all("| 2 | 0.500 ± 0.000 |" in line for line in body)
    assert sum("lite_ppo" in line for line in body) == 4 and sum("dr_grpo" in line for line in body) == 4


def test_every_mechanism_command_parses_into_its_controls_cells():
    """Each control's command line, as staleness_ablation parses it: its rules, η values, rate and overrides
    (an override placed after `--rules` was once taken for a rule and the control never ran)."""
    args = mechanism.parse_args(["--seeds", "1", "2"])
    cmds = mechanism.commands(args, "file:///sft")
    assert len(cmds) == len(mechanism.CONTROLS)
    for cmd, (name, lr, etas, rules, extra, _) in zip(cmds, mechanism.CONTROLS):
        parsed = ablation.parse_args(cmd[2:])
        assert (parsed.setting, parsed.rules, parsed.etas, parsed.seeds) == ("job", rules, etas, [1, 2])
        assert (parsed.lr, parsed.overrides, parsed.init) == (float(lr), extra, "file:///sft")
        assert parsed.root == f"runs/mechanism/{name}"
    only = mechanism.commands(mechanism.parse_args(["--only", "lr3e-4-dr_grpo"]), "x")
    assert len(only) == 1 and only[0][-1] == "algo.adv_estimator=dr_grpo"
