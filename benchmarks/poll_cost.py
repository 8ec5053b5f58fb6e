"""What a poll costs against the run's length (issue 45): the trainer's graded listing and the
reward worker's ungraded listing, on moto's S3 server (started here), before (a whole listing per
poll: `Store.find`, as the roles did) and after (`ShardFeed.poll` from its cursors).

    PYTHONPATH=. .venv/bin/python benchmarks/poll_cost.py [--sizes 1000 5000 10000 20000] [--workers 4]

For each run length N the store holds N graded shards (and their N ungraded twins) of `--workers`
rollout workers, all already handled; 1 new shard per worker then lands, and one poll is timed
(median of `--repeats`), with the objects its LIST replies returned. One JSON line per (N, side),
then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from areal_core.layout import LAYOUT
from areal_core.shard_feed import ShardFeed, ungraded_gaps
from areal_core.store import Store
from benchmarks.moto_local import start_moto


def fill(store: Store, workers: int, start: int, stop: int) -> None:
    jobs = [
        (stage, f"rollout-{w}", s)
        for s in range(start, stop)
        for w in range(workers)
        for stage in ("ungraded", "graded")
    ]
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda j: store.write_bytes(LAYOUT.shard(*j), b"x"), jobs))


def counted(store: Store) -> list[int]:
    """Objects returned per LIST reply from now on (s3fs's own listings and ours)."""
    listed: list[int] = []
    original = store.fs.call_s3

    def call(method, *args, **kwargs):
        out = original(method, *args, **kwargs)
        if method == "list_objects_v2":
            listed.append(len(out.get("Contents", [])) + len(out.get("CommonPrefixes", [])))
        return out

    store.fs.call_s3 = call
    return listed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=[1000, 5000, 10000, 20000])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    proc, bucket = start_moto("polls")
    rows = []
    try:
        store = Store(f"{bucket}/{uuid.uuid4().hex[:8]}")
        listed = counted(store)
        have = 0
        for n in a.sizes:
            per = n // a.workers
            fill(store, a.workers, have, per)
            have = per
            trainer = ShardFeed(store, LAYOUT.graded_dir, gaps=ungraded_gaps(store))
            reward = ShardFeed(store, LAYOUT.ungraded_dir)
            for feed in (trainer, reward):
                for p in feed.poll():
                    feed.handled(p)
            for side, feed, layer in (("trainer", trainer, LAYOUT.graded_dir), ("reward", reward, LAYOUT.ungraded_dir)):
                for p in feed.poll():  # what the other side's repeats wrote: handled before timing
                    feed.handled(p)
                times = {"before": [], "after": []}
                objects = {}
                for r in range(a.repeats):
                    fill(store, a.workers, have + r, have + r + 1)  # one new shard per worker
                    for how in ("before", "after"):
                        listed.clear()
                        t0 = time.perf_counter()
                        new = store.find(layer, ".arrow") if how == "before" else feed.poll()
                        times[how].append(time.perf_counter() - t0)
                        objects[how] = sum(listed) if how == "after" else len(new)  # a whole listing returns all
                        if how == "after":
                            assert len(new) == a.workers, (side, len(new))
                            for p in new:
                                feed.handled(p)
                have += a.repeats
                row = {"shards": a.workers * have, "side": side}
                for how in ("before", "after"):
                    row[f"{how}_s"] = round(statistics.median(times[how]), 4)
                    row[f"{how}_objects_listed"] = objects[how]
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        proc.terminate()
    print("| shards in the run | poll of | before: s | before: objects listed | after: s | after: objects listed |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shards']} | {r['side']} | {r['before_s']} | {r['before_objects_listed']} | {r['after_s']} | "
            f"{r['after_objects_listed']} |"
        )


if __name__ == "__main__":
    main()
