"""A run root as a pyarrow dataset joined with the trainer's audit, and DuckDB over it."""

from __future__ import annotations

import json

import duckdb
import pyarrow as pa
import pytest

from areal_core.dataset import DatasetError, open_run, read_audit, samples_table, shard_dataset
from areal_core.layout import LAYOUT
from areal_core.protocol import Sample, encode_shard
from areal_core.store import Store
from tests.finished_run import finished_run


def _records(store: Store) -> list[dict]:
    return [store.read_json(p) for p in store.find(LAYOUT.trained_dir, ".json")]


@pytest.mark.slow
def test_duckdb_over_a_runs_shards_gives_the_trainers_own_counts():
    run_uri, result = finished_run()
    store = Store(run_uri)
    records = _records(store)
    run = open_run(run_uri)  # noqa: F841 (DuckDB finds it by name)
    per_step = duckdb.sql(
        "SELECT step, count(*) FROM run WHERE status = 'trained' GROUP BY step ORDER BY step"
    ).fetchall()
    assert per_step == [(r["step"], len(r["samples"])) for r in records]
    counters = result["counters"]
    assert sum(n for _, n in per_step) == counters["trained_samples"] == 5 * 2 * 4
    # every drop the trainer counted, including those made while it waited for a batch
    [(drops,)] = duckdb.sql("SELECT count(*) FROM run WHERE status = 'dropped'").fetchall()
    assert drops == counters["dropped_samples"] > 0
    # per-token staleness histogram of the trained tokens, from the shards' own version columns
    hist = duckdb.sql(
        """
        SELECT trainer_version - v AS staleness, count(*) AS tokens
        FROM (SELECT trainer_version, unnest(versions) AS v, unnest(loss_mask) AS m FROM run WHERE status = 'trained')
        WHERE m = 1 GROUP BY ALL ORDER BY staleness
        """
    ).fetchall()
    audit_hist: dict[int, int] = {}
    for r in records:
        for k, n in r["staleness_histogram"].items():
            audit_hist[int(k)] = audit_hist.get(int(k), 0) + n
    assert dict(hist) == audit_hist and max(audit_hist) <= 1  # η = 1: no trained token is older
    # the dropped ones violated the bound when they were dropped; trained staleness = v − min version
    [(bad,)] = duckdb.sql("SELECT count(*) FROM run WHERE status = 'dropped' AND staleness <= 1").fetchall()
    assert bad == 0
    [(mismatch,)] = duckdb.sql(
        "SELECT count(*) FROM run WHERE status = 'trained' AND staleness <> trainer_version - min_version"
    ).fetchall()
    assert mismatch == 0


@pytest.mark.slow
def test_columns_and_untrained_samples_match_the_shards():
    run_uri, _ = finished_run()
    store = Store(run_uri)
    table = samples_table(run_uri)
    shards = store.find(LAYOUT.graded_dir, ".arrow")
    assert table.num_rows == shard_dataset(run_uri).count_rows() > 0
    for col in ("prompt_id", "group_id", "worker_id", "shard_seq", "row", "versions", "reward", "reward_reason"):
        assert col in table.column_names
    assert "input_ids" not in table.column_names and "input_ids" in samples_table(run_uri, tokens=True).column_names
    statuses = set(table["status"].to_pylist())
    assert statuses == {"trained", "dropped", "untrained"}
    rows = table.to_pylist()
    # (shard_seq, row) locates each sample in its shard
    from areal_core.protocol import decode_shard

    rel = shards[3]
    worker, seq = LAYOUT.shard_worker_seq(rel)
    in_shard = decode_shard(store.read_bytes(rel))
    located = sorted((r["row"], r["sample_id"]) for r in rows if r["worker_id"] == worker and r["shard_seq"] == seq)
    assert located == [(i, s.sample_id) for i, s in enumerate(in_shard)]
    untrained = [r for r in rows if r["status"] == "untrained"]
    assert untrained and all(r["step"] is None and r["staleness"] is None for r in untrained)
    trained_ids = {(w, s) for rec in _records(store) for w, (s, _) in zip(rec["sample_workers"], rec["samples"])}
    assert {(r["worker_id"], r["sample_id"]) for r in rows if r["status"] == "trained"} == trained_ids


def _sample(i: int, worker: str = "w", info: dict | None = None) -> Sample:
    return Sample(
        sample_id=f"s{i}",
        group_id=f"g{i // 2}",
        prompt_id=f"p{i}",
        worker_id=worker,
        input_ids=[1, 2, 3, 4],
        prompt_len=2,
        loss_mask=[0, 0, 1, 1],
        behav_logprobs=[0.0, 0.0, -0.5, -0.7],
        versions=[-1, -1, 3, 4],
        reward=1.0,
        reward_info=info or {},
    )


def test_audit_join_reasons_and_versions_on_a_hand_made_root(tmp_path):
    store = Store(str(tmp_path / "run"))
    infos = [{"error": "timeout after 5s"}, {"failures": ["t1: wrong", "t2: crash"]}, {"reason": "boxed twice"}, {}]
    store.write_bytes(LAYOUT.graded_shard("w", 0), encode_shard([_sample(i, info=infos[i]) for i in range(4)]))
    store.write_bytes(LAYOUT.graded_shard("v", 7), encode_shard([_sample(9, "v")]))
    # an older record without workers joins on the sample id; a newer one on worker/sample id
    store.write_json(LAYOUT.trained_record(0), {"step": 0, "trainer_version": 5, "samples": [["s1", 3]], "dropped": []})
    store.write_json(
        LAYOUT.trained_record(1),
        {
            "step": 1,
            "trainer_version": 6,
            "samples": [["s9", 3], ["s0", 3]],
            "sample_workers": ["v", "w"],
            "dropped": [["s2", 3]],
            "dropped_workers": ["w"],
        },
    )
    rows = {r["sample_id"]: r for r in samples_table(store).to_pylist()}
    assert rows["s0"]["status"] == "trained" and rows["s0"]["step"] == 1 and rows["s0"]["step_index"] == 1
    assert rows["s0"]["staleness"] == 3 and rows["s9"]["shard_seq"] == 7 and rows["s9"]["step_index"] == 0
    assert rows["s1"]["step"] == 0 and rows["s1"]["staleness"] == 2
    assert rows["s2"]["status"] == "dropped" and rows["s3"]["status"] == "untrained"
    assert [rows[f"s{i}"]["reward_reason"] for i in range(4)] == [
        "timeout after 5s",
        "t1: wrong; t2: crash",
        "boxed twice",
        None,
    ]
    assert rows["s0"]["min_version"] == 3 and rows["s0"]["max_version"] == 4 and rows["s0"]["policy_tokens"] == 2
    assert read_audit(store).num_rows == 4


def test_a_corrupt_or_foreign_shard_is_skipped_not_fatal(tmp_path, caplog):
    store = Store(str(tmp_path / "run"))
    store.write_bytes(LAYOUT.graded_shard("w", 0), encode_shard([_sample(0), _sample(1)]))
    store.write_bytes(LAYOUT.graded_shard("w", 1), b"not arrow at all")
    other = pa.table({"x": [1]}).replace_schema_metadata({"areal.schema_version": "0"})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, other.schema) as w:
        w.write_table(other)
    store.write_bytes(LAYOUT.graded_shard("w", 2), sink.getvalue().to_pybytes())
    table = samples_table(store)
    assert table["sample_id"].to_pylist() == ["s0", "s1"]
    assert sum("skipped shard" in r.message for r in caplog.records) == 2
    assert store.exists(LAYOUT.graded_shard("w", 1))  # a reader never moves the run's files


def test_bad_or_unfinished_layers_are_refused(tmp_path):
    store = Store(str(tmp_path / "run"))
    with pytest.raises(DatasetError, match="layer name"):
        open_run(store, layer="../graded")
    store.write_bytes(LAYOUT.layer_shard("fix", "w", 0), encode_shard([_sample(0)]))
    with pytest.raises(DatasetError, match="no committed layer 'fix'"):
        open_run(store, layer="fix")
    store.write_text(LAYOUT.committed(LAYOUT.layer_dir("fix")), "")
    assert open_run(store, layer="fix").count_rows() == 1
    assert open_run(store).count_rows() == 0  # an empty graded layer is an empty dataset


@pytest.mark.slow
@pytest.mark.s3
def test_the_same_dataset_on_s3(s3_bucket):
    run_uri, _ = finished_run()
    local = Store(run_uri)
    remote = Store(f"{s3_bucket}/runs/copy")
    for folder in (LAYOUT.graded_dir, LAYOUT.trained_dir):
        remote.copy_dir(folder, folder, source=local)
    a, b = samples_table(local), samples_table(remote)
    assert set(a["root"].to_pylist()) == {local.uri} and set(b["root"].to_pylist()) == {remote.uri}
    assert a.drop_columns(["root"]).equals(b.drop_columns(["root"])) and a.num_rows > 0
    run = open_run(remote)  # noqa: F841
    assert duckdb.sql("SELECT count(*) FROM run WHERE status = 'trained'").fetchall() == [(40,)]
    assert json.loads(remote.read_text(LAYOUT.trained_record(0)))["step"] == 0


def test_a_forks_dataset_holds_the_parent_rows_it_references_or_trained(tmp_path):
    """Hand-made parent and fork at v4: the referenced shard's groups on the lineage, the pending
    sample its audit names from a consumed shard; not the parent's own trained rows, an off-lineage
    group, nor a later parent sample that shares an identity with one of the fork's own."""
    from areal_core.forks import ForkRef, write_fork

    parent, child = Store(str(tmp_path / "p")), Store(str(tmp_path / "c"))

    def s(sid: str, gid: str, versions: list[int]) -> Sample:
        return Sample(sid, gid, "p", "w", [1, 2, 3, 4], 2, [0, 0, 1, 1], [0.0] * 4, [-1, -1, *versions], reward=1.0)

    consumed = [s("a0", "ga", [3, 3]), s("a1", "ga", [3, 4])]  # a1 pending at the fork, a0 trained by P
    referenced = [s("b0", "gb", [4, 4]), s("b1", "gb", [4, 4]), s("c0", "gc", [4, 5]), s("c1", "gc", [4, 4])]
    later = [s("d0", "gd", [5, 5])]  # P's after the fork; the fork makes its own d0
    for seq, rows in enumerate((consumed, referenced, later)):
        parent.write_bytes(LAYOUT.graded_shard("w", seq), encode_shard(rows))
    parent.write_json(
        LAYOUT.trained_record(0),
        {"step": 0, "trainer_version": 3, "samples": [["a0", 3]], "sample_workers": ["w"], "dropped": []},
    )
    write_fork(child, ForkRef(parent.uri, 4, 4, {LAYOUT.graded_shard("w", 1): parent.uri}, {}))
    child.write_bytes(LAYOUT.graded_shard("w", 3), encode_shard([s("d0", "gd", [4, 4]), s("d1", "gd", [4, 4])]))
    child.write_json(
        LAYOUT.trained_record(4),
        {
            "step": 4,
            "trainer_version": 4,
            "samples": [["a1", 3], ["b0", 4], ["b1", 4], ["d0", 4], ["d1", 4]],
            "sample_workers": ["w"] * 5,
            "dropped": [],
        },
    )
    rows = {(r["root"], r["sample_id"]): r for r in samples_table(child).to_pylist()}
    assert sorted(rows) == sorted(
        [(parent.uri, "a1"), (parent.uri, "b0"), (parent.uri, "b1"), (child.uri, "d0"), (child.uri, "d1")]
    )
    assert all(r["status"] == "trained" and r["step"] == 4 for r in rows.values())
    assert [rows[k]["step_index"] for k in sorted(rows, key=lambda k: rows[k]["step_index"])] == [0, 1, 2, 3, 4]
    assert rows[(parent.uri, "a1")]["shard_seq"] == 0 and rows[(parent.uri, "a1")]["row"] == 1
    assert open_run(child, layer="ungraded").count_rows() == 0  # only the graded layer inherits


# -- hostile rows (issue 24) -----------------------------------------------------------------------
ODD_NAMES = ["copy-of-0.arrow", "0 (copy).arrow", "ünï cödé.arrow", "1.5.arrow", "-1.arrow", "00000009.arrow"]


def test_copied_shards_under_any_name_are_duplicates_not_trained(tmp_path):
    """A valid shard copied under names no writer gives (and under a writer's name, and into
    another worker's folder) is read, its rows marked duplicate: the trained count is the trainer's."""
    store = Store(str(tmp_path / "run"))
    original = encode_shard([_sample(i) for i in range(4)])
    store.write_bytes(LAYOUT.graded_shard("w", 0), original)
    store.write_bytes(LAYOUT.graded_shard("w", 1), encode_shard([_sample(i) for i in range(4, 6)]))
    for name in ODD_NAMES:
        store.write_bytes(f"{LAYOUT.shard_dir('graded', 'w')}/{name}", original)
    store.write_bytes(LAYOUT.graded_shard("aaa", 0), original)  # sorts before 'w': still the copy
    store.write_json(
        LAYOUT.trained_record(0),
        {
            "step": 0,
            "trainer_version": 5,
            "samples": [[f"s{i}", 3] for i in range(4)],
            "sample_workers": ["w"] * 4,
            "dropped": [["s4", 3]],
            "dropped_workers": ["w"],
        },
    )
    rows = samples_table(store).to_pylist()
    assert len(rows) == 6 + 4 * (len(ODD_NAMES) + 1)
    by_status: dict[str, int] = {}
    for r in rows:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    assert by_status == {"trained": 4, "dropped": 1, "untrained": 1, "duplicate": 4 * (len(ODD_NAMES) + 1)}
    for r in rows:
        original_row = r["shard_seq"] in (0, 1) and r["worker_id"] == "w"
        if r["status"] == "duplicate":
            assert r["step"] is None and r["trainer_version"] is None and r["staleness"] is None
        else:
            assert original_row, r
    seqs = sorted({r["shard_seq"] for r in rows}, key=lambda x: (x is None, x))
    assert seqs == [0, 1, 9, None]  # a writer-like name keeps its number; other names have none
    run = open_run(store)  # noqa: F841 (DuckDB finds it by name)
    [(trained,)] = duckdb.sql("SELECT count(*) FROM run WHERE status = 'trained'").fetchall()
    assert trained == 4


def test_any_reward_info_the_protocol_allows_is_read(tmp_path):
    store = Store(str(tmp_path / "run"))
    infos = [[1, 2], 5, "text", None, True, {"reward_source": 7, "reason": ["a", "b"]}, {"label": "x"}, [{"a": 1}]]
    samples = []
    for i, info in enumerate(infos):
        s = _sample(i)
        s.reward_info = info
        samples.append(s)
    store.write_bytes(LAYOUT.graded_shard("w", 0), encode_shard(samples))
    rows = {r["sample_id"]: r for r in samples_table(store).to_pylist()}
    assert len(rows) == len(infos)
    assert rows["s5"]["reward_source"] == "7" and rows["s5"]["reward_reason"] == "['a', 'b']"
    assert all(rows[f"s{i}"]["reward_source"] is None for i in (0, 1, 2, 3, 4, 6, 7))
    assert rows["s0"]["status"] == "untrained"


def test_reward_info_that_is_not_json_is_read_as_empty(tmp_path):
    from areal_core.dataset import _info

    for text in ("not json", "[1", "{", "\x00", "NaN", "1e999", "[" * 100_000 + "]" * 100_000, None, ""):
        assert isinstance(_info(text), dict)
    assert _info('{"reason": "r"}') == {"reason": "r"}
