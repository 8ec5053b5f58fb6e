"""task.name=reasoning_gym (task_data/reasoning_gym.py): task.gym's forms and errors at prepare, training and held-out
questions from disjoint seeds, composite weights, the stored entry's fidelity, gym_reward equal to the dataset's own
score_answer on reasoning-gym's extract_answer, and one run to DONE through `pyflyte run` whose every stored reward is
gym_reward of the decoded completion."""

from __future__ import annotations

import json
import math
import shlex
from collections import Counter

import pytest
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from areal_core.config import ConfigError, load_config
from areal_core.config.task import REASONING_GYM_SYSTEM_PROMPT
from areal_core.layout import LAYOUT
from areal_core.prompts import load_prompts
from areal_core.protocol import decode_shard
from areal_core.reward.pool import RewardPool, reward_function
from areal_core.run import pipeline
from areal_core.store import Store
from benchmarks import tiny_checkpoints as tc
from task_data import load_task
from task_data.reasoning_gym import EVAL_SEED_OFFSET, check_specs, composite, decode, encode, gym_reward
from tests.conftest import TINY
from tests.test_flyte import pyflyte

GYM = ["task.name=reasoning_gym"]


def task(*overrides: str):
    return load_config(None, [*GYM, *overrides]).task


def prompts(records: list[dict]) -> set[str]:
    return {r["prompt"] for r in records}


# -- config ---------------------------------------------------------------------------------------
def test_the_system_prompt_is_reasoning_gyms_default_unless_the_user_sets_one():
    assert REASONING_GYM_SYSTEM_PROMPT == SYSTEM_PROMPTS["default"]
    assert task("task.gym=leg_counting").system_prompt == SYSTEM_PROMPTS["default"]
    assert task("task.gym=leg_counting", "task.system_prompt=Be brief.").system_prompt == "Be brief."
    assert load_config(None, []).task.system_prompt == ""  # other tasks keep theirs


def test_the_short_form_and_the_yaml_form_give_the_same_specs():
    short = task("task.gym=leg_counting,basic_arithmetic:2").gym
    assert [(s.name, s.weight, s.config) for s in short] == [("leg_counting", 1.0, {}), ("basic_arithmetic", 2.0, {})]
    full = task("task.gym=[{name: leg_counting, weight: 3, config: {max_animals: 4}}]").gym
    assert [(s.name, s.weight, s.config) for s in full] == [("leg_counting", 3.0, {"max_animals": 4})]
    assert [s.name for s in task("task.gym={name: gcd}").gym] == ["gcd"]


@pytest.mark.parametrize(
    "overrides, match",
    [
        ([], r"'task.gym' is required when task.name is reasoning_gym"),
        (["task.gym=leg_counting:0"], r"'task.gym.0.weight' must be > 0"),
        (["task.gym=leg_counting:-1"], r"'task.gym.0.weight' must be > 0"),
        (["task.gym=leg_counting:x"], r"'task.gym' has 'leg_counting:x'"),
        (["task.gym=leg_counting,leg_counting"], r"'task.gym' names a dataset twice"),
        (["task.gym=[{name: leg_counting, wieght: 2}]"], r"unknown config key 'task.gym.0.wieght'"),
    ],
)
def test_a_malformed_gym_is_one_config_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_config(None, [*GYM, *overrides])
    assert "\n" not in str(err.value)


def test_gym_is_for_reasoning_gym_only():
    with pytest.raises(ConfigError, match="'task.gym' is for task.name reasoning_gym, not arithmetic"):
        load_config(None, ["task.gym=leg_counting"])


@pytest.mark.parametrize(
    "gym, match",
    [
        ("leg_countin", r"'task.gym.0.name': 'leg_countin' is not a reasoning-gym dataset; did you mean leg_counting"),
        ("[{name: leg_counting, config: {max_legs: 3}}]", r"'task.gym.0.config.max_legs' is not a setting of "),
        ("[{name: gcd}, {name: leg_counting, config: {seed: 3}}]", r"'task.gym.1.config.seed': the run sets seed"),
        ("[{name: leg_counting, config: {size: 3}}]", r"'task.gym.0.config.size': the run sets size"),
        ("[{name: leg_counting, config: {min_animals: 9, max_animals: 2}}]", r"'task.gym.0.config': leg_counting refu"),
        ("boxnet", r"'task.gym': boxnet gives no answer to its questions"),
        ("[{name: gcd, config: {max_value: 3}}]", r"'task.gym': every held-out question .* is a training one"),
    ],
)
def test_a_bad_dataset_or_config_is_refused_at_prepare_before_any_work(gym, match, tmp_path):
    root = tmp_path / "run"
    with pytest.raises(ConfigError, match=match) as err:
        pipeline.prepare("", [*TINY, f"store={root}", *GYM, f"task.gym={gym}"])
    assert "\n" not in str(err.value) and "task.gym" in str(err.value)
    assert not root.exists()  # nothing written: no config.yaml, no prompts, no lease


# -- the records ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "gym",
    [
        "leg_counting",
        "basic_arithmetic",
        "spell_backward",
        "[{name: gcd, config: {max_value: 30}}]",  # 900 questions: chance repeats, skipped from the held-out split
        "leg_counting,basic_arithmetic,gcd",
    ],
)
def test_no_held_out_question_is_a_training_one(gym):
    t = task(f"task.gym={gym}", "task.num_train=400", "task.num_eval=60")
    train, held = load_task(t, seed=1)
    assert len(train) == 400 and 0 < len(held) <= 60
    assert not prompts(train) & prompts(held)
    assert len(prompts(held)) == len(held)  # nor a held-out question twice
    # the generators are disjoint: item idx of a dataset seeded s is drawn from Random(s + idx)
    drawn = {split: {(r["meta"]["reasoning_gym"]["dataset"], r["meta"]["reasoning_gym"]["seed"] + r["meta"][
        "reasoning_gym"]["index"]) for r in rows} for split, rows in (("train", train), ("held", held))}  # fmt: skip
    assert not drawn["train"] & drawn["held"]
    assert {r["meta"]["reasoning_gym"]["seed"] for r in held} >= {1 + EVAL_SEED_OFFSET + 1}


def test_a_small_question_space_still_holds_out_only_unseen_questions():
    t = task("task.gym=[{name: gcd, config: {max_value: 12}}]", "task.num_train=200", "task.num_eval=40")
    train, held = load_task(t, seed=3)
    assert held and not prompts(train) & prompts(held)
    assert len(prompts(train)) < 144  # repeats within training are kept: the space has 144 questions


def test_the_split_is_the_same_for_the_same_seed_and_another_for_another():
    t = task("task.gym=leg_counting,basic_arithmetic", "task.num_train=50", "task.num_eval=10")
    assert load_task(t, seed=5) == load_task(t, seed=5)
    assert prompts(load_task(t, seed=5)[0]) != prompts(load_task(t, seed=6)[0])


def test_composite_weights_are_respected():
    t = task("task.gym=leg_counting:3,basic_arithmetic:1", "task.num_train=2000", "task.num_eval=10")
    counts = Counter(r["meta"]["reasoning_gym"]["dataset"] for r in load_task(t, seed=1)[0])
    assert abs(counts["leg_counting"] / 2000 - 0.75) < 0.04  # binomial sd 0.0097
    assert counts["leg_counting"] + counts["basic_arithmetic"] == 2000


def test_a_record_is_the_question_its_demonstration_and_its_entry_as_strict_json():
    t = task("task.gym=leg_counting", "task.num_train=3", "task.num_eval=2")
    train, _ = load_task(t, seed=1)
    comp = composite(check_specs(t.gym), 1, 3)
    entry = comp[0]
    r = train[0]
    assert r["prompt"] == entry["question"] and r["answer"] == f"<answer>{entry['answer']}</answer>"
    meta = json.loads(json.dumps(r["meta"], allow_nan=False))
    assert meta["reasoning_gym"]["dataset"] == "leg_counting" and decode(meta["reasoning_gym"]["entry"]) == entry


def test_encode_keeps_the_types_json_has_none_for():
    import numpy as np

    value = {
        "grid": ((1, 2), (3, 4)),
        "colours": {0: 1, 7: 2},
        "pair_keys": {(1, 2): "a"},
        "seen": {3, 4},
        "frozen": frozenset({"x"}),
        "z": 1 + 2j,
        "inf": float("inf"),
        "np": [np.int64(3), np.float64(0.5), np.str_("s"), np.bool_(True)],
        "__rg__": "a key that looks like the tag",
    }
    back = decode(json.loads(json.dumps(encode(value), allow_nan=False)))
    assert back["grid"] == ((1, 2), (3, 4)) and isinstance(back["grid"][0], tuple)
    assert back["colours"] == {0: 1, 7: 2} and back["pair_keys"] == {(1, 2): "a"}
    assert back["seen"] == {3, 4} and back["frozen"] == frozenset({"x"}) and back["z"] == 1 + 2j
    assert math.isinf(back["inf"]) and back["np"] == [3, 0.5, "s", True] and back["__rg__"] == value["__rg__"]
    with pytest.raises(TypeError, match="holds a object"):
        encode(object())


# -- the reward -----------------------------------------------------------------------------------
# graph_color's metadata has int keys, arc_1d's tuples: the stored entry must score as the original does
DATASETS = ["leg_counting", "basic_arithmetic", "spell_backward", "graph_color", "arc_1d", "prime_factorization"]


def completions(answer: str) -> dict[str, str]:
    return {
        "correct": f"Let me think step by step.\n<answer>{answer}</answer>",
        "correct, last of two": f"<answer>not this</answer> on reflection <answer> {answer} </answer>",
        "wrong": "<answer>certainly wrong</answer>",
        "no answer": f"The answer is {answer}.",
    }


@pytest.mark.parametrize("name", DATASETS)
def test_the_reward_is_the_datasets_score_answer_on_the_extracted_answer(name):
    t = task(f"task.gym={name}", "task.num_train=6", "task.num_eval=2")
    train, _ = load_task(t, seed=2)
    comp = composite(check_specs(t.gym), 2, 6)
    dataset = comp.datasets[name]
    for i, r in enumerate(train):
        entry = comp[i]  # the entry as the dataset made it, never through JSON
        meta = json.loads(json.dumps(r["meta"]))  # as the reward worker reads it from prompts/
        demo = extract_answer(r["answer"])
        for kind, text in completions(demo).items():
            try:
                want = float(dataset.score_answer(extract_answer(text), entry))
            except Exception:  # prime_factorization raises on a non-number: gym_reward scores it 0
                want = 0.0
            got, info = gym_reward(completion=text, reference=r["answer"], prompt=r["prompt"], prompt_id="p", meta=meta)
            assert got == want, (name, i, kind)
            assert info["dataset"] == name and info["extracted"] == extract_answer(text)
            if kind.startswith("correct") and isinstance(entry["answer"], str):
                assert got == 1.0
            if kind == "no answer":
                assert got == 0.0 and info["extracted"] is None
            if kind == "wrong":
                assert got < 1.0


def test_a_scorer_that_raises_scores_zero_with_its_reason():
    t = task("task.gym=prime_factorization", "task.num_train=2", "task.num_eval=1")
    r = load_task(t, seed=1)[0][0]
    score, info = gym_reward("<answer>certainly wrong</answer>", meta=r["meta"])
    assert score == 0.0 and info["score_error"].startswith("ValueError")


def test_a_sample_without_the_entry_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="meta has no 'reasoning_gym'"):
        gym_reward("<answer>1</answer>", meta={})


def test_the_run_grades_with_gym_reward_through_the_pool():
    cfg = load_config(None, [*GYM, "task.gym=leg_counting,basic_arithmetic", "task.num_train=8", "task.num_eval=2"])
    assert reward_function(cfg) == "task_data.reasoning_gym:gym_reward"
    train, _ = load_task(cfg.task, cfg.seed)
    jobs = [{"completion": r["answer"], "reference": r["answer"], "prompt": r["prompt"], "prompt_id": r["prompt_id"],
             "meta": r["meta"]} for r in train]  # fmt: skip
    jobs.append({**jobs[0], "completion": "no idea"})
    with RewardPool(reward_function(cfg), size=1, timeout_s=60, retries=0) as pool:
        results = pool.grade(jobs)
    assert [res.reward for res in results] == [1.0] * len(train) + [0.0]


# -- end to end -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Llama with a 2048-token context: reasoning-gym's system prompt and question take ~550 of its
    character-level tokens (RoPE: a longer context is a config change)."""
    path = tc.save("llama", tmp_path_factory.mktemp("ckpt") / "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    return path


@pytest.mark.slow
def test_a_reasoning_gym_run_through_pyflyte_stores_gym_reward_of_each_completion(checkpoint, tmp_path):
    store_dir = tmp_path / "run"
    gym = "[{name: gcd, weight: 1, config: {max_value: 12}}, {name: leg_counting, weight: 1}]"
    overrides = [*TINY, f"store={store_dir}", f"model.path={checkpoint}", *GYM, f"task.gym={gym}",
                 "task.num_train=64", "task.num_eval=8", "rollout.max_new_tokens=16", "rollout.temperature=0.3",
                 # enough SFT for the tiny model to answer in <answer>...</answer>, so that extraction is exercised
                 "sft.steps=80", "sft.warmup_steps=5", "sft.lr=0.01", "sft.batch_size=16"]  # fmt: skip
    out = pyflyte("run", "workflows/grpo.py", "grpo", "--overrides", shlex.join(overrides), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out greedy accuracy: before RL" in out.stdout + out.stderr
    store = Store(str(store_dir))
    assert store.done() and "name: reasoning_gym" in store.read_text(LAYOUT.config)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(store_dir / LAYOUT.init_model))
    records = {r["prompt_id"]: r for r in load_prompts(store)}
    samples = [s for p in store.find(LAYOUT.graded_dir, ".arrow") for s in decode_shard(store.read_bytes(p))]
    assert len(samples) >= 16
    extracted = []
    for s in samples:
        record = records[s.prompt_id]
        assert "<answer>answer here</answer>" in tok.decode(s.input_ids[: s.prompt_len])  # reasoning-gym's prompt
        completion = tok.decode(s.response_ids(), skip_special_tokens=True)
        want, info = gym_reward(completion=completion, meta=record["meta"])
        assert s.reward == pytest.approx(want, abs=1e-9), (s.sample_id, completion)
        assert s.reward_info["extracted"] == info["extracted"] == extract_answer(completion)
        assert s.reward_info["dataset"] == record["meta"]["reasoning_gym"]["dataset"]
        extracted.append(info["extracted"])
    assert any(e is not None for e in extracted)  # the SFT'd model answers in tags: the rewards are not all "none"
