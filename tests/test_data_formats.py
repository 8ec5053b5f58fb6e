"""Bring your own data: the tables users have (task_data/tables.py, task_data/formats.py), the loader
plug-in (task_data/registry.py), and the errors that name the file and the row."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.feather as feather
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from areal_core.config import ConfigError, load_config
from areal_core.reward.math import gsm8k_reward, math_reward
from areal_core.run import pipeline
from task_data import load_task
from task_data.tables import TaskDataError
from tests.conftest import TINY

GSM = [
    {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
    for a in range(8)
    for b in range(8)
]
MATH = [
    {"problem": f"Compute ${a}\\pi + {b}\\pi$.", "solution": f"Add: $\\boxed{{{a + b}\\pi}}$.", "level": "Level 1"}
    for a in range(1, 7)
    for b in range(1, 7)
]


def task(*overrides: str):
    return load_config(None, ["task.num_train=30", "task.num_eval=6", *overrides]).task


def write(path, rows, fmt: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    if fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        pq.write_table(table, path)
    elif fmt == "csv":
        pcsv.write_csv(table, path)
    elif fmt == "arrow":
        with ipc.new_file(str(path), table.schema) as w:
            w.write_table(table)
    elif fmt == "feather":
        feather.write_feather(table, str(path))


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "arrow", "feather"])
def test_gsm8k_reads_every_table_format_as_split_files(fmt, tmp_path):
    write(tmp_path / f"train.{fmt}", GSM[:40], fmt)
    write(tmp_path / f"test.{fmt}", GSM[40:], fmt)
    train, held = load_task(task("task.name=gsm8k", f"task.path={tmp_path}"), 1)
    assert len(train) == 30 and len(held) == 6
    assert train[0] == {
        "prompt_id": "gsm8k-train-0",
        "prompt": "What is 0 + 0?",
        "answer": "0 + 0 = 0\n#### 0",
        "meta": {"final": "0"},
    }
    assert held[0]["prompt"] == GSM[40]["question"]
    assert all(gsm8k_reward(r["answer"], r["answer"]) == 1.0 for r in train + held)


@pytest.mark.parametrize("layout", ["main/{split}-00000-of-00001.parquet", "data/{split}-00000-of-00002.parquet"])
def test_the_hub_layouts_are_found(layout, tmp_path):
    write(tmp_path / layout.format(split="train"), GSM[:40], "parquet")
    write(tmp_path / layout.format(split="test"), GSM[40:], "parquet")
    train, held = load_task(task("task.name=gsm8k", f"task.path={tmp_path}"), 1)
    assert (len(train), len(held)) == (30, 6) and held[-1]["prompt"] == GSM[45]["question"]


def test_shards_of_one_split_are_read_in_order(tmp_path):
    write(tmp_path / "data" / "train-00000-of-00002.parquet", GSM[:20], "parquet")
    write(tmp_path / "data" / "train-00001-of-00002.parquet", GSM[20:40], "parquet")
    write(tmp_path / "data" / "test-00000-of-00001.parquet", GSM[40:], "parquet")
    train, _ = load_task(task("task.name=gsm8k", f"task.path={tmp_path}", "task.num_train=40"), 1)
    assert [r["prompt"] for r in train] == [r["question"] for r in GSM[:40]]


def test_two_hub_configs_are_refused_by_name(tmp_path):
    for config in ("main", "socratic"):
        write(tmp_path / config / "train-00000-of-00001.parquet", GSM[:10], "parquet")
    with pytest.raises(TaskDataError, match=r"2 configs \['main', 'socratic'\].*set task.path to one of them"):
        load_task(task("task.name=gsm8k", f"task.path={tmp_path}"), 1)


def test_math_takes_the_last_box_of_the_solution_and_grades_it_as_an_expression(tmp_path):
    write(tmp_path / "train.jsonl", MATH[:30], "jsonl")
    write(tmp_path / "test.jsonl", MATH[30:], "jsonl")
    train, held = load_task(task("task.name=math", f"task.path={tmp_path}"), 1)
    first = train[0]
    assert first["prompt"] == "Compute $1\\pi + 1\\pi$."
    assert first["meta"] == {"final": "2\\pi", "columns": {"level": "Level 1"}}  # the other columns travel
    assert first["answer"].endswith("The answer is $\\boxed{2\\pi}$.")
    assert math_reward("So the total is $\\boxed{2\\pi}$.", first["answer"]) == 1.0
    assert math_reward("So the total is $\\boxed{\\pi}$.", first["answer"]) == 0.0
    assert len(held) == 6


def test_math_500_answers_win_over_the_solution_box(tmp_path):
    rows = [{"problem": "p", "solution": "\\boxed{1}", "answer": "\\frac{1}{2}"}] * 4
    write(tmp_path / "train.jsonl", rows, "jsonl")
    write(tmp_path / "test.jsonl", rows, "jsonl")
    train, _ = load_task(task("task.name=math", f"task.path={tmp_path}"), 1)
    assert train[0]["meta"]["final"] == "\\frac{1}{2}" and math_reward("\\boxed{0.5}", train[0]["answer"]) == 1.0


def test_a_custom_table_with_mapped_fields_and_one_file_holds_out_its_last_rows(tmp_path, caplog):
    rows = [{"prompt": f"Say word {i}.", "reference": f"w{i}", "extra": i} for i in range(40)]
    write(tmp_path / "data.csv", rows, "csv")
    t = task("task.name=dataset", f"task.path={tmp_path / 'data.csv'}", "task.reference_field=reference")
    train, held = load_task(t, 1)
    assert [r["answer"] for r in held] == [f"w{i}" for i in range(34, 40)]
    assert len(train) == 30 and {r["answer"] for r in train}.isdisjoint({r["answer"] for r in held})
    assert "held out, not trained on" in caplog.text


def test_a_chat_messages_column_gives_its_last_user_message(tmp_path):
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Question {i}?"},
            ],
            "answer": str(i),
        }
        for i in range(12)
    ]
    write(tmp_path / "train.parquet", rows, "parquet")
    write(tmp_path / "test.parquet", rows, "parquet")
    train, _ = load_task(task("task.name=dataset", f"task.path={tmp_path}", "task.prompt_field=messages"), 1)
    assert train[3]["prompt"] == "Question 3?" and train[3]["answer"] == "3"


@pytest.mark.parametrize(
    "rows, overrides, message",
    [
        (
            [{"q": "x", "answer": "1"}],
            [],
            r"train.jsonl' row 1: no field 'prompt' \(set task.prompt_field\); its fields are \['answer', 'q'\]",
        ),
        (
            [{"prompt": "x", "answer": "1"}],
            ["task.reference_field=ref"],
            r"row 1: no field 'ref' \(set task.reference_field\)",
        ),
        ([{"prompt": "", "answer": "1"}], [], r"row 1: field 'prompt' must be a non-empty string"),
        ([{"prompt": ["not", "a", "chat"], "answer": "1"}], [], r"row 1: field 'prompt' must be"),
    ],
)
def test_a_bad_row_is_named_by_file_row_and_field(rows, overrides, message, tmp_path):
    write(tmp_path / "train.jsonl", rows * 3, "jsonl")
    write(tmp_path / "test.jsonl", rows * 3, "jsonl")
    with pytest.raises(TaskDataError, match=message):
        load_task(task("task.name=dataset", f"task.path={tmp_path}", *overrides), 1)


def test_a_gsm8k_row_without_its_final_line_is_named(tmp_path):
    write(tmp_path / "train.jsonl", [*GSM[:3], {"question": "q", "answer": "no final line"}], "jsonl")
    write(tmp_path / "test.jsonl", GSM[:3], "jsonl")
    with pytest.raises(TaskDataError, match=r"train.jsonl' row 4: GSM8K answer has no '####' line"):
        load_task(task("task.name=gsm8k", f"task.path={tmp_path}"), 1)


def test_an_unreadable_table_and_a_missing_split_say_what_was_looked_for(tmp_path):
    (tmp_path / "train.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(TaskDataError, match=r"train.parquet': not a readable .parquet table"):
        load_task(task("task.name=dataset", f"task.path={tmp_path}"), 1)
    (tmp_path / "train.parquet").unlink()
    with pytest.raises(TaskDataError, match=r"has no train split: looked for train.<ext>\[.gz\], .*data/train-\*"):
        load_task(task("task.name=dataset", f"task.path={tmp_path}"), 1)


def test_prepare_refuses_bad_data_before_any_work_naming_the_file(tmp_path):
    data = tmp_path / "data"
    write(data / "train.jsonl", [{"question": "q"}] * 3, "jsonl")
    root = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"config section 'task' \(gsm8k\): .*train.jsonl' row 1: no field 'answer'"):
        pipeline.prepare("", [*TINY, f"store={root}", "task.name=gsm8k", f"task.path={data}"])
    assert not root.exists()


def test_hub_parquet_is_read_from_s3(s3_bucket):
    import s3fs

    from areal_core.store import storage_options

    uri = f"{s3_bucket}/gsm8k"
    fs = s3fs.S3FileSystem(**storage_options(uri))
    for split, rows in (("train", GSM[:40]), ("test", GSM[40:])):
        with fs.open(f"{uri}/main/{split}-00000-of-00001.parquet", "wb") as f:
            pq.write_table(pa.Table.from_pylist(rows), f)
    train, held = load_task(task("task.name=gsm8k", f"task.path={uri}"), 1)
    assert (len(train), len(held)) == (30, 6) and train[0]["prompt"] == GSM[0]["question"]


# -- the loader plug-in ------------------------------------------------------------------------


def my_loader(task, seed):
    rows = [{"prompt": f"Name {i}.", "answer": f"n{i}"} for i in range(10)]
    return rows[:7], rows[7:]


def bad_loader(task, seed):
    return [{"prompt": "fine", "answer": "a"}], [{"answer": "no prompt"}]


def dup_loader(task, seed):
    return [{"prompt": "a", "answer": "1", "prompt_id": "x"}], [{"prompt": "b", "answer": "2", "prompt_id": "x"}]


def test_a_loader_plug_in_gives_the_records_with_ids(tmp_path):
    train, held = load_task(task("task.name=dataset", "task.loader=tests.test_data_formats:my_loader"), 1)
    assert [r["prompt_id"] for r in train] == [f"dataset-train-{i}" for i in range(7)]
    assert held == [
        {"prompt": f"Name {i}.", "answer": f"n{i}", "prompt_id": f"dataset-test-{i - 7}", "meta": {}}
        for i in range(7, 10)
    ]


@pytest.mark.parametrize(
    "loader, message",
    [
        ("bad_loader", r"test record 0: needs a non-empty string 'prompt'"),
        ("dup_loader", r"prompt_id 'x' is used twice"),
        ("no_such", r"config key 'task.loader': cannot import"),
    ],
)
def test_a_broken_loader_is_refused_at_prepare(loader, message, tmp_path):
    root = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        pipeline.prepare(
            "", [*TINY, f"store={root}", "task.name=dataset", f"task.loader=tests.test_data_formats:{loader}"]
        )
    assert not root.exists()


def test_a_missing_bucket_is_named_before_any_work(s3_bucket):
    missing = s3_bucket.replace("s3://", "s3://no-such-") + "-x"
    with pytest.raises(ConfigError, match=r"config key 'store': bucket 'no-such-areal-[0-9a-f]+-x' does not exist"):
        pipeline.prepare("", [*TINY, f"store={missing}/run"])


@pytest.mark.parametrize("suffix, opener", [("gz", "gzip"), ("bz2", "bz2"), ("xz", "lzma")])
def test_compressed_tables_are_read(suffix, opener, tmp_path):
    import importlib

    module = importlib.import_module(opener)
    for split, rows in (("train", GSM[:40]), ("test", GSM[40:])):
        with module.open(tmp_path / f"{split}.jsonl.{suffix}", "wt") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    train, held = load_task(task("task.name=gsm8k", f"task.path={tmp_path}"), 1)
    assert (len(train), len(held)) == (30, 6) and train[1]["prompt"] == GSM[1]["question"]


def test_a_damaged_compressed_file_is_named(tmp_path):
    (tmp_path / "train.jsonl.gz").write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(TaskDataError, match=r"train.jsonl.gz': cannot decompress it"):
        load_task(task("task.name=dataset", f"task.path={tmp_path}"), 1)


def test_the_save_to_disk_layout_is_read(tmp_path):
    """What Hugging Face `datasets.save_to_disk` writes: <split>/data-0000N-of-0000M.arrow (Arrow
    streams) beside state.json and dataset_info.json, which are not data."""
    for split, rows in (("train", GSM[:40]), ("test", GSM[40:])):
        folder = tmp_path / split
        folder.mkdir()
        table = pa.Table.from_pylist(rows)
        with ipc.new_stream(str(folder / "data-00000-of-00001.arrow"), table.schema) as w:
            w.write_table(table)
        (folder / "state.json").write_text('{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}')
        (folder / "dataset_info.json").write_text("{}")
    train, held = load_task(task("task.name=gsm8k", f"task.path={tmp_path}"), 1)
    assert (len(train), len(held)) == (30, 6) and held[0]["prompt"] == GSM[40]["question"]


def test_an_empty_file_is_named(tmp_path):
    (tmp_path / "train.jsonl").write_text("\n\n")
    with pytest.raises(TaskDataError, match=r"train.jsonl' has no rows"):
        load_task(task("task.name=gsm8k", f"task.path={tmp_path}"), 1)


def test_a_damaged_test_split_is_an_error_never_replaced_by_training_rows(tmp_path):
    write(tmp_path / "train.jsonl", GSM[:20], "jsonl")
    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{broken\n')
    with pytest.raises(TaskDataError, match=r"test.jsonl' line 2: not JSON"):
        load_task(task("task.name=gsm8k", f"task.path={tmp_path}"), 1)


def test_csv_cells_are_read_as_the_text_they_are(tmp_path):
    text = 'prompt,answer\n12,007\n"line one\nline two",1.50\nq3,1e3\nq4,12345678901234567890123\nq5,True\n'
    (tmp_path / "train.csv").write_text("\ufeff" + text)
    (tmp_path / "test.csv").write_text(text)
    train, _ = load_task(task("task.name=dataset", f"task.path={tmp_path}"), 1)
    assert [(r["prompt"], r["answer"]) for r in train] == [
        ("12", "007"),
        ("line one\nline two", "1.50"),
        ("q3", "1e3"),
        ("q4", "12345678901234567890123"),
        ("q5", "True"),
    ]


@pytest.mark.parametrize("value", [None, "", float("nan")])
def test_an_empty_reference_is_named(value, tmp_path):
    rows = [{"prompt": "p", "answer": 1.0 if isinstance(value, float) else "a"}, {"prompt": "p2", "answer": value}]
    write(tmp_path / "train.parquet", rows, "parquet")
    write(tmp_path / "test.parquet", rows[:1], "parquet")
    with pytest.raises(TaskDataError, match=r"train.parquet' row 2: field 'answer' is empty"):
        load_task(task("task.name=dataset", f"task.path={tmp_path}"), 1)


def test_what_is_not_data_is_ignored_and_what_is_ambiguous_is_refused(tmp_path):
    folder = tmp_path / "run[1]"  # a glob character in the path
    write(folder / "train.jsonl", GSM[:20], "jsonl")
    write(folder / "test.jsonl", GSM[20:30], "jsonl")
    write(folder / ".ipynb_checkpoints" / "test-checkpoint.jsonl", GSM[:3], "jsonl")
    train, held = load_task(task("task.name=gsm8k", f"task.path={folder}"), 1)
    assert (len(train), len(held)) == (20, 6) and held[0]["prompt"] == GSM[20]["question"]
    write(folder / "train.json", GSM[:20], "json")
    with pytest.raises(TaskDataError, match=r"2 tables for the train split \(train.json, train.jsonl\)"):
        load_task(task("task.name=gsm8k", f"task.path={folder}"), 1)


def test_splits_from_two_configs_are_refused(tmp_path):
    write(tmp_path / "main" / "train-00000-of-00001.parquet", GSM[:20], "parquet")
    write(tmp_path / "socratic" / "test-00000-of-00001.parquet", GSM[20:], "parquet")
    with pytest.raises(TaskDataError, match=r"the train split is in .*main.* and the test split in .*socratic"):
        load_task(task("task.name=gsm8k", f"task.path={tmp_path}"), 1)


def test_json_quirks_are_named(tmp_path):
    (tmp_path / "train.json").write_text(json.dumps({"data": GSM[:5]}, indent=2))
    with pytest.raises(TaskDataError, match=r"one JSON object \(keys \['data'\]\), not rows"):
        load_task(task("task.name=gsm8k", f"task.path={tmp_path}"), 1)
    (tmp_path / "train.json").unlink()
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": ' + "[" * 100_000 + "\n")
    with pytest.raises(TaskDataError, match=r"nested too deeply|not JSON"):
        load_task(task("task.name=gsm8k", f"task.path={tmp_path}"), 1)
    bom, latin = "\ufeff".encode(), "é".encode("cp1252")
    (tmp_path / "train.jsonl").write_bytes(bom + json.dumps(GSM[0]).encode() + b"\n" + latin)
    with pytest.raises(TaskDataError, match=r"not UTF-8 text"):
        load_task(task("task.name=gsm8k", f"task.path={tmp_path}"), 1)
