"""Data and reward functions as verl and TRL users have them, used unchanged (issue 53,
docs/coming_from.md): verl's RL parquet (`examples/data_preprocess/gsm8k.py`'s layout, a dotted
reference path, its `compute_score`); TRL's conversational datasets and batched `reward_funcs`
with `reward_weights` and None for "skip"; an OpenAI `messages` JSONL with a system prompt. Each
reaches DONE through `pyflyte run` on a tiny checkpoint, and the stored reward of every sample
equals what the user's function returns for that completion."""

from __future__ import annotations

import json
import math
import shlex

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from areal_core.config import ConfigError, load_config
from areal_core.layout import LAYOUT
from areal_core.models import record_prompt
from areal_core.protocol import Sample, decode_shard
from areal_core.reward.pool import Grader, RewardPool
from areal_core.reward.signatures import per_function_means, reward_job, signature_kind, trl_value
from areal_core.run import pipeline
from areal_core.store import Store
from areal_core.train.batch import GroupBuffer
from areal_core.train.counters import TrainerCounters
from areal_core.train.drops import DropLog
from areal_core.train.sources import record_ids, screen
from benchmarks import tiny_checkpoints as tc
from examples.coming_from import trl_rewards, verl_gsm8k
from task_data import load_task
from tests.conftest import TINY
from tests.test_flyte import pyflyte

VERL = "examples.coming_from.verl_gsm8k"
TRL = "examples.coming_from.trl_rewards"
SYSTEM = "You are a careful calculator. Answer with the number only."


def task(*overrides: str):
    return load_config(None, list(overrides)).task


@pytest.fixture(scope="module")
def verl_dir(tmp_path_factory):
    return verl_gsm8k.write(tmp_path_factory.mktemp("verl"), *verl_gsm8k.sums())


def trl_rows(n: int) -> list[dict]:
    """TRL's conversational prompt-only layout (`prompt` a list of messages) plus `solution` and a
    `kind` column: every fourth row is one the kind_reward skips."""
    return [
        {
            "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {i} + {i}?"}],
            "solution": str(2 * i),
            "kind": "skip" if i % 4 == 0 else "sum",
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def trl_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl")
    pq.write_table(pa.Table.from_pylist(trl_rows(60)), out / "train.parquet")
    pq.write_table(pa.Table.from_pylist(trl_rows(20)), out / "test.parquet")
    return out


@pytest.fixture(scope="module")
def messages_dir(tmp_path_factory):
    """An OpenAI fine-tuning style `messages` JSONL with a system prompt (the answer as a column)."""
    out = tmp_path_factory.mktemp("messages")
    for split, n in (("train", 60), ("test", 20)):
        rows = [
            {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{i} + 1 = ?"}],
             "answer": str(i + 1), "source": "synthetic"}
            for i in range(n)
        ]  # fmt: skip
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


# --- the data ---


def test_verl_parquet_needs_no_loader(verl_dir):
    train, held = load_task(
        task("task.name=dataset", f"task.path={verl_dir}", "task.reference_field=reward_model.ground_truth"), 1
    )
    assert len(train) == 60 and len(held) == 21
    r = train[5]
    assert r["prompt"] == f"What is 0 + 5? {verl_gsm8k.INSTRUCTION}" and r["answer"] == "5"
    assert r["meta"]["chat"] == [{"role": "user", "content": r["prompt"]}]
    cols = r["meta"]["columns"]
    assert cols["data_source"] == "openai/gsm8k" and cols["ability"] == "math"
    assert cols["reward_model"] == {"style": "rule", "ground_truth": "5"}  # every column but the prompt travels
    info = {"split": "train", "index": 5, "answer": "0 + 5 = 5\n#### 5", "question": "What is 0 + 5?"}
    assert cols["extra_info"] == info and "prompt" not in cols


def test_a_dotted_path_that_does_not_exist_is_named_at_prepare(verl_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"no field 'reward_model.truth' \('reward_model' has no 'truth'\).*"
                       r"its fields are \['ground_truth', 'style'\]"):  # fmt: skip
        pipeline.prepare(
            "",
            [*TINY, f"store={tmp_path / 'run'}", "task.name=dataset", f"task.path={verl_dir}",
             "task.reference_field=reward_model.truth"],
        )  # fmt: skip
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_a_column_named_with_a_dot_wins_over_the_path(tmp_path):
    rows = [{"prompt": f"q{i}", "a.b": f"flat{i}", "a": {"b": f"nested{i}"}} for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    train, _ = load_task(task("task.name=dataset", f"task.path={tmp_path}", "task.reference_field=a.b"), 1)
    assert train[0]["answer"] == "flat0" and train[0]["meta"]["columns"]["a"] == {"b": "nested0"}
    assert train[0]["meta"]["columns"]["a.b"] == "flat0"


def test_a_chat_prompt_is_rendered_whole_system_message_included(messages_dir, smollm2_path):
    train, _ = load_task(task("task.name=dataset", f"task.path={messages_dir}", "task.prompt_field=messages"), 1)
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    text = tok.decode(record_prompt(tok, train[3]))
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n3 + 1 = ?<|im_end|>")
    # task.system_prompt does not stack a second system message over the chat's own
    assert tok.decode(record_prompt(tok, train[3], "OTHER")) == text
    plain = tok.decode(record_prompt(tok, train[3], "", "plain"), skip_special_tokens=True)
    assert plain == f"{SYSTEM}\n\n3 + 1 = ?\n"
    assert train[3]["meta"]["columns"] == {"answer": "4", "source": "synthetic"}


@pytest.mark.parametrize(
    "chat, message",
    [
        ([{"role": "system", "content": "x"}], "a chat with a user message"),
        ([{"role": "user", "content": 3}], r"message 0 has content of type int, not a string or text parts"),
        ([{"content": "x"}], r"message 0 is a dict with keys \['content'\]"),
        ([{"role": "wizard", "content": "x"}], "message 0 has role 'wizard'"),
        (["hello"], "message 0 is a str"),
    ],
)
def test_a_malformed_chat_is_named(chat, message, tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": chat, "answer": "1"}) + "\n" for _ in range(4)))
    with pytest.raises(ValueError, match=r"row 1: field 'prompt'.*" + message):
        load_task(task("task.name=dataset", f"task.path={tmp_path}"), 1)


def test_huge_other_columns_are_refused_not_cut(tmp_path):
    rows = [{"prompt": "q", "answer": "1", "blob": "x" * 70_000}] * 4
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"other columns take \d+ bytes of JSON, over 65536"):
        load_task(task("task.name=dataset", f"task.path={tmp_path}"), 1)


# --- the signatures ---


def test_signatures_are_recognised():
    assert signature_kind(verl_gsm8k.compute_score, "x", ()) == "verl"
    assert signature_kind(trl_rewards.accuracy_reward, "x", ("solution",)) == "trl"
    assert signature_kind(lambda completion, reference: 1.0, "x", ()) == "areal"
    assert signature_kind(lambda completion, solution: 1.0, "x", ("solution",)) == "areal"  # a column by name


def test_verl_compute_score_gets_its_arguments(verl_dir):
    train, _ = load_task(
        task("task.name=dataset", f"task.path={verl_dir}", "task.reference_field=reward_model.ground_truth"), 1
    )
    job = reward_job("so 4 + 4 = 8\n#### 8", train[8])  # "What is 0 + 8?"
    assert Grader(f"{VERL}:compute_score")(job).reward == 1.0
    assert Grader(f"{VERL}:compute_score")(reward_job("#### 7", train[8])).reward == 0.0
    dict_form = Grader(f"{VERL}:compute_score_with_info")(job)
    assert dict_form.reward == pytest.approx(1.0 + len(job["completion"]) / 100)
    assert dict_form.info == {"acc": 1.0, "index": 8}  # extra_info reached it; "score" is the reward


def test_trl_functions_with_weights_each_logged_and_none_skips(trl_dir):
    train, _ = load_task(task("task.name=dataset", f"task.path={trl_dir}", "task.reference_field=solution"), 1)
    spec = f"{TRL}:accuracy_reward@1,{TRL}:format_reward@0.5,{TRL}:kind_reward@2"
    good = reward_job("<think>3+3</think> 6", train[3])
    result = Grader(spec)(good)
    assert result.info["rewards"] == {"accuracy_reward": 1.0, "format_reward": 1.0, "kind_reward": 0.2}
    assert result.reward == pytest.approx(1.0 + 0.5 + 2 * 0.2)
    only_kind = Grader(f"{TRL}:kind_reward")
    assert only_kind(reward_job("abcd", train[3])).reward == pytest.approx(0.04)
    skipped = only_kind(reward_job("abcd", train[4]))  # kind == "skip": TRL's None
    assert skipped.reward == 0.0 and skipped.info == {"skipped": True}
    mixed = Grader(f"{TRL}:kind_reward@1,{TRL}:length_reward@1")(reward_job("abcd", train[4]))
    assert mixed.reward == pytest.approx(0.04) and mixed.info["rewards"] == {"kind_reward": None, "length_reward": 0.04}
    assert per_function_means([result.info, mixed.info, None]) == {
        "reward/accuracy_reward": 1.0,
        "reward/format_reward": 1.0,
        "reward/kind_reward": pytest.approx(0.2),
        "reward/length_reward": pytest.approx(0.04),
    }


def test_trl_gets_a_conversational_completion_for_a_chat_prompt(trl_dir):
    seen = []

    train, _ = load_task(task("task.name=dataset", f"task.path={trl_dir}", "task.reference_field=solution"), 1)
    job = reward_job("6", train[3])
    import examples.coming_from.trl_rewards as mod

    def spy(prompts, completions, **kw):
        seen.append((prompts, completions, kw))
        return [1.0]

    mod.spy = spy
    try:
        assert Grader(f"{TRL}:spy")(job).reward == 1.0
    finally:
        del mod.spy
    prompts, completions, kw = seen[0]
    assert prompts == [train[3]["meta"]["chat"]] and prompts[0][0] == {"role": "system", "content": SYSTEM}
    assert completions == [[{"role": "assistant", "content": "6"}]]
    logs = {k: kw.pop(k) for k in ("log_metric", "log_extra")}
    assert all(map(callable, logs.values()))  # TRL passes them; the values go into the result's info
    assert kw == {"kind": ["sum"], "solution": ["6"], "completion_ids": [[]]}  # each column as the batch's list


def test_trl_values_as_arrays_and_numpy_scalars_are_taken():
    import numpy as np
    import torch

    assert trl_value(np.array([0.5]), "f") == 0.5 and trl_value(torch.tensor([2.0]), "f") == 2.0
    assert (
        trl_value([np.float32(0.25)], "f") == 0.25 and trl_value([True], "f") == 1.0 and trl_value([None], "f") is None
    )
    for bad in ("0.5", {"reward": 1.0}, 0.5):
        with pytest.raises(TypeError, match="not a list of rewards"):
            trl_value(bad, "f")
    with pytest.raises(TypeError, match="returned a str reward"):
        trl_value(["high"], "f")  # never parsed as a number: TRL's tensor refuses it too


def test_the_pool_counts_a_wrong_length_list_as_a_failed_call():
    with RewardPool(f"{TRL}:wrong_length", size=1, timeout_s=30, retries=0) as pool:
        [res] = pool.grade([reward_job("x", {"answer": "1", "prompt": "q"})])
    assert res.reward == 0.0 and res.info["failed"] and "returned 2 rewards for 1 completion" in res.info["error"]


@pytest.mark.parametrize(
    "function, message",
    [
        ("tests.test_coming_from:fits_none", r"fits_none\(x, y\) requires \['x', 'y'\].*expected one of: areal"),
        (f"{TRL}:wrong_length", r"must return one reward per completion.*returned 2 rewards for 1 completion"),
    ],
)
def test_a_reward_that_fits_no_signature_is_refused_at_prepare(function, message, trl_dir, tmp_path):
    overrides = [*TINY, f"store={tmp_path / 'run'}", "task.name=dataset", f"task.path={trl_dir}",
                 "task.reference_field=solution", f"reward.function={function}"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"config key 'reward.function': .*" + message):
        pipeline.prepare("", overrides)
    assert not (tmp_path / "run" / "config.yaml").exists()


def fits_none(x, y):
    return 0.0


def test_the_trainer_drops_skipped_samples_counted():
    def sample(gid: str, i: int, skipped: bool) -> Sample:
        s = Sample(sample_id=f"{gid}-{i}", group_id=gid, prompt_id="p", worker_id="w", input_ids=[1, 2, 3],
                   prompt_len=1, loss_mask=[0, 1, 1], behav_logprobs=[0.0] * 3, versions=[-1, 0, 0])  # fmt: skip
        s.reward, s.reward_info = 0.0, ({"skipped": True, "reward_source": "reward_worker"} if skipped else {})
        return s

    buf = GroupBuffer()
    buf.add([sample("a", i, i == 0) for i in range(4)] + [sample("b", i, i > 0) for i in range(4)])
    counters = TrainerCounters()

    class Events:
        def __init__(self):
            self.seen = []

        def emit(self, kind, **kw):
            self.seen.append((kind, kw))

    ev = Events()
    drops = DropLog()
    out = screen(buf, 0, 2, [], False, counters, ev, drops)
    # group a keeps its 3 graded samples; group b is left with one and goes whole
    assert [s.sample_id for s in buf.samples()] == ["a-1", "a-2", "a-3"]
    assert len(out.skipped) == 5 and counters.skipped_samples == 5
    assert ev.seen == [("drop", {"reason": "reward_skipped", "n": 5})]
    # each skipped sample has its drop record (issue 54's accounting), with the reason and the trainer's version
    assert sorted(r["sample_id"] for r in drops.pending) == sorted(s.sample_id for s in out.skipped)
    assert {(r["reason"], r["trainer_version"]) for r in drops.pending} == {("reward_skipped", 0)}


# --- through pyflyte run ---


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tc.save("llama", tmp_path_factory.mktemp("ckpt") / "llama")


CASES = {
    "verl": (
        "verl_dir",
        ["task.reference_field=reward_model.ground_truth", f"reward.function={VERL}:compute_score_with_info"],
        lambda job: verl_gsm8k.compute_score_with_info(
            job["columns"]["data_source"], job["completion"], job["reference"], job["columns"]["extra_info"]
        )["score"],
    ),
    "trl": (
        "trl_dir",
        [
            "task.reference_field=solution",
            f"reward.function={TRL}:kind_reward,{TRL}:kind_digits_reward",
            "reward.weights=[2.0,0.5]",
        ],
        lambda job: (
            0.0
            if job["columns"]["kind"] == "skip"
            else 2 * len(job["completion"]) / 100 + 0.5 * sum(ch.isdigit() for ch in job["completion"]) / 10
        ),
    ),
    "messages": (
        "messages_dir",
        ["task.prompt_field=messages", f"reward.function={TRL}:length_reward"],
        lambda job: len(job["completion"]) / 100,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_each_layout_trains_to_done_through_pyflyte_and_stores_the_users_reward(case, checkpoint, request, tmp_path):
    folder, extra, expected = CASES[case]
    data = request.getfixturevalue(folder)
    store_dir = tmp_path / "run"
    overrides = [*TINY, f"store={store_dir}", f"model.path={checkpoint}", "sft.enabled=false", "task.name=dataset",
                 f"task.path={data}", "rollout.max_new_tokens=12", *extra]  # fmt: skip
    out = pyflyte("run", "workflows/grpo.py", "grpo", "--overrides", shlex.join(overrides), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    store = Store(str(store_dir))
    assert store.done()
    tok = AutoTokenizer.from_pretrained(str(store_dir / LAYOUT.init_model))
    records = {r["prompt_id"]: r for r in _prompts(store)}
    samples = [s for p in store.find(LAYOUT.graded_dir, ".arrow") for s in decode_shard(store.read_bytes(p))]
    assert len(samples) >= 16
    for s in samples:
        ref = records[s.prompt_id]
        assert s.meta.get("columns") == ref["meta"]["columns"]  # stored with the trajectory
        prompt_text = tok.decode(s.input_ids[: s.prompt_len])
        chat = ref["meta"].get("chat")
        if chat and chat[0]["role"] == "system":
            assert SYSTEM in prompt_text  # the chat's system message was rendered
        job = reward_job(tok.decode(s.response_ids(), skip_special_tokens=True), ref, s)
        assert s.reward == pytest.approx(expected(job), abs=1e-6), (s.sample_id, job["completion"])
    metrics = [json.loads(line) for line in store.read_text(LAYOUT.metrics).splitlines() if line.strip()]
    if case == "trl":  # every fourth prompt's samples are skipped by both functions: never trained on, counted
        skipped = [s for s in samples if s.meta["columns"]["kind"] == "skip"]
        assert skipped and all(s.reward_info.get("skipped") for s in skipped)
        assert all(s.reward_info["rewards"] == {"kind_reward": None, "kind_digits_reward": None} for s in skipped)
        assert max(m.get("skipped_samples", 0) for m in metrics) > 0
        trained = {i for p in store.find(LAYOUT.trained_dir, ".json") for i in record_ids(store.read_json(p))}
        assert trained and not trained & {s.identity() for s in skipped}
        for name in ("kind_reward", "kind_digits_reward"):  # each function logged apart
            assert any(math.isfinite(m.get(f"reward/{name}", math.nan)) for m in metrics)


def _prompts(store: Store) -> list[dict]:
    from areal_core.prompts import load_prompts

    return load_prompts(store)
