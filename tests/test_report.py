"""The run report: series from events, the bottleneck doctor, the HTML page in a real browser,
the Deck and MLflow."""

from __future__ import annotations

import pytest

from areal_core.report.doctor import diagnose, limiting_role, stalled_workers


def spans(role: str, worker: str, pattern: list[tuple[str, str, float]], steps: int = 20, t0: float = 1000.0):
    """Span records of one worker repeating `pattern` [(state, on, seconds)] `steps` times."""
    out, t = [], t0
    for _ in range(steps):
        for state, on, sec in pattern:
            out.append(
                {"t": t + sec, "kind": "span", "state": state, "on": on, "t0": t, "t1": t + sec}
                | {"role": role, "worker": worker}
            )
            t += sec
    return out


ROLLOUT_BOUND = (
    spans("trainer", "0", [("wait", "batch", 3), ("busy", "step", 1)])
    + spans("rollout", "0", [("busy", "decode", 4)])
    + spans("reward", "0", [("wait", "shards", 3), ("busy", "grade", 1)])
)
TRAINER_BOUND = (
    spans("trainer", "0", [("busy", "step", 4)])
    + spans("rollout", "0", [("wait", "admission", 3), ("busy", "decode", 1)])
    + spans("reward", "0", [("wait", "shards", 3), ("busy", "grade", 1)])
)
REWARD_BOUND = (
    spans("trainer", "0", [("wait", "batch", 3), ("busy", "step", 1)])
    + spans("rollout", "0", [("wait", "admission", 2), ("busy", "decode", 2)])
    + spans("reward", "0", [("busy", "grade", 4)])
)
ETA_BOUND = (
    spans("trainer", "0", [("wait", "batch", 2), ("busy", "step", 2)])
    + spans("rollout", "0", [("busy", "decode", 2), ("wait", "admission", 2)])
    + spans("reward", "0", [("wait", "shards", 3), ("busy", "grade", 1)])
)


@pytest.mark.parametrize(
    ("records", "role"),
    [(ROLLOUT_BOUND, "rollout"), (TRAINER_BOUND, "trainer"), (REWARD_BOUND, "reward"), (ETA_BOUND, "eta")],
)
def test_the_doctor_names_the_role_the_others_wait_on(records, role):
    assert limiting_role(records) == role
    verdict = diagnose(records)[0]
    assert (verdict.kind, verdict.role) == ("limit", role)


def test_the_verdict_carries_its_evidence_and_advice():
    verdict = diagnose(ROLLOUT_BOUND)[0]
    assert "waited for batches 75%" in verdict.line() and "rollout ran at 100%" in verdict.line()
    assert "add rollout workers" in verdict.advice


def test_the_recent_window_sees_a_change_of_bottleneck():
    """Rollout limits for 80 s, then the trainer for the last 80 s: the window sees the trainer."""
    late = [
        r | {"t": r["t"] + 80, "t0": r["t0"] + 80, "t1": r["t1"] + 80}
        for r in spans("trainer", "0", [("busy", "step", 4)])
        + spans("rollout", "0", [("wait", "admission", 3), ("busy", "decode", 1)])
    ]
    records = sorted(ROLLOUT_BOUND + late, key=lambda r: r["t"])
    assert limiting_role(records, window_s=60) == "trainer"


def test_no_verdict_without_timing_events():
    assert limiting_role([]) is None
    assert limiting_role(spans("trainer", "0", [("busy", "step", 1)])) is None
    assert diagnose([])[0].kind == "info"


def test_a_worker_that_stops_recording_is_stalled_and_one_that_closed_is_not():
    records = ROLLOUT_BOUND + spans("rollout", "1", [("busy", "decode", 4)], steps=5)  # stops at t=1020
    records += spans("reward", "1", [("busy", "grade", 4)], steps=5) + [
        {"t": 1020.5, "kind": "overhead", "seconds": 0.01, "role": "reward", "worker": "1"}
    ]
    assert [name for name, _ in stalled_workers(records)] == ["rollout-1"]
    flags = [f for f in diagnose(records) if f.kind == "health"]
    assert [f.title for f in flags] == ["stalled worker rollout-1"]
    assert "60s older" in flags[0].evidence


def test_health_flags_reward_collapse_exploding_weights_and_drops():
    rows = [
        {"step": s, "reward_mean": 0.8 if s < 10 else 0.05, "importance_weight_max": 50.0 if s == 15 else 1.2}
        for s in range(1, 21)
    ]
    drops = [{"t": 1001.0, "kind": "drop", "reason": "stale", "n": 6, "role": "trainer", "worker": "0"}]
    trained = [{"t": 1002.0, "kind": "trained", "step": 1, "samples": 94, "role": "trainer", "worker": "0"}]
    titles = [f.title for f in diagnose(ROLLOUT_BOUND + drops + trained, rows)[1:]]
    assert titles == ["reward collapse", "exploding importance weight", "drops above 5%"]
    healthy = [{"step": s, "reward_mean": 0.5, "importance_weight_max": 1.5} for s in range(1, 21)]
    few = [drops[0] | {"n": 4}]  # 4 of 98: under 5%
    assert diagnose(ROLLOUT_BOUND + few + trained, healthy)[1:] == []
