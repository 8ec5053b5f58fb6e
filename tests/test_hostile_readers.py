"""Tools that read a run (issue 24) on a finished run holding a valid shard copied under a name no
writer gives (`copy-of-1.arrow`): re-grade grades it into the same name, open_run counts its rows
as duplicates (the trained count is the trainer's), and a fork's cursor takes no position from it."""

from __future__ import annotations

import pytest

from areal_core.dataset import samples_table
from areal_core.layout import LAYOUT
from areal_core.protocol import decode_shard
from areal_core.reward.regrade import regrade
from areal_core.run.fork import fork
from areal_core.store import Store
from areal_core.train.checkpoint import committed_steps
from tests.finished_run import finished_run
from tests.test_regrade import PARITY


@pytest.mark.slow
def test_readers_take_a_copied_shard_with_an_odd_name(tmp_path):
    run_uri, result = finished_run()
    store = Store(str(tmp_path / "copy"))
    store.copy_dir("", "", source=Store(run_uri))
    shards = store.find(LAYOUT.graded_dir, ".arrow")
    odd = shards[0].rsplit("/", 1)[0] + "/copy-of-1.arrow"
    store.write_bytes(odd, store.read_bytes(shards[0]))
    copied = len(decode_shard(store.read_bytes(odd)))

    table = samples_table(store).to_pylist()
    trained = sum(r["status"] == "trained" for r in table)
    assert trained == result["counters"]["trained_samples"]
    assert sum(r["status"] == "duplicate" for r in table) == copied
    assert {r["shard_seq"] for r in table if r["status"] == "duplicate"} == {None}

    report = regrade(store, reward=PARITY, into="odd")
    assert report.shards == len(shards) + 1 and not report.unreadable
    target = LAYOUT.in_layer(odd, "graded", "odd")
    assert len(decode_shard(store.read_bytes(target))) == copied
    assert sum(r["status"] == "duplicate" for r in samples_table(store, "odd").to_pylist()) == copied

    step = committed_steps(store)[-1]
    out = fork(store.uri, step, str(tmp_path / "child"), [f"train.steps={step + 2}"])
    assert Store(out["run_uri"]).exists(LAYOUT.fork_parent)
