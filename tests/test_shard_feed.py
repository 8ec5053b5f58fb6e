"""Issue 45: polls that cost what is new. The trainer's graded feed and the reward worker's ungraded
feed list each worker folder from a cursor (areal_core/shard_feed.py, Store.find_after), on a
local folder and on moto's S3: every shard is returned exactly once, whatever order they land in,
and a poll lists the shards above the floor, not the run."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from areal_core.layout import LAYOUT
from areal_core.shard_feed import ShardFeed, ungraded_gaps
from areal_core.store import Store


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> Store:
    if request.param == "local":
        return Store(str(tmp_path / "run"))
    return Store(request.getfixturevalue("s3_bucket") + "/some/run")


def put(store: Store, stage: str, worker: str, *seqs: int) -> list[str]:
    paths = [LAYOUT.shard(stage, worker, s) for s in seqs]
    for p in paths:
        store.write_bytes(p, b"x")
    return paths


def drain(feed: ShardFeed) -> list[str]:
    new = feed.poll()
    for p in new:
        feed.handled(p)
    return new


def test_every_shard_once_in_any_landing_order(store):
    """Graded shards of one rollout worker land out of order (two reward workers); a lower one
    that lands after a higher one is still returned, once; a folder appearing later is found."""
    put(store, "ungraded", "rollout-0", *range(6))
    feed = ShardFeed(store, LAYOUT.graded_dir, gaps=ungraded_gaps(store))
    assert feed.poll() == []
    put(store, "graded", "rollout-0", 0, 1, 4)
    got = drain(feed)
    assert got == [LAYOUT.graded_shard("rollout-0", s) for s in (0, 1, 4)]
    assert feed.floors() == {"rollout-0": 1}  # 2 and 3 are ungraded, not gone: the floor waits
    put(store, "graded", "rollout-0", 3)
    put(store, "graded", "rollout-1", 0)
    assert drain(feed) == [LAYOUT.graded_shard("rollout-0", 3), LAYOUT.graded_shard("rollout-1", 0)]
    put(store, "graded", "rollout-0", 2, 5)
    assert drain(feed) == [LAYOUT.graded_shard("rollout-0", s) for s in (2, 5)]
    assert feed.floors() == {"rollout-0": 5, "rollout-1": 0}
    assert drain(feed) == []


def test_a_quarantined_ungraded_shard_is_a_gap_the_floor_steps_over(store):
    """A shard the reward worker quarantined never gets a graded twin: the floor passes it once
    later ones are handled (else every poll would list from there on)."""
    put(store, "ungraded", "w", 0, 2, 3)  # 1 was quarantined: gone from ungraded/
    feed = ShardFeed(store, LAYOUT.graded_dir, gaps=ungraded_gaps(store))
    put(store, "graded", "w", 0, 2, 3)
    assert len(drain(feed)) == 3
    assert feed.floors() == {"w": 3}


def test_names_that_are_not_sequence_numbers_are_returned_once(store):
    put(store, "ungraded", "w", 0, 1)
    store.write_bytes(f"{LAYOUT.shard_dir('ungraded', 'w')}/copy-of-1.arrow", b"x")
    feed = ShardFeed(store, LAYOUT.ungraded_dir)
    assert len(drain(feed)) == 3 and drain(feed) == []


def test_a_restart_resumes_from_what_was_handled(store):
    put(store, "ungraded", "w", *range(5))
    first = ShardFeed(store, LAYOUT.ungraded_dir)
    handled = first.poll()[:3]
    again = ShardFeed(store, LAYOUT.ungraded_dir, handled=handled)
    assert again.floors() == {"w": 2}
    assert again.poll() == [LAYOUT.ungraded_shard("w", s) for s in (3, 4)]


def test_a_poll_lists_what_is_new_not_the_run(s3_bucket):
    """On moto: after 3,000 shards of 3 workers are handled, a poll lists only the 3 new shards
    (counted in the ListObjectsV2 replies), where a whole listing returns all 3,003."""
    store = Store(s3_bucket + "/run")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: put(store, "ungraded", f"rollout-{i % 3}", i // 3), range(3000)))
    listed = []
    original = store.fs.call_s3

    def counting(method, *args, **kwargs):
        out = original(method, *args, **kwargs)
        if method == "list_objects_v2":
            listed.append(len(out.get("Contents", [])))
        return out

    store.fs.call_s3 = counting
    feed = ShardFeed(store, LAYOUT.ungraded_dir)
    assert len(drain(feed)) == 3000
    assert sum(listed) == 3000 and len(listed) >= 3  # the first poll lists everything, in pages
    for i in range(3):
        put(store, "ungraded", f"rollout-{i}", 1000)
    listed.clear()
    assert len(drain(feed)) == 3
    assert sum(listed) == 3 and len(listed) == 3  # one short page per worker folder
    assert len(store.find(LAYOUT.ungraded_dir, ".arrow")) == 3003
