"""A clumsy user's config is one ConfigError before any work, and never touches what is not the
run's: a store folder that holds other files, a root owned by a live run, numbers that are not
finite or out of range, YAML 1.1's surprising numbers, repeated keys, combinations only the
trainer would refuse, a stored config.yaml that is empty or cut, and resume's spelling of a root."""

from __future__ import annotations

import pytest

from areal_core.config import ConfigError, RunConfig, load_config
from areal_core.context import load_run_config
from areal_core.layout import LAYOUT
from areal_core.run import pipeline
from areal_core.run.ownership import read_lease, renew
from areal_core.store import Store
from tests.conftest import TINY

SMALL = ["task.num_train=40", "task.num_eval=8"]


def finish(store: Store) -> None:
    """Mark the root's run finished, as its trainer does at the end (the root is free again)."""
    renew(store, read_lease(store)[0].run_id, state="done")


def one_line_error(overrides: list[str], match: str) -> str:
    with pytest.raises(ConfigError, match=match) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)
    return str(err.value)


def float_keys(model: type = RunConfig, prefix: str = "") -> list[str]:
    """Every float field of the config, dotted."""
    out = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, RunConfig.__mro__[1]):  # a section
            out += float_keys(ann, f"{prefix}{name}.")
        elif ann is float:
            out.append(f"{prefix}{name}")
    return out


# -- the store --------------------------------------------------------------------------------
def test_a_store_folder_with_other_files_and_no_run_is_refused_and_left_alone(tmp_path):
    mine = tmp_path / "mine"
    (mine / "weights").mkdir(parents=True)
    (mine / "weights" / "model.bin").write_text("x")
    (mine / "DONE").write_text("k")
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds DONE, weights but no run .*would delete them"):
        pipeline.prepare("", [*TINY, *SMALL, f"store={mine}"])
    assert sorted(p.name for p in mine.iterdir()) == ["DONE", "notes.txt", "weights"]  # nothing cleared, no lease
    empty = tmp_path / "empty"
    (empty / "labels").mkdir(parents=True)  # what a run keeps (labels put there before the run) may be there
    (empty / "labels" / "a.jsonl").write_text('{"prompt_id": "p", "reward": 1}\n')
    (empty / ".gitkeep").write_text("")
    (empty / "notes.txt").write_text("never cleared")
    run_uri, _ = pipeline.prepare("", [*TINY, *SMALL, f"store={empty}"])
    assert Store(run_uri).exists(LAYOUT.config) and Store(run_uri).exists("labels/a.jsonl")
    finish(Store(run_uri))
    pipeline.prepare("", [*TINY, *SMALL, f"store={empty}", "train.steps=3"])  # a finished run's root: reused


@pytest.mark.s3
def test_an_s3_prefix_with_other_objects_and_no_run_is_refused(s3_bucket):
    other = Store(f"{s3_bucket}/shared")
    other.write_text("someone/else.txt", "theirs")
    other.write_text("weights/v000001/model.safetensors", "theirs")
    with pytest.raises(ConfigError, match="holds weights but no run"):
        pipeline.prepare("", [*TINY, *SMALL, f"store={s3_bucket}/shared"])
    assert other.read_text("someone/else.txt") == "theirs" and not other.exists(LAYOUT.lease)


@pytest.mark.parametrize(
    "value, match",
    [
        ("", "must not be empty"),
        ("  ", "must not be empty"),
        ("~/runs/x", "not expanded"),
        ("memory://run1", "scheme 'memory'"),
        ("foo://bar", "scheme 'foo'"),
        ("s3:/bucket/x", "missing a slash"),
    ],
)
def test_a_store_that_no_role_could_share_is_refused(value, match):
    one_line_error([f"store={value}"], match)


@pytest.mark.parametrize("value", ["runs/x", "/tmp/x", "file:///tmp/x", "s3://bucket/x", "gs://b/x", "C:/x"])
def test_store_paths_and_shared_uris_are_accepted(value):
    assert load_config(None, [f"store={value}"]).store == value


def test_resume_takes_every_spelling_of_its_root_and_names_what_differs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pipeline.prepare("", [*TINY, *SMALL, "store=r"])
    for spelling in ("r/", "./r", f"file://{tmp_path}/r", str(tmp_path / "r")):
        finish(Store("r"))
        pipeline.prepare("", [*TINY, *SMALL, f"store={spelling}"], resume=True)
    finish(Store("r"))
    with pytest.raises(ConfigError, match="differs from this config in train.lr, train.steps"):
        pipeline.prepare("", [*TINY, *SMALL, "store=r", "train.steps=9", "train.lr=0.5"], resume=True)


# -- numbers ----------------------------------------------------------------------------------
def test_every_float_key_refuses_nan_and_infinity():
    keys = float_keys()
    # the losses' own settings (algo.<loss>.*) are checked at prepare: tests/test_loss_settings.py
    assert len(keys) > 40 and "train.lr" in keys and "algo.reward_scale" in keys
    for key in keys:
        for value in (".nan", ".inf", "-.inf"):
            one_line_error([f"{key}={value}"], f"'{key}' must be a finite number")


@pytest.mark.parametrize(
    "override, match",
    [
        ("sft.lr=-1", "'sft.lr' must be > 0"),
        ("sft.lr=0", "'sft.lr' must be > 0"),
        ("train.weight_decay=-1", "'train.weight_decay' must be >= 0"),
        ("train.grad_clip=-1", "'train.grad_clip' must be >= 0"),
        ("reward.poll_interval_s=-1", "'reward.poll_interval_s' must be in \\(0, 3600\\]"),
        ("train.poll_interval_s=0", "'train.poll_interval_s' must be in"),
        ("rollout.poll_interval_s=1e12", "'rollout.poll_interval_s' must be in"),
        ("train.slow_step_s=-1", "'train.slow_step_s' must be in"),
        ("lease.timeout_s=1e10", "'lease.timeout_s' must be in"),
        ("launcher.timeout_s=0", "'launcher.timeout_s' must be in"),
        ("rollout.temperature=1e-300", "must be 0 \\(greedy\\) or at least 0.01"),
        ("rollout.temperature=-1", "'rollout.temperature' must be in"),
        ("rollout.top_k=-5", "'rollout.top_k' must be >= -1"),
        ("model.vocab_size=-3", "'model.vocab_size' must be > 0"),
        ("model.intermediate_size=-4", "'model.intermediate_size' must be > 0"),
        ("model.max_position_embeddings=0", "must be > 0"),
        ("eval.max_new_tokens=0", "'eval.max_new_tokens' must be > 0"),
        ("sft.warmup_steps=-10", "'sft.warmup_steps' must be >= 0"),
        ("train.eval_every=-1", "'train.eval_every' must be >= 0"),
        ("task.num_train=1000000000", "'task.num_train' must be in"),
        ("seed=18446744073709551616", "'seed' must be in"),
        ("algo.overlong_penalty=-1", "'algo.overlong_penalty' must be >= 0"),
        ("rollout.server.startup_timeout_s=-5", "must be > 0"),
    ],
)
def test_numbers_that_would_fail_deep_inside_a_role_are_config_errors(override, match):
    one_line_error([override], match)


def test_greedy_and_ordinary_temperatures_are_kept():
    assert [load_config(None, [f"rollout.temperature={t}"]).rollout.temperature for t in (0, 0.01, 0.7, 1.5)] == [
        0.0,
        0.01,
        0.7,
        1.5,
    ]


# -- YAML ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, expected",
    [("name=0123", "0123"), ("name=0x1F", "0x1F"), ("name=12:30", "12:30"), ("name=1_000", "1_000"), ("name=7", "7")],
)
def test_text_that_yaml_1_1_would_read_as_a_number_is_kept_as_written(override, expected):
    assert load_config(None, [override]).name == expected


@pytest.mark.parametrize(
    "override, match",
    [
        ("tracking.experiment=2024.10", "must be text, got the number 2024.1: quote it"),
        ("train.steps=017", "must be an integer, got '017'"),
        ("seed=1:00", "must be an integer, got '1:00'"),
        ("train.steps=0x10", "must be an integer"),
    ],
)
def test_numbers_yaml_1_1_would_change_silently_are_refused(override, match):
    one_line_error([override], match)


def test_yaml_exponents_are_numbers_and_quoted_text_is_text():
    cfg = load_config(None, ["train.lr=3e-4", "tracking.experiment='2024.10'", "algo.eps_low=.1"])
    assert (cfg.train.lr, cfg.tracking.experiment, cfg.algo.eps_low) == (3e-4, "2024.10", 0.1)


def test_a_repeated_key_in_a_config_file_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1e-3\n  lr: 5\n")
    with pytest.raises(ConfigError, match="repeats the key 'lr'.*line 3"):
        load_config(str(path))
    path.write_text("train:\n  lr: 1e-3\nrollout:\n  temperature: 0.5\ntrain:\n  steps: 3\n")
    with pytest.raises(ConfigError, match="repeats the key 'train'"):
        load_config(str(path))


# -- combinations and the written config --------------------------------------------------------
@pytest.mark.parametrize(
    "extra, match",
    [
        (["algo.loss=m2po"], "m2po cannot run on more than one rank"),
        (["algo.loss=dpo"], "cannot run on more than one rank"),
        (["algo.adv_estimator=gae"], "cannot run on more than one rank"),
        (["train.lora_rank=8"], "'train.lora_rank' must be 0 with train.nproc_per_node > 1"),
    ],
)
def test_a_combination_the_trainer_would_refuse_is_refused_before_the_root_is_claimed(tmp_path, extra, match):
    root = tmp_path / "run"
    with pytest.raises(ConfigError, match=match):
        pipeline.prepare("", [*TINY, *SMALL, f"store={root}", "train.nproc_per_node=2", *extra])
    assert not root.exists() or not any(root.iterdir())


def test_a_config_whose_written_form_the_roles_could_not_read_is_refused_at_prepare(tmp_path):
    root = tmp_path / "run"
    env = {f"K{i}": "v" for i in range(6000)}  # fine as typed; over the node limit as written YAML
    typed = RunConfig.model_validate({"agent": {"mcp_servers": [{"command": "python", "env": env}]}})
    with pytest.raises(ConfigError, match="as the run would store it in config.yaml: .*more than 10000 values"):
        pipeline.prepare("", [*TINY, *SMALL, f"store={root}"], typed=typed)
    assert not root.exists() or not any(root.iterdir())


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda text: "", "lacks the section"),
        (lambda text: "name: x\nstore: y\n", "lacks the section\\(s\\) seed, task"),
        (lambda text: "# edited\n", "lacks the section"),
        (lambda text: text.splitlines()[0] + "\n", "lacks the section"),
        (lambda text: text[: len(text) // 2].rsplit("\n", 1)[0] + "\n", "lacks the section|not valid YAML"),
        (lambda text: text.replace("rollout:", "rollout:\n  group_size: 16", 1), "repeats the key"),
    ],
)
def test_a_stored_config_that_is_empty_cut_or_damaged_is_refused_not_read_as_defaults(tmp_path, damage, match):
    run_uri, _ = pipeline.prepare("", [*TINY, *SMALL, f"store={tmp_path / 'run'}", "train.steps=7"])
    store = Store(run_uri)
    assert load_run_config(store).train.steps == 7
    store.write_text(LAYOUT.config, damage(store.read_text(LAYOUT.config)))
    with pytest.raises(ConfigError, match=match) as err:
        load_run_config(store)
    assert "config.yaml" in str(err.value)


def test_a_stored_config_from_before_a_section_existed_takes_that_section_s_defaults(tmp_path):
    import yaml

    run_uri, _ = pipeline.prepare("", [*TINY, *SMALL, f"store={tmp_path / 'run'}", "train.steps=7"])
    store = Store(run_uri)
    data = yaml.safe_load(store.read_text(LAYOUT.config))
    for later in ("online", "lease", "agent"):
        data.pop(later)
    store.write_text(LAYOUT.config, yaml.safe_dump(data, sort_keys=False))
    cfg = load_run_config(store)
    assert cfg.train.steps == 7 and cfg.online == RunConfig().online and cfg.lease == RunConfig().lease


@pytest.mark.parametrize("text", ["1e3", "1e-4", "0123", "2024.10", "12:30", "0x1F", "true", "null", "1_000", "7"])
def test_text_that_looks_like_a_number_survives_the_stored_config(text):
    from areal_core.config import from_yaml_text, to_yaml

    cfg = RunConfig.model_validate({"name": text, "agent": {"mcp_servers": [{"command": "x", "args": ["--n", text]}]}})
    back = from_yaml_text(to_yaml(cfg))
    assert back.name == text and back.agent.mcp_servers[0].args == ["--n", text]


def test_every_shipped_config_loads_and_survives_the_stored_config():
    """The reader's YAML rules (no YAML 1.1 octal or base 60, no repeated keys, floats finite and
    bounded) hold for every config the project ships; configs/cluster.yaml is a cluster config."""
    from pathlib import Path

    from areal_core.config import from_yaml_text, to_yaml

    root = Path(__file__).resolve().parents[1] / "configs"
    files = sorted(p for p in root.rglob("*.yaml") if p.name != "cluster.yaml")
    assert len(files) > 10
    for path in files:
        layered = "" if path.name == "default.yaml" else f"{root / 'default.yaml'},"
        cfg = load_config(f"{layered}{path}")
        assert from_yaml_text(to_yaml(cfg)) == cfg, path
