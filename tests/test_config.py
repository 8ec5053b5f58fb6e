import pytest

from areal_core.config import ConfigError, from_yaml_text, load_config, to_yaml


def test_defaults_validate_and_round_trip():
    cfg = load_config("configs/default.yaml")
    assert from_yaml_text(to_yaml(cfg)) == cfg


def test_overrides_apply_with_types():
    cfg = load_config(None, ["train.lr=3e-4", "rollout.num_workers=2", "train.eta=0", "name=x"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.rollout.num_workers == 2 and cfg.train.eta == 0 and cfg.name == "x"


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lrr=1", "unknown config key 'train.lrr'"),
        ("nope.x=1", "unknown config key 'nope'"),
        ("train.steps=abc", "config key 'train.steps' must be an integer"),
        ("train.steps=0", "config key 'train.steps' must be > 0"),
        ("train.eta=-1", "config key 'train.eta' must be >= 0"),
        ("rollout.engine=foo", "config key 'rollout.engine' must be one of"),
        ("rollout.group_size=1", "rollout.group_size"),
        ("rollout.admission=maybe", "config key 'rollout.admission' must be true or false"),
        ("algo.dual_clip=0.5", "algo.dual_clip"),
        ("algo.adv_estimator=nope", "algo.adv_estimator"),
        ("task.name=gsm8k", "task.path"),
        ("train", "must look like key=value"),
    ],
)
def test_bad_values_fail_with_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  steps: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    p.write_text("train: 5\n")
    with pytest.raises(ConfigError, match="section 'train' must be a mapping"):
        load_config(p)


def test_algorithm_files_layer_on_the_default():
    cfg = load_config("configs/default.yaml,configs/algorithms/dapo.yaml", ["train.eta=0"])
    assert cfg.algo.dynamic_sampling and cfg.algo.eps_high > cfg.algo.eps_low
    assert cfg.train.eta == 0 and cfg.task.name == "arithmetic"


def test_code_config_layers_and_its_tasks_load():
    from datasets import load_task

    cfg = load_config("configs/default.yaml,configs/code.yaml")
    assert cfg.task.name == "code" and cfg.reward.function.endswith(":code_reward")
    train, held_out = load_task(cfg.task, cfg.seed)
    assert len(train) == 200 and len(held_out) == 4
    assert not {r["prompt"] for r in held_out} & {r["prompt"] for r in train}
