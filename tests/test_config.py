import pytest

from areal_core.config import ConfigError, RunConfig, from_yaml_text, load_config, to_flat_dict, to_yaml
from areal_core.config.cluster import cluster_config_from_dict
from areal_core.config.hooks import import_object


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
        # unknown nested key, wrong type, bound violation, Literal violation
        ("rollout.server.urll=x", "unknown config key 'rollout.server.urll'"),
        ("rollout.server.kv_cache_mb=big", "config key 'rollout.server.kv_cache_mb' must be an integer, got 'big'"),
        ("train.lr=-1", "config key 'train.lr' must be > 0, got -1"),
        ("rollout.top_p=1.5", "config key 'rollout.top_p' must be in (0, 1], got 1.5"),
        ("rollout.server.interrupt=drop", "config key 'rollout.server.interrupt' must be one of 'keep' or 'abort'"),
        ("device=tpu", "config key 'device' must be one of 'cpu', 'cuda' or 'npu', got 'tpu'"),
        ("agent.tool_prompt=some", "config key 'agent.tool_prompt' must be one of"),
        ("train.lr=fast", "config key 'train.lr' must be a number, got 'fast'"),
        ("train.packing=1", "config key 'train.packing' must be true or false, got 1"),
        ("name=true", "config key 'name' must be a string, got True"),
        ("algo.eps_low=1", "config key 'algo.eps_low' must be in [0, 1), got 1"),
        ("algo.overlong_buffer=4", "config key 'algo.overlong_buffer' must be <= overlong_max_len"),
        ("train.ppo_minibatches=3", "config key 'train.ppo_minibatches' must divide batch_groups"),
        ("model.num_heads=3", "config key 'model.num_heads' must divide hidden_size"),
        ("rollout.engine=sglang", "config key 'rollout.server.url' is required when rollout.engine is sglang"),
    ],
)
def test_bad_values_fail_with_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bool_is_not_an_int_and_a_yaml_float_string_is_a_float(tmp_path):
    """YAML 1.1 reads 3e-4 (no dot) as the string '3e-4'; true is never 1."""
    for override in ("train.steps=true", "train.eta=false", "seed=true"):
        with pytest.raises(ConfigError, match="must be an integer, got (True|False)"):
            load_config(None, [override])
    with pytest.raises(ConfigError, match="'train.lr' must be a number, got True"):
        load_config(None, ["train.lr=true"])
    (tmp_path / "c.yaml").write_text("train:\n  lr: 3e-4\nalgo:\n  eps_low: 1e-1\n")
    cfg = load_config(str(tmp_path / "c.yaml"))
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == pytest.approx(3e-4)
    assert cfg.algo.eps_low == pytest.approx(0.1)
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0  # an int is a number
    assert load_config(None, ["name=123"]).name == "123"  # a number given for a text key is that text


def test_round_trip_and_defaults_in_one_place():
    cfg = load_config(None, ["train.lr=3e-4", "algo.eps_high=0.3", "rollout.server.url=http://x:1", "name=7"])
    again = from_yaml_text(to_yaml(cfg))
    assert again == cfg and to_flat_dict(again) == to_flat_dict(cfg)
    assert RunConfig() == load_config(None, [])  # no file, no override: the model's defaults
    assert to_flat_dict(RunConfig())["train.lr"] == 1e-3 and to_flat_dict(RunConfig())["algo.loss"] == "decoupled_ppo"


def test_assignment_is_validated():
    cfg = RunConfig()
    cfg.train.lr = "3e-4"
    assert cfg.train.lr == pytest.approx(3e-4)
    with pytest.raises(ValueError):
        cfg.train.lr = -1.0
    with pytest.raises(ValueError):
        cfg.rollout.engine = "tensorrt"


def test_cluster_errors_name_the_key():
    for data, message in [
        ({"trainer": {"nnodez": 2}}, "unknown cluster config key 'trainer.nnodez'"),
        ({"trainer": {"nnodes": True}}, "cluster config key 'trainer.nnodes' must be an integer, got True"),
        ({"rollout": {"replicas": 0}}, "cluster config key 'rollout.replicas' must be >= 1, got 0"),
        ({"trainer": {"backend": "deepspeed"}}, "cluster config key 'trainer.backend' must be one of"),
        ({"trainer": 3}, "cluster config section 'trainer' must be a mapping"),
    ]:
        with pytest.raises(ConfigError) as err:
            cluster_config_from_dict(data)
        assert message in str(err.value) and "\n" not in str(err.value)


def test_import_object_is_the_one_hook_loader():
    assert import_object("areal_core.config:load_config", key="k") is load_config
    for path, message in [
        ("no_colon", "config key 'k' must look like 'pkg.module:function', got 'no_colon'"),
        ("no_such_pkg.mod:fn", "config key 'k': cannot import 'no_such_pkg.mod:fn' (ModuleNotFoundError"),
        ("areal_core.config:nope", "has no attribute 'nope'"),
        ("areal_core.config.device:DEVICES", "config key 'k': 'areal_core.config.device:DEVICES' is not callable"),
    ]:
        with pytest.raises(ConfigError) as err:
            import_object(path, key="k")
        assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="is not an async function"):
        import_object("areal_core.config:load_config", key="k", coroutine=True)


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
    from task_data import load_task

    cfg = load_config("configs/default.yaml,configs/code.yaml")
    assert cfg.task.name == "code" and cfg.reward.function.endswith(":code_reward")
    train, held_out = load_task(cfg.task, cfg.seed)
    assert len(train) == 200 and len(held_out) == 4
    assert not {r["prompt"] for r in held_out} & {r["prompt"] for r in train}
