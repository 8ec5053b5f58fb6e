"""The bottleneck doctor: which role limits the run, on what evidence, and what would help; plus
the signs of an unhealthy run. Pure functions of the events (areal_core/events.py) and the
trainer's metrics rows (trainer/metrics.jsonl).

The limiting role, from each role's wait fraction w (report/timing.py):
  trainer  w_trainer < 0.25: batches were ready; the trainer sets the pace
  eta      w_trainer ≥ 0.25 and rollout waited on admission ≥ 0.25 and reward (if any) waited
           ≥ 0.25: every side waits on another; the staleness bound serialises them
  reward   otherwise, when reward waited less than rollout
  rollout  otherwise
Health flags: a stalled worker (no close record, last record > `stall_s` older than the run's
newest), reward collapse (the last window's mean reward below half of the best window's, and
at least 0.1 lower), an exploding importance weight (max > 10 or KL(behav‖prox) > 0.5), drops
above 5% of (trained + dropped) samples, rewards that are failed calls above 20% of the trained
samples (`reward_error_frac`, with the most frequent reason), staleness hurting the update (over
the last tenth of the steps, at least 3, the behaviour correction masked or truncated more than 5%
of the policy tokens, non-finite ones aside, or KL(behav‖prox) averaged above 0.05: lower η or lr),
an MoE's routing drift driving the importance weights instead (routing replay removes at least half
of the behaviour gap: `routing_drift`).
A crashed run's findings lead with the crash: the role's own `crash` record (its exception and
where), or the launcher's (exit code and last output line) for a role killed without one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from areal_core.report import series
from areal_core.report.timing import RoleTime, role_time

WAIT_HIGH = 0.25
IW_MAX = 10.0
KL_MAX = 0.5
DROP_FRAC = 0.05
STALL_S = 30.0
REWARD_ERROR_FRAC = 0.2  # mean share of a step's samples whose reward was a failed call
STALE_FRAC = 0.05  # mean share of policy tokens the behaviour correction masked or truncated
STALE_KL = 0.05  # mean KL(behav‖prox) per policy token
ROUTE_SHARE = 0.5  # share of the behaviour gap that routing replay removes, above which routing drift drives it
ROUTE_GAP = 1e-3  # mean |Δ log p| under the trainer's own routes below which there is nothing to explain


@dataclasses.dataclass(frozen=True)
class Finding:
    """One verdict: `kind` "limit" (the limiting role), "health" (an unhealthy sign) or "info"."""

    kind: str
    role: str
    title: str
    evidence: str
    advice: str = ""

    def line(self) -> str:
        return f"{self.title}: {self.evidence}" + (f"; {self.advice}" if self.advice else "")


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _verdict(roles: dict[str, RoleTime]) -> tuple[str, str, str] | None:
    """(limiting role, evidence, advice), or None when the trainer and rollout have no spans."""
    trainer, rollout, reward = roles.get("trainer"), roles.get("rollout"), roles.get("reward")
    if trainer is None or rollout is None:
        return None
    tw, rw = trainer.wait, rollout.wait
    adm = rollout.wait_on.get("admission", 0.0)
    gw = reward.wait if reward else 1.0
    tail = f"; reward waited {_pct(gw)}" if reward else ""
    if tw < WAIT_HIGH:
        return (
            "trainer",
            f"the trainer waited for batches only {_pct(tw)} of the time (busy {_pct(1 - tw)}); "
            f"rollout waited on admission {_pct(adm)}{tail}",
            "give the trainer more devices (trainer world size) or less work per step; "
            "more rollout workers will not help",
        )
    if adm >= WAIT_HIGH and gw >= WAIT_HIGH:
        return (
            "eta",
            f"the trainer waited for batches {_pct(tw)} of the time and rollout waited on admission {_pct(adm)}{tail}",
            "the staleness bound holds both back: raise η (train.eta) so rollout runs ahead",
        )
    if reward is not None and gw < rw:
        return (
            "reward",
            f"the trainer waited for batches {_pct(tw)} of the time; reward ran at {_pct(1 - gw)}, "
            f"rollout waited {_pct(rw)}",
            "add reward workers (reward.num_workers)",
        )
    return (
        "rollout",
        f"the trainer waited for batches {_pct(tw)} of the time; rollout ran at {_pct(1 - rw)}{tail}",
        "add rollout workers (rollout.num_workers) or raise η (train.eta)",
    )


def rl_start(records: list[dict[str, Any]]) -> float | None:
    """When RL began: the trainer's first `publish` (version 0); the roles' start-up before it
    (loading models, waiting for the first weights) is not what limits the run."""
    return min((float(r["t"]) for r in records if r.get("kind") == "publish"), default=None)


def limiting_role(records: list[dict[str, Any]], window_s: float | None = None) -> str | None:
    """The role that limits the run since RL began (`rl_start`), over the last `window_s` seconds
    of records when given: "trainer", "rollout", "reward" or "eta" (the staleness bound); None
    when there are too few events."""
    since = rl_start(records)
    if window_s is not None and records:
        since = max(since or 0.0, max(float(r["t"]) for r in records) - window_s)
    v = _verdict(role_time(records, since))
    return v[0] if v else None


def stalled_workers(records: list[dict[str, Any]], stall_s: float = STALL_S) -> list[tuple[str, float]]:
    """[(role-worker, seconds behind)] for workers that never closed their log and whose last
    record is more than `stall_s` older than the newest record of the run."""
    last: dict[str, float] = {}
    closed: set[str] = set()
    for rec in records:
        name = f"{rec['role']}-{rec['worker']}"
        last[name] = max(last.get(name, 0.0), float(rec["t"]))
        if rec.get("kind") == "overhead":
            closed.add(name)
    if not last:
        return []
    newest = max(last.values())
    return sorted(
        ((n, newest - t) for n, t in last.items() if n not in closed and newest - t > stall_s),
        key=lambda x: -x[1],
    )


def _windows_mean(values: list[float], w: int) -> list[float]:
    return [sum(values[i : i + w]) / w for i in range(0, len(values) - w + 1)]


def dropped_share(records: list[dict[str, Any]]) -> tuple[int, int]:
    """(trained samples, samples the trainer dropped: stale or of an abandoned version), from the
    `trained` events (the last of each step: `series.trained`)."""
    trained_ev = series.trained(records)
    trained = sum(int(r.get("samples", 0)) for r in trained_ev)
    return trained, sum(int(r.get("dropped", 0)) + int(r.get("abandoned", 0)) for r in trained_ev)


def _health(records: list[dict[str, Any]], rows: Sequence[dict[str, Any]], stall_s: float) -> list[Finding]:
    out = [
        Finding(
            "health",
            name.split("-", 1)[0],
            f"stalled worker {name}",
            f"its last event is {behind:.0f}s older than the run's newest and it never closed its log",
            "look at its log; restart it or the run",
        )
        for name, behind in stalled_workers(records, stall_s)
    ]
    return out + _reward_collapse(rows) + _exploding_weight(rows) + _stored_state_damage(records) + _drops(records)


def _reward_collapse(rows: Sequence[dict[str, Any]]) -> list[Finding]:
    """The mean reward of the last window of steps below half the best window's (and 0.1 under it)."""
    out: list[Finding] = []
    rewards = [float(r["reward_mean"]) for r in rows if r.get("reward_mean") is not None]
    if len(rewards) >= 6:
        w = max(3, len(rewards) // 10)
        means = _windows_mean(rewards, w)
        best, final = max(means), means[-1]
        if final < 0.5 * best and best - final >= 0.1:
            out.append(
                Finding(
                    "health",
                    "trainer",
                    "reward collapse",
                    f"the mean reward of the last {w} steps is {final:.3f}, down from {best:.3f}",
                    "lower the learning rate or η; check the reward",
                )
            )
    return out


def _exploding_weight(rows: Sequence[dict[str, Any]]) -> list[Finding]:
    """An importance weight above IW_MAX, or KL(behav‖prox) above KL_MAX, at any step."""
    out: list[Finding] = []
    iw = [(r["step"], float(r["importance_weight_max"])) for r in rows if r.get("importance_weight_max") is not None]
    kl = [(r["step"], float(r["kl_behav_prox"])) for r in rows if r.get("kl_behav_prox") is not None]
    big = max(iw, key=lambda x: x[1], default=None)
    far = max(kl, key=lambda x: x[1], default=None)
    if (big and big[1] > IW_MAX) or (far and far[1] > KL_MAX):
        out.append(
            Finding(
                "health",
                "trainer",
                "exploding importance weight",
                f"max importance weight "
                f"{big[1] if big else 0:.3g} (step {big[0] if big else '-'}), max KL(behav‖prox) "
                f"{far[1] if far else 0:.3g}",
                "lower η or cap the weight (algo.behav_high)",
            )
        )
    return out


def _stored_state_damage(records: list[dict[str, Any]]) -> list[Finding]:
    """Checkpoints skipped, versions republished or unloadable, readers retired: the events."""
    out: list[Finding] = []
    for r in (r for r in records if r.get("kind") == "checkpoint_skipped"):
        out.append(
            Finding(
                "health",
                "trainer",
                f"checkpoint of step {r.get('step', '?')} skipped",
                f"it failed verification when the trainer started: {str(r.get('reason', '?'))[:200]}",
                "the trainer resumed from an older checkpoint; check the store for damage",
            )
        )
    for r in (r for r in records if r.get("kind") in ("republish", "version_unloadable")):
        what = "could not be loaded: the run stopped" if r["kind"] == "version_unloadable" else "republished"
        out.append(
            Finding(
                "health",
                "trainer",
                f"weights v{r.get('version', '?')} {what}",
                str(r.get("reason", "its readers reported it failing its check"))[:300],
                "check the store for damage (a flipped byte, a bad disk, a proxy rewriting objects)",
            )
        )
    for r in (r for r in records if r.get("kind") == "reader_retired"):
        worker = str(r.get("reader", "?"))
        out.append(
            Finding(
                "health",
                worker.split("-")[0],
                f"{worker} was taken out of the run",
                f"it failed to load weights v{r.get('version', '?')} {r.get('failures', '?')} times in a row, "
                f"restarted with its cache cleared, though the version verifies in the store: "
                f"{str(r.get('error', ''))[:300]}",
                f"the fault is {worker}'s own (its disk, memory, network or engine): replace its pod; the other "
                "readers went on",
            )
        )
    return out


def _drops(records: list[dict[str, Any]]) -> list[Finding]:
    """More than DROP_FRAC of the samples the trainer saw dropped as too stale."""
    out: list[Finding] = []
    trained, dropped = dropped_share(records)
    if dropped > DROP_FRAC * (trained + dropped) > 0:
        out.append(
            Finding(
                "health",
                "trainer",
                "drops above 5%",
                f"{dropped} of {trained + dropped} samples dropped ({dropped / (trained + dropped):.1%})",
                "raise η or slow rollout (admission)",
            )
        )
    return out


def diagnose(
    records: list[dict[str, Any]], rows: Sequence[dict[str, Any]] = (), stall_s: float = STALL_S
) -> list[Finding]:
    """The verdict on the limiting role since RL began first (an "info" finding when there are too
    few events), then every health flag."""
    v = _verdict(role_time(records, rl_start(records)))
    if v is None:
        first = Finding("info", "", "no verdict yet", "the trainer and rollout have recorded no timing events")
    else:
        role, evidence, advice = v
        title = "the staleness bound η limits the run" if role == "eta" else f"{role} limits the run"
        first = Finding("limit", role, title, evidence, advice)
    health = [*_health(records, rows, stall_s), *routing_drift(rows), *stale_updates(rows)]
    health += reward_failures(records, rows)
    return [*crashes(records), first, *health]


def stale_updates(rows: Sequence[dict[str, Any]]) -> list[Finding]:
    """Staleness hurting the update, from the decoupled losses' metrics over the last tenth of the
    steps (at least 3): the share of policy tokens the behaviour correction masked
    (`behav_masked_frac` − `behav_nonfinite_frac`) or truncated (`behav_truncated_frac`) above
    STALE_FRAC, or the mean `kl_behav_prox` above STALE_KL."""
    last = [r for r in rows if r.get("kl_behav_prox") is not None]
    if len(last) < 3:
        return []
    last = last[-max(3, len(last) // 10) :]
    mean = lambda key: sum(float(r.get(key) or 0.0) for r in last) / len(last)  # noqa: E731
    masked = max(0.0, mean("behav_masked_frac") - mean("behav_nonfinite_frac"))
    truncated, kl = mean("behav_truncated_frac"), mean("kl_behav_prox")
    if masked + truncated <= STALE_FRAC and kl <= STALE_KL:
        return []
    behind = any("staleness_mean" in r for r in last)
    stale = f", trained {mean('staleness_mean'):.1f} versions behind" if behind else ""
    return [
        Finding(
            "health",
            "trainer",
            "staleness is hurting the update",
            f"over the last {len(last)} steps the behaviour correction masked {masked:.1%} and truncated "
            f"{truncated:.1%} of the policy tokens, KL(behav‖prox) {kl:.3g} per token{stale}",
            "the policy moves too far per version for samples this old: lower η (train.eta) or the learning "
            "rate (train.lr)",
        )
    ]


def routing_drift(rows: Sequence[dict[str, Any]]) -> list[Finding]:
    """Routing drift, not staleness, driving the importance weights of an MoE run, from the route
    metrics (train/router_replay.py) over the last tenth of the steps that logged them (at least 3):
    the behaviour gap mean |log π_prox − log π_behav| under the trainer's own routes (g_own,
    `abs_dlogp_behav_own`) and under the rollout's (g_replay), the share replay removes
    s = 1 − g_replay / g_own. When g_own > ROUTE_GAP and s ≥ ROUTE_SHARE the experts, not the policy's
    age, make the importance weights: a health finding advising algo.router_replay=rollout, or, when
    the trainer already replays (its `abs_dlogp_behav_prox` is the replayed gap), an info finding."""
    last = [r for r in rows if r.get("abs_dlogp_behav_own") is not None and r.get("abs_dlogp_behav_replay") is not None]
    if len(last) < 3:
        return []
    last = last[-max(3, len(last) // 10) :]
    mean = lambda key: sum(float(r.get(key) or 0.0) for r in last) / len(last)  # noqa: E731
    own, replay = mean("abs_dlogp_behav_own"), mean("abs_dlogp_behav_replay")
    if own <= ROUTE_GAP or 1 - replay / own < ROUTE_SHARE:
        return []
    replaying = abs(mean("abs_dlogp_behav_prox") - replay) < abs(mean("abs_dlogp_behav_prox") - own)
    evidence = (
        f"over the last {len(last)} steps the trainer's router picked the rollout's experts for "
        f"{mean('route_agreement'):.1%} of token-layers; mean |Δ log p| against the behaviour policy is {own:.3g} "
        f"under its own routes and {replay:.3g} under the rollout's (replay removes {1 - replay / own:.0%}), "
        f"importance-weight std {mean('iw_std_own'):.3g} against {mean('iw_std_replay'):.3g}"
    )
    if replaying:
        return [Finding("info", "trainer", "routing replay removes the routing drift", evidence)]
    advice = "replay the rollout's routes in the trainer: algo.router_replay=rollout (lowering η will not help)"
    return [
        Finding("health", "trainer", "routing drift, not staleness, drives the importance weights", evidence, advice)
    ]


def crashes(records: list[dict[str, Any]]) -> list[Finding]:
    """One finding per role that crashed, first: its exception and where (the role's own `crash`
    record), else its exit code and last output line (the launcher's)."""
    own = {r.get("name"): r for r in records if r.get("kind") == "crash" and "error" in r}
    out = [
        Finding(
            "health",
            str(name).split("-")[0],
            f"the run crashed: {name} failed",
            f"{r['error']} ({r.get('where')})",
            "fix the cause, then continue the run with resume_run",
        )
        for name, r in own.items()
    ]
    for r in records:
        if r.get("kind") == "crash" and "exit_code" in r and r.get("name") not in own:
            out.append(
                Finding(
                    "health",
                    str(r.get("name")).split("-")[0],
                    f"the run crashed: {r.get('name')} exited with code {r.get('exit_code')}",
                    f"its last output: {r.get('last_line') or '(none)'}",
                    "a negative code is the signal that killed it (-9: SIGKILL, often out of memory)",
                )
            )
    return out


def reward_failures(records: list[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> list[Finding]:
    """Rewards that are failed calls (the function raised, timed out or crashed): above
    REWARD_ERROR_FRAC of the trained samples, with the most frequent reason."""
    fracs = [float(r["reward_error_frac"]) for r in rows if r.get("reward_error_frac") is not None]
    if not fracs or sum(fracs) / len(fracs) <= REWARD_ERROR_FRAC:
        return []
    reasons: dict[str, int] = {}
    for r in records:
        if r.get("kind") == "sandbox":
            reasons[str(r.get("reason"))] = reasons.get(str(r.get("reason")), 0) + int(r.get("n", 1))
    top = max(reasons, key=reasons.get, default="(no reason recorded)")
    return [
        Finding(
            "health",
            "reward",
            f"{sum(fracs) / len(fracs):.0%} of rewards are errors",
            f"the reward function's calls failed (most often: {top[:200]}); those samples scored 0",
            "fix reward.function (docs/reward.md); the run trained on zeros for them",
        )
    ]
