"""Issue 46: two shard writers with one worker id (two proxies left at `--worker-id proxy-0`) lost
half their rows. A writer now claims its id (areal_core/writer_claim.py): a second live one is
refused at start with the fix in the message; and shards are created only under free names, so
even two writers that share an id lose nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from areal_core.layout import LAYOUT
from areal_core.protocol import Sample, decode_shard
from areal_core.proxy.shards import ShardWriter
from areal_core.store import Store
from areal_core.writer_claim import WriterClaim, WriterInUse
from tests.conftest import ROOT

HOLD = """
import sys, time
from areal_core.store import Store
from areal_core.proxy.shards import ShardWriter
w = ShardWriter(Store(sys.argv[1]), "proxy-0")
print("held", flush=True)
time.sleep(600)
"""


def row(i: int, reward: float | None = 1.0) -> Sample:
    return Sample(
        sample_id=f"s{i}",
        group_id=f"g{i}",
        prompt_id=f"p{i}",
        worker_id="proxy-0",
        input_ids=[1, 2, 3],
        prompt_len=1,
        loss_mask=[0, 1, 1],
        behav_logprobs=[0.0, -1.0, -1.0],
        versions=[-1, 0, 0],
        reward=reward,
    )


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> Store:
    if request.param == "local":
        return Store(str(tmp_path / "sessions"))
    return Store(request.getfixturevalue("s3_bucket") + "/sessions")


def test_a_second_live_writer_of_an_id_is_refused_with_the_fix(store):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, store.uri], cwd=ROOT, stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WriterInUse, match=r"'proxy-0' .* held by a live writer .*--worker-id proxy-0-2"):
            ShardWriter(store, "proxy-0")
        other = ShardWriter(store, "proxy-1")  # another id is free
        other.close()
    finally:
        holder.kill()
        holder.wait()
    taken = ShardWriter(store, "proxy-0")  # its process is gone: the claim is stale, taken over
    taken.write([row(0)])
    taken.close()
    assert json.loads(store.read_bytes(LAYOUT.writer_claim("proxy-0")))["state"] == "released"


def test_a_claim_not_renewed_is_taken_over_and_its_holder_learns_it(store):
    first = WriterClaim(store, "w", timeout_s=2.0, interval_s=0.5)
    first._stop.set()  # a holder that stopped renewing (a paused process)
    first._thread.join()
    stale = json.loads(store.read_bytes(first.rel))
    stale.update(heartbeat=time.time() - 10, pid=1, host="elsewhere")
    store.write_bytes(first.rel, json.dumps(stale).encode())
    second = WriterClaim(store, "w", timeout_s=2.0, interval_s=0.5)
    assert json.loads(store.read_bytes(second.rel))["holder"] == second.holder
    second.release()


def test_a_corrupt_or_huge_claim_is_not_honoured(store):
    forged = {"state": "running", "heartbeat": time.time() + 10**9, "host": "elsewhere", "pid": 1}
    for junk in (
        b"\xff{not json",
        b"[" * 100_000,
        json.dumps({"state": "running", "heartbeat": "x"}).encode(),
        json.dumps(forged).encode(),  # a heartbeat from the future would hold the id for ever
    ):
        store.write_bytes(LAYOUT.writer_claim("w"), junk)
        WriterClaim(store, "w").release()


def test_two_writers_sharing_an_id_lose_no_row(store):
    """Two writers of one id in one process (allowed: the claim is this process's) write 6 sessions
    alternately, graded and ungraded: all 6 rows are in the store, under distinct names."""
    a, b = ShardWriter(store, "proxy-0"), ShardWriter(store, "proxy-0")
    names = []
    for i in range(6):
        names += (a if i % 2 else b).write([row(i, reward=None if i % 3 == 0 else 1.0)])
    a.close()
    b.close()
    assert len(set(names)) == 6
    shards = store.find(LAYOUT.trajectories_dir, ".arrow")
    rows = [s.sample_id for p in shards for s in decode_shard(store.read_bytes(p))]
    assert sorted(rows) == [f"s{i}" for i in range(6)]


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT)}
