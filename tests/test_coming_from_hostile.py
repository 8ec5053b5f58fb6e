"""Datasets and reward functions from other frameworks, as real users, clumsy ones and real
datasets break them (issue 53's review): TRL functions as TRL's own docs write them
(`completion_ids`, `log_metric`), verl's struct ground truths and dicts without "score", OpenAI
text-part contents, prefilled chats, deep columns, clashing names, exact weights, a re-grade of a
run with several weighted functions."""

from __future__ import annotations

import json
import logging
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from areal_core.config import ConfigError, load_config
from areal_core.models import record_prompt
from areal_core.protocol import Sample
from areal_core.reward.labels import apply_labels, preference_pairs
from areal_core.reward.pool import Grader, RewardPool
from areal_core.reward.regrade import RegradeError, regrade
from areal_core.reward.signatures import load_functions, reward_job, reward_spec, signature_kind, trl_value
from areal_core.reward.worker import grade_samples
from areal_core.run import pipeline
from areal_core.train.batch import GroupBuffer
from areal_core.train.counters import TrainerCounters
from areal_core.train.drops import DropLog
from areal_core.train.sources import screen
from task_data import load_task
from tests.conftest import TINY

HERE = "tests.test_coming_from_hostile"


def task(*overrides: str):
    return load_config(None, list(overrides)).task


def write_jsonl(folder, rows: list[dict], split: str = "train") -> None:
    (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


# --- TRL functions as TRL's docs write them ---


def ids_reward(completion_ids, **kwargs):
    """TRL's docs, "Example 1: reward longer completions": no `completions` parameter at all."""
    return [float(len(ids)) for ids in completion_ids]


def ids_and_text_reward(completions, completion_ids, **kwargs):
    return [float(len(ids)) + len(c) / 100 for c, ids in zip(completions, completion_ids)]


def logging_reward(completions, solution, **kwargs):
    """TRL's log_metric / log_extra, reached through **kwargs (TRL always passes them)."""
    kwargs["log_metric"]("exact", 1.0)
    kwargs["log_extra"]("golden", list(solution))
    return [1.0 if c == s else 0.0 for c, s in zip(completions, solution)]


def test_a_trl_function_of_completion_ids_only_is_trl_and_gets_the_token_ids():
    assert signature_kind(ids_reward, "x", ("solution",)) == "trl"
    assert signature_kind(ids_and_text_reward, "x", ("solution",)) == "trl"
    record = {"prompt": "q", "answer": "1", "prompt_id": "p", "meta": {}}
    assert Grader(f"{HERE}:ids_reward")(reward_job("abc", record, completion_ids=[5, 6, 7])).reward == 3.0
    both = Grader(f"{HERE}:ids_and_text_reward")(reward_job("abcd", record, completion_ids=[5, 6]))
    assert both.reward == pytest.approx(2.04)


def test_the_reward_workers_pass_each_samples_response_ids(trl_dir):
    train, _ = load_task(task("task.name=dataset", f"task.path={trl_dir}", "task.reference_field=solution"), 1)
    s = Sample(sample_id="g-0", group_id="g", prompt_id=train[0]["prompt_id"], worker_id="w",
               input_ids=[1, 2, 3, 4, 5], prompt_len=2, loss_mask=[0, 0, 1, 1, 1], behav_logprobs=[0.0] * 5,
               versions=[-1, -1, 0, 0, 0])  # fmt: skip
    tok = types.SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "x" * len(ids))
    with RewardPool(f"{HERE}:ids_reward", size=1, timeout_s=30, retries=0) as pool:
        grade_samples([s], pool, {r["prompt_id"]: r for r in train}, tok)
    assert s.reward == 3.0 and not s.reward_info.get("failed"), s.reward_info


def test_log_metric_and_log_extra_are_callable_and_their_values_kept(trl_dir):
    train, _ = load_task(task("task.name=dataset", f"task.path={trl_dir}", "task.reference_field=solution"), 1)
    result = Grader(f"{HERE}:logging_reward")(reward_job("6", train[3]))  # solution "6", a chat prompt
    assert result.reward == 0.0  # a conversational completion is a list of messages, not "6"
    assert result.info == {"logging_reward/exact": 1.0, "logging_reward/golden": "6"}


def test_prepare_takes_trl_docs_completion_ids_function(trl_dir, tmp_path):
    overrides = [*TINY, f"store={tmp_path / 'run'}", "task.name=dataset", f"task.path={trl_dir}",
                 "task.reference_field=solution", f"reward.function={HERE}:ids_reward"]  # fmt: skip
    pipeline.prepare("", overrides)
    assert (tmp_path / "run" / "config.yaml").exists()


def test_a_string_reward_from_a_trl_function_is_refused_not_parsed():
    with pytest.raises(TypeError, match="returned a str reward"):
        trl_value(["0.5"], "f")


# --- verl ---


def countdown_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's countdown reward reads a struct ground truth: ground_truth["target"], ["numbers"]."""
    return float(str(ground_truth["target"]) in solution_str) + len(ground_truth["numbers"]) / 10


def extra_info_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(extra_info.get("index", -1))  # verl's reward manager passes {} when the row has none


def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}


def test_verl_gets_a_struct_ground_truth_as_the_dict_it_is(tmp_path):
    rows = [{"data_source": "countdown", "prompt": [{"role": "user", "content": f"make {i}"}],
             "reward_model": {"style": "rule", "ground_truth": {"target": i, "numbers": [1, 2, 3]}}}
            for i in range(8)]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    train, _ = load_task(
        task("task.name=dataset", f"task.path={tmp_path}", "task.reference_field=reward_model.ground_truth"), 1
    )
    assert json.loads(train[2]["answer"]) == {"target": 2, "numbers": [1, 2, 3]}  # ours: the reference as text
    assert Grader(f"{HERE}:countdown_score")(reward_job("= 2", train[2])).reward == pytest.approx(1.3)
    assert Grader(f"{HERE}:extra_info_score")(reward_job("", train[2])).reward == -1.0


def test_a_verl_dict_without_score_is_named_and_refused_at_prepare(trl_dir, tmp_path):
    record = {"prompt": "q", "answer": "1", "meta": {}}
    with pytest.raises(TypeError, match="without 'score'"):
        Grader(f"{HERE}:no_score")(reward_job("1", record))
    overrides = [*TINY, f"store={tmp_path / 'run'}", "task.name=dataset", f"task.path={trl_dir}",
                 "task.reference_field=solution", f"reward.function={HERE}:no_score"]  # fmt: skip
    with pytest.raises(ConfigError, match="without 'score'"):
        pipeline.prepare("", overrides)


# --- names, weights, a re-grade ---


def value_1(completion):
    return 1.0


def value_2(completion):
    return 2.0


def value_1_2(completion):  # named as a second value_1 would be renamed
    return 2.0


def test_clashing_names_each_keep_their_value():
    spec = f"{HERE}:value_1_2,{HERE}:value_1,{HERE}:value_1"
    names = [f.name for f in load_functions(spec)]
    assert len(set(names)) == 3, names
    assert Grader(spec)(reward_job("x", {}, None)).info["rewards"] == {names[0]: 2.0, names[1]: 1.0, names[2]: 1.0}


def test_weights_are_taken_exactly():
    cfg = load_config(None, [f"reward.function={HERE}:value_1, {HERE}:value_2 ,", "reward.weights=[0.1234567891,1]"])
    result = Grader(reward_spec(cfg, "unused"))(reward_job("x", {}))
    assert result.reward == 0.1234567891 * 1.0 + 1 * 2.0


def test_a_regrade_of_a_run_with_several_weighted_functions_imports_each(tmp_path, trl_dir):
    overrides = [*TINY, f"store={tmp_path / 'run'}", "task.name=dataset", f"task.path={trl_dir}",
                 "task.reference_field=solution", f"reward.function={HERE}:value_1,{HERE}:value_2",
                 "reward.weights=[1.0,0.5]"]  # fmt: skip
    run_uri, _ = pipeline.prepare("", overrides)
    with pytest.raises(RegradeError, match="no shards to re-grade"):  # past the import of each function
        regrade(run_uri, into="again")


# --- the data ---


@pytest.fixture
def trl_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl")
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "solution": str(2 * i)} for i in range(12)]
    pq.write_table(pa.Table.from_pylist(rows), out / "train.parquet")
    return out


def test_openai_text_parts_are_read_as_their_text_and_other_parts_named(tmp_path, smollm2_path):
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 2?"}]
    rows = [{"prompt": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                        {"role": "user", "content": parts}], "answer": "4"}] * 4  # fmt: skip
    write_jsonl(tmp_path, rows)
    train, _ = load_task(task("task.name=dataset", f"task.path={tmp_path}"), 1)
    assert train[0]["prompt"] == "What is 2 + 2?"
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>" in tok.decode(
        record_prompt(tok, train[0])
    )
    image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    write_jsonl(tmp_path, [{"prompt": image, "answer": "a cat"}] * 4)
    with pytest.raises(ValueError, match=r"message 0 has a content part of type 'image'"):
        load_task(task("task.name=dataset", f"task.path={tmp_path}"), 1)
    tool_call = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": None, "tool_calls": []}]
    write_jsonl(tmp_path, [{"prompt": tool_call, "answer": "4"}] * 4)
    with pytest.raises(ValueError, match=r"message 1 has content of type NoneType, not a string or text parts"):
        load_task(task("task.name=dataset", f"task.path={tmp_path}"), 1)


def test_a_chat_ending_with_an_assistant_message_is_continued_as_trl_does(tmp_path, smollm2_path, caplog):
    chat = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "<think>"}]
    write_jsonl(tmp_path, [{"prompt": chat, "answer": "4"}] * 4)
    with caplog.at_level(logging.WARNING, logger="areal.task_data"):
        train, _ = load_task(task("task.name=dataset", f"task.path={tmp_path}"), 1)
    assert "end with an assistant message" in caplog.text
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = record_prompt(tok, train[0])
    assert ids == tok.apply_chat_template(chat, continue_final_message=True, tokenize=True, return_dict=False)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>")  # open: the completion follows the prefill


def test_columns_nested_past_the_stack_are_a_dataset_error(tmp_path):
    deep: object = 1
    for _ in range(900):
        deep = [deep]
    write_jsonl(tmp_path, [{"prompt": f"q{i}", "answer": "1", "deep": deep} for i in range(4)])
    with pytest.raises(ValueError, match="nested too deeply"):
        load_task(task("task.name=dataset", f"task.path={tmp_path}"), 1)


# --- skipped samples downstream: the trainer's screen, labels, preference pairs ---


class Events:
    def __init__(self):
        self.seen = []

    def emit(self, kind, **kw):
        self.seen.append((kind, kw))


def graded(gid: str, i: int, reward: float, info: dict) -> Sample:
    s = Sample(sample_id=f"{gid}-{i}", group_id=gid, prompt_id=gid, worker_id="w", input_ids=[1, 2, 3], prompt_len=1,
               loss_mask=[0, 1, 1], behav_logprobs=[0.0] * 3, versions=[-1, 0, 0])  # fmt: skip
    s.reward, s.reward_info = reward, info
    return s


SKIPPED = {"skipped": True, "reward_source": "reward_worker"}
GRADED = {"reward_source": "reward_worker"}


def test_only_groups_holding_a_skipped_sample_are_counted_as_skipped():
    buf = GroupBuffer()
    # a group of one (an agent whose other episodes failed): not the reward's skip
    buf.add([graded("one", 0, 1.0, {"reward_source": "agent"})])
    buf.add([graded("b", i, 0.0 if i == 0 else float(i), SKIPPED if i == 0 else GRADED) for i in range(3)])
    # an agent's own info that says "skipped" is not the reward functions' None
    buf.add([graded("c", i, float(i), {"skipped": True, "reward_source": "agent"}) for i in range(2)])
    counters, ev, drops = TrainerCounters(), Events(), DropLog()
    out = screen(buf, 0, 2, [], False, counters, ev, drops)
    assert [s.sample_id for s in out.skipped] == ["b-0"] and counters.skipped_samples == 1
    assert [(r["reason"], r["sample_id"]) for r in drops.pending if r["reason"] == "reward_skipped"] == [
        ("reward_skipped", "b-0")
    ]
    assert ("drop", {"reason": "reward_skipped", "n": 1}) in ev.seen
    assert [s.sample_id for s in out.dropped] == ["one-0"]  # the short group goes by the staleness rule, as before
    assert sorted(s.sample_id for s in buf.samples()) == ["b-1", "b-2", "c-0", "c-1"]


def test_a_labelled_reward_unskips_a_sample_and_pairs_leave_skipped_ones_out():
    group = [graded("p", 0, 0.0, dict(SKIPPED)), graded("p", 1, 0.5, dict(GRADED)), graded("p", 2, 0.2, dict(GRADED))]
    assert [(p["chosen_sample_id"], p["rejected_sample_id"]) for p in preference_pairs(group)] == [("p-1", "p-2")]
    apply_labels(group, [{"sample_id": "p-0", "reward": 1.0}])
    assert group[0].reward == 1.0 and "skipped" not in group[0].reward_info
    assert group[0].reward_info["label"]["model_skipped"] is True
    buf = GroupBuffer()
    buf.add(group)
    drops = DropLog()
    out = screen(buf, 0, 2, [], False, TrainerCounters(), Events(), drops)
    assert not out.skipped and len(buf.samples()) == 3 and not drops.pending


def test_a_session_meta_of_any_shape_neither_crashes_grading_nor_moves_the_ground_truth(tmp_path):
    """An online client ends its session with any `meta` (proxy EndRequest): a `columns` that is no
    dict must not kill the reward worker, and a `reference` of its own must not become verl's
    ground truth (that is the record's)."""
    rows = [{"prompt": f"make {i}", "reward_model": {"ground_truth": {"target": i, "numbers": [1]}}} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    train, _ = load_task(
        task("task.name=dataset", f"task.path={tmp_path}", "task.reference_field=reward_model.ground_truth"), 1
    )
    for meta in ({"columns": 5}, {"columns": "ab", "chat": 7}, {"reference": {"target": 99, "numbers": []}}):
        s = graded("g", 0, 0.0, {})
        s.prompt_id, s.meta = train[1]["prompt_id"], meta
        job = reward_job("= 1", train[1], s)
        assert job["columns"] == train[1]["meta"]["columns"]
        assert Grader(f"{HERE}:countdown_score")(job).reward == pytest.approx(1.1)
