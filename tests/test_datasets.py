import json

import pytest

from areal_core.reward.math import gsm8k_reward
from task_data import arithmetic, gsm8k
from tests.conftest import GSM8K, gsm8k_file


def test_arithmetic_is_seeded_and_splits_are_disjoint():
    a_train, a_eval = arithmetic.generate(3, 300, 50, "+-*", 1, 9, 2)
    b_train, b_eval = arithmetic.generate(3, 300, 50, "+-*", 1, 9, 2)
    assert a_train == b_train and a_eval == b_eval
    assert not {r["prompt"] for r in a_train} & {r["prompt"] for r in a_eval}
    assert arithmetic.generate(4, 300, 50)[0] != a_train


def test_arithmetic_answers_are_gsm8k_style_and_correct():
    train, _ = arithmetic.generate(1, 500, 10, "+-*", 1, 20, 3)
    for r in train:
        lines = r["answer"].split("\n")
        assert lines[-1] == f"#### {r['meta']['final']}"
        value = None
        for line in lines[:-1]:
            expr, result = line.split("=")
            assert eval(expr) == int(result)  # noqa: S307 - generated arithmetic
            value = int(result)
        assert value == int(r["meta"]["final"]) >= 0
        assert gsm8k_reward(r["answer"], r["answer"]) == 1.0


def test_gsm8k_loader_reads_the_shared_files():
    gsm8k_file("test")
    rows = gsm8k.load_split(str(GSM8K), "test", limit=20)
    assert len(rows) == 20 and rows[0]["prompt_id"] == "gsm8k-test-0"
    assert rows[0]["meta"]["final"] == "18"


def test_gsm8k_missing_and_malformed_files(tmp_path):
    with pytest.raises(gsm8k.TaskDataError, match="does not exist"):
        gsm8k.load_split(str(tmp_path), "train")
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(gsm8k.TaskDataError, match="line 1: needs 'question' and 'answer'"):
        gsm8k.load_split(str(tmp_path), "train")
    (tmp_path / "train.jsonl").write_text("{not json\n")
    with pytest.raises(gsm8k.TaskDataError, match="line 1: not JSON"):
        gsm8k.load_split(str(tmp_path), "train")


@pytest.mark.s3
def test_gsm8k_loader_reads_s3(s3_bucket):
    import fsspec

    from areal_core.store import storage_options

    uri = f"{s3_bucket}/gsm8k"
    with fsspec.open(f"{uri}/test.jsonl", "wt", **storage_options(uri)) as f:
        f.write(gsm8k_file("test").read_text().split("\n", 3)[0] + "\n")
    rows = gsm8k.load_split(uri, "test")
    assert len(rows) == 1 and rows[0]["meta"]["final"] == "18"
