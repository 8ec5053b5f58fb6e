"""The waits between the roles of one run, from its timing events (issue 57): how long an ungraded shard waited
before the reward worker began grading it, the reward worker's wait spans, the trainer's phases per step, and the
rollout's admission waits against its generating time.

    python benchmarks/role_waits.py RUN_ROOT [--skip 20]

RUN_ROOT is a run's store folder (e.g. runs/before-after-62/new-s1). One rollout and one reward worker (index 0)
are read; the trainer's phases leave out the first `--skip` steps (start-up).
"""

from __future__ import annotations

import argparse
import bisect
import statistics

from areal_core.events import read_events
from areal_core.store import Store


def role_waits(root: str, skip: int = 20) -> dict[str, float]:
    events = read_events(Store(root))
    ro = [e for e in events if e.get("role") == "rollout" and e.get("id", "0") == "0"]
    rw = [e for e in events if e.get("role") == "reward" and e.get("id", "0") == "0"]
    tr = [e for e in events if e.get("role") == "trainer"]
    writes = sorted(e["t1"] for e in ro if e.get("on") == "shard_write")
    latency = []
    for g in (e for e in rw if e.get("on") == "grade"):
        i = bisect.bisect_left(writes, g["t0"]) - 1
        if i >= 0:
            latency.append(g["t0"] - writes[i])
    latency.sort()
    reward_waits = [e["t1"] - e["t0"] for e in rw if e.get("on") == "shards"] or [0.0]
    out = {
        "shards_written": float(len(writes)),
        "write_to_grade_median_s": statistics.median(latency) if latency else 0.0,
        "write_to_grade_p90_s": latency[int(0.9 * len(latency))] if latency else 0.0,
        "reward_wait_span_median_s": statistics.median(reward_waits),
        "admission_wait_total_s": sum(e["t1"] - e["t0"] for e in ro if e.get("on") == "admission"),
        "generate_total_s": sum(e["t1"] - e["t0"] for e in ro if e.get("on") == "generate"),
    }
    phases = [e["phases"] for e in tr if e.get("kind") == "phases"][skip:]
    for name in ("batch", "train", "read", "publish", "metrics", "checkpoint"):
        out[f"trainer_{name}_s_per_step"] = statistics.mean(p.get(name, 0.0) for p in phases) if phases else 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--skip", type=int, default=20)
    args = parser.parse_args()
    for k, v in role_waits(args.root, args.skip).items():
        print(f"{k}: {v:.4f}")


if __name__ == "__main__":
    main()
