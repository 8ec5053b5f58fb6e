"""Human labels: the table on the store, the join into graded samples, DPO preference pairs."""

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_core.layout import LAYOUT
from areal_core.protocol import Sample, decode_shard, encode_shard, write_shard
from areal_core.reward.labels import (
    Labels,
    LabelsError,
    apply_labels,
    export_preference_pairs,
    load_labels,
    preference_pairs,
    write_labels,
)
from areal_core.store import Store


def sample(sid: str, prompt: str, reward: float | None, resp: list[int] | None = None, token_rewards=False) -> Sample:
    resp = resp or [7, 8]
    ids = [1, 2] + resp
    return Sample(
        sample_id=sid,
        group_id=f"g-{prompt}",
        prompt_id=prompt,
        worker_id="w",
        input_ids=ids,
        prompt_len=2,
        loss_mask=[0, 0] + [1] * len(resp),
        behav_logprobs=[0.0] * len(ids),
        versions=[-1, -1] + [0] * len(resp),
        reward=reward,
        token_rewards=[0.0] * (len(ids) - 1) + [reward or 0.0] if token_rewards else None,
        reward_info={"verifier": "gsm8k"},
    )


def test_sample_label_overrides_and_records():
    s = [sample("a", "p", 0.0, token_rewards=True), sample("b", "p", 1.0), sample("c", "q", 1.0)]
    labels = Labels.from_rows([{"sample_id": "a", "reward": 1.0, "label": "actually right", "annotator": "ann"}])
    out = apply_labels(s, labels)
    assert out is s
    assert [x.reward for x in s] == [1.0, 1.0, 1.0]
    info = s[0].reward_info
    assert info["model_reward"] == 0.0 and info["verifier"] == "gsm8k"
    assert info["label"]["label"] == "actually right" and info["label"]["annotator"] == "ann"
    assert info["label"]["key"] == "sample_id" and info["label"]["dropped_token_rewards"] is True
    assert s[0].token_rewards is None
    assert "label" not in s[1].reward_info and "label" not in s[2].reward_info


def test_sample_label_wins_over_prompt_label_and_label_without_reward_only_records():
    s = [sample("a", "p", 1.0), sample("b", "p", 1.0), sample("c", "q", 0.5)]
    labels = Labels.from_rows(
        [
            {"prompt_id": "p", "reward": 0.0, "label": "bad prompt: ambiguous"},
            {"sample_id": "b", "reward": 0.75},
            {"prompt_id": "q", "label": "looked at it, fine"},
        ]
    )
    apply_labels(s, labels)
    assert [x.reward for x in s] == [0.0, 0.75, 0.5]
    assert s[0].reward_info["label"]["key"] == "prompt_id"
    assert s[1].reward_info["label"]["key"] == "sample_id"
    assert s[2].reward_info["label"]["label"] == "looked at it, fine"
    assert "model_reward" not in s[2].reward_info


def test_apply_labels_accepts_plain_rows_and_empty_tables():
    s = [sample("a", "p", 0.0)]
    assert apply_labels(s, [])[0].reward == 0.0
    assert apply_labels(s, [{"sample_id": "a", "reward": "1"}])[0].reward == 1.0


@pytest.mark.parametrize(
    "row, message",
    [
        ({"reward": 1.0}, "needs a sample_id or a prompt_id"),
        ({"sample_id": "a", "reward": "high"}, "is not a number"),
        ({"sample_id": "a", "reward": float("nan")}, "not finite"),
        ("a", "is an object"),
    ],
)
def test_bad_label_rows_are_named(row, message):
    with pytest.raises(LabelsError, match=message):
        Labels.from_rows([row], source="labels/x.jsonl")


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request, tmp_path):
    if request.param == "local":
        return Store(str(tmp_path / "run"))
    return Store(request.getfixturevalue("s3_bucket") + "/run")


def test_labels_table_on_the_store_parquet_and_jsonl(store):
    assert len(load_labels(store)) == 0
    write_labels(store, [{"sample_id": "a", "reward": 0.0}, {"prompt_id": "p", "reward": 0.5}], "01-batch.parquet")
    write_labels(store, [{"sample_id": "a", "reward": 1.0, "label": "relabelled"}], "02-fix.jsonl")
    store.write_text("labels/README.txt", "ignored")
    labels = load_labels(store)
    assert len(labels) == 2
    assert labels.by_sample["a"]["reward"] == 1.0  # the later file wins
    assert labels.by_sample["a"]["source"] == "labels/02-fix.jsonl"
    assert labels.by_prompt["p"]["reward"] == 0.5
    s = apply_labels([sample("a", "p", 0.0), sample("z", "p", 1.0)], labels)
    assert [x.reward for x in s] == [1.0, 0.5]
    # the join survives the trip through a graded shard
    back = decode_shard(encode_shard(s))
    assert back[0].reward_info["label"]["label"] == "relabelled"


def test_corrupt_labels_file_is_a_named_error(store):
    store.write_text("labels/bad.jsonl", '{"sample_id": "a"}\nnot json\n')
    with pytest.raises(LabelsError, match="labels/bad.jsonl line 2"):
        load_labels(store)
    with pytest.raises(LabelsError, match="parquet or .jsonl"):
        write_labels(store, [{"sample_id": "a"}], "x.csv")


def _nested_jsonl(store):
    store.write_text("labels/deep.jsonl", "[" * 5000 + "]" * 5000 + "\n")


def _fifo(store):
    import os

    if not store.local:
        pytest.skip("a FIFO is a local file system's object")
    os.makedirs(store.path("labels"), exist_ok=True)
    os.mkfifo(store.path("labels/pipe.jsonl"))


def _over_the_limit(store):
    import areal_core.reward.labels as labels_mod

    store.write_text("labels/big.jsonl", '{"sample_id": "b"}\n' * (labels_mod.LABELS_FILE_BYTES // 19 + 1))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda st: st.write_bytes("labels/latin1.jsonl", b'{"sample_id": "\xe9"}\n'), "not UTF-8"),
        (_nested_jsonl, "nested too deeply"),
        (lambda st: st.write_bytes("labels/bad.parquet", b"PAR1 not really PAR1"), "not a readable Parquet"),
        (lambda st: st.write_text("labels/row.jsonl", '["a list"]\n'), "a label is an object"),
        (lambda st: st.write_text("labels/inf.jsonl", '{"sample_id": "a", "reward": Infinity}\n'), "not finite"),
        (_fifo, "not a regular file"),
        (_over_the_limit, "16384"),  # the limit, in either store's words
    ],
)
def test_a_labels_file_that_cannot_be_used_is_named_or_skipped_while_the_others_apply(
    store, make, message, monkeypatch
):
    monkeypatch.setattr("areal_core.reward.labels.LABELS_FILE_BYTES", 16384)
    make(store)
    with pytest.raises(LabelsError, match=message):
        load_labels(store)
    write_labels(store, [{"sample_id": "a", "reward": 1.0}], "zz-good.jsonl")
    skipped: list[str] = []
    labels = load_labels(store, on_error=lambda rel, exc: skipped.append(f"{rel}: {exc}"))
    assert labels.by_sample["a"]["reward"] == 1.0 and len(labels) == 1
    assert len(skipped) == 1 and message in skipped[0]


def test_preference_pairs_best_worst_and_all():
    s = [
        sample("a", "p", 1.0, [10]),
        sample("b", "p", 0.0, [11]),
        sample("c", "p", 0.5, [12]),
        sample("d", "q", 1.0, [13]),
        sample("e", "q", 1.0, [14]),  # a tie: no pair for q
        sample("f", "r", None, [15]),  # ungraded: skipped
        sample("g", "r", 1.0, [16]),
    ]
    pairs = preference_pairs(s)
    assert [(p["chosen_sample_id"], p["rejected_sample_id"]) for p in pairs] == [("a", "b")]
    assert pairs[0]["prompt_ids"] == [1, 2] and pairs[0]["chosen_ids"] == [10] and pairs[0]["rejected_ids"] == [11]
    assert pairs[0]["source"] == "reward"
    every = preference_pairs(s, mode="all")
    assert {(p["chosen_sample_id"], p["rejected_sample_id"]) for p in every} == {("a", "c"), ("a", "b"), ("c", "b")}
    assert len(preference_pairs(s, mode="all", min_margin=0.5)) == 1
    text = preference_pairs(s, decode=lambda ids: " ".join(map(str, ids)))
    assert text[0]["prompt"] == "1 2" and text[0]["chosen"] == "10" and text[0]["rejected"] == "11"
    with pytest.raises(ValueError, match="mode"):
        preference_pairs(s, mode="top3")


def test_labelled_pairs_are_marked():
    s = apply_labels(
        [sample("a", "p", 0.0), sample("b", "p", 1.0)],
        [{"sample_id": "a", "reward": 1.0}, {"sample_id": "b", "reward": 0.0}],
    )
    (pair,) = preference_pairs(s)
    assert (pair["chosen_sample_id"], pair["rejected_sample_id"], pair["source"]) == ("a", "b", "label")


def test_export_preference_pairs_to_parquet_on_the_store(store):
    write_shard(store, LAYOUT.graded_shard("w0", 0), [sample("a", "p", 1.0, [10, 11]), sample("b", "p", 0.0, [12])])
    write_shard(store, LAYOUT.graded_shard("w1", 0), [sample("c", "q", 0.0, [13]), sample("d", "q", 0.0, [14])])
    store.write_bytes(LAYOUT.graded_shard("w2", 0), b"not arrow")
    labels = Labels.from_rows([{"sample_id": "d", "reward": 1.0, "label": "good"}])
    stats = export_preference_pairs(store, labels=labels, decode=lambda ids: "".join(chr(96 + i % 26) for i in ids))
    assert stats == {"pairs": 2, "samples": 4, "prompts": 2, "bad_shards": 1}
    table = pq.read_table(io.BytesIO(store.read_bytes(LAYOUT.preference_pairs)))
    rows = table.to_pylist()
    assert [(r["prompt_id"], r["chosen_sample_id"], r["rejected_sample_id"]) for r in rows] == [
        ("p", "a", "b"),
        ("q", "d", "c"),
    ]
    assert rows[0]["chosen_ids"] == [10, 11] and rows[0]["chosen"] == "jk" and rows[0]["prompt"] == "ab"
    assert table.schema.field("chosen_ids").type == pa.list_(pa.int32())
    assert rows[1]["chosen_reward"] == 1.0 and rows[1]["source"] == "reward"  # only one side labelled


def test_export_without_decode_has_ids_only(tmp_path):
    store = Store(str(tmp_path / "run"))
    write_shard(store, LAYOUT.graded_shard("w0", 0), [sample("a", "p", 1.0), sample("b", "p", 0.0)])
    assert export_preference_pairs(store, out="exports/p.parquet")["pairs"] == 1
    names = pq.read_table(io.BytesIO(store.read_bytes("exports/p.parquet"))).schema.names
    assert "chosen" not in names and "chosen_ids" in names
