"""The report's charts: matplotlib figures (the object API, no pyplot: safe off the main thread,
where the Deck refresher runs) rendered to PNG bytes. Each function returns None when there is
nothing to draw."""

from __future__ import annotations

import io
from collections.abc import Callable

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from areal_core.report.series import Throughput

DPI = 80
STATE_COLOURS = {"busy": "#2e7d32"}
WAIT_COLOURS = ["#e53935", "#fb8c00", "#8e24aa", "#1e88e5", "#6d4c41", "#00897b"]


def _text(s: str) -> str:
    """A label from the run's data, shown as is (matplotlib would parse "$...$" as math)."""
    return s.replace("$", r"\$")


def _png(fig: Figure, bottom: float = 0.55) -> bytes:
    """PNG bytes of `fig`, with fixed margins in inches (tight_layout would draw every figure
    twice): 0.8 left, `bottom`, 0.35 top."""
    FigureCanvasAgg(fig)
    w, h = fig.get_size_inches()
    fig.subplots_adjust(left=0.8 / w, right=1 - 0.15 / w, top=1 - 0.35 / h, bottom=bottom / h, wspace=0.25)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _figure(ncols: int = 1, height: float = 3.2) -> tuple[Figure, list]:
    fig = Figure(figsize=(5.2 * ncols, height))
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig, axes


def learning(reward: dict, accuracy: dict, heldout: tuple[float, float] | None) -> bytes | None:
    """Reward mean and held-out accuracy against step and against wall time."""
    if not reward["step"] and not accuracy["step"]:
        return None
    fig, (by_step, by_time) = _figure(2)
    for ax, x, y in ((by_step, "step", "value"), (by_time, "t", "t_value")):
        ax.plot(reward[x], reward[y], color="#1e88e5", label="reward mean")
        if accuracy[x]:
            ax.plot(accuracy[x], accuracy[y], "o-", color="#e53935", label="held-out accuracy")
        ax.set(xlabel="step" if x == "step" else "wall time (s)")
        ax.legend(loc="best", fontsize=8)
    if heldout is not None and reward["step"]:
        by_step.plot([0, reward["step"][-1]], list(heldout), "s--", color="#8e24aa", label="held-out before/after")
        by_step.legend(loc="best", fontsize=8)
    by_step.set_title("reward and held-out accuracy per step")
    by_time.set_title("... against wall time")
    return _png(fig)


def timeline(lanes: dict[str, dict[str, list[tuple]]]) -> bytes | None:
    """One lane per role worker: busy in green, waits coloured by what they waited on."""
    if not lanes:
        return None
    waits = sorted({k for lane in lanes.values() for k in lane if k != "busy"})
    colours = {**STATE_COLOURS, **{w: WAIT_COLOURS[i % len(WAIT_COLOURS)] for i, w in enumerate(waits)}}
    fig = Figure(figsize=(10.4, 1.6 + 0.4 * len(lanes)))
    ax = fig.add_subplot(1, 1, 1)
    names = list(lanes)
    for i, name in enumerate(names):
        for label, bars in lanes[name].items():
            ax.broken_barh(bars, (i - 0.35, 0.7), facecolors=colours[label], linewidth=0)
    ax.set_yticks(range(len(names)), [_text(n) for n in names])
    ax.invert_yaxis()
    ax.set(xlabel="wall time (s)", title="role timeline: busy, and what each role waited on")
    for label, colour in colours.items():
        ax.bar(0, 0, color=colour, label=_text(label.replace("wait:", "wait on ").replace("background:", "helper: ")))
    fig.legend(loc="lower center", ncol=6, fontsize=8, frameon=False)
    return _png(fig, bottom=0.85)


def staleness(hist: dict[int, int], trend: list[tuple[int, float]], eta: int | None) -> bytes | None:
    if not hist:
        return None
    fig, (h, tr) = _figure(2)
    h.bar(list(hist), list(hist.values()), color="#1e88e5")
    h.set(title="staleness of trained tokens", xlabel="trainer version − token version", ylabel="tokens")
    h.set_xticks(list(hist))
    tr.plot([s for s, _ in trend], [m for _, m in trend], color="#fb8c00", label="mean staleness")
    if eta is not None:
        tr.axhline(eta, color="#e53935", ls="--", label=f"η = {eta}")
    tr.set(title="staleness trend", xlabel="step")
    tr.legend(loc="best", fontsize=8)
    return _png(fig)


def backlog(series: dict[str, list[float]]) -> bytes | None:
    if not series["t"]:
        return None
    fig, (ax,) = _figure(1)
    ax.step(series["t"], series["ungraded"], where="post", label="ungraded shards", color="#e53935")
    ax.step(series["t"], series["graded"], where="post", label="graded, not yet read", color="#2e7d32")
    ax.set(title="backlog", xlabel="wall time (s)", ylabel="shards")
    ax.legend(loc="best", fontsize=8)
    return _png(fig)


def publish_lag(lags: dict[str, list[tuple[int, float]]]) -> bytes | None:
    if not lags:
        return None
    fig, (ax,) = _figure(1)
    for worker, pts in lags.items():
        ax.plot([v for v, _ in pts], [lag for _, lag in pts], ".-", label=_text(worker))
    ax.set(title="weight publication lag (publish start → loaded)", xlabel="version", ylabel="seconds")
    ax.legend(loc="best", fontsize=8)
    return _png(fig)


def throughput(tp: Throughput) -> bytes | None:
    keys = sorted({k for role in tp.binned.values() for k in role})
    if not keys:
        return None
    fig, axes = _figure(len(keys))
    for ax, key in zip(axes, keys):
        for role, series in sorted(tp.binned.items()):
            if key in series:
                ax.plot(*series[key], ".-", label=_text(role))
        ax.set(title=_text(f"{key} per second"), xlabel="wall time (s)")
        ax.legend(loc="best", fontsize=8)
    return _png(fig)


def reasons(counts: dict[str, dict[str, int]]) -> bytes | None:
    items = [(f"{kind}: {reason}", n) for kind, rs in counts.items() for reason, n in rs.items()]
    if not items:
        return None
    items = sorted(items, key=lambda x: x[1])[-15:]
    fig = Figure(figsize=(10.4, 1.6 + 0.3 * len(items)))
    ax = fig.add_subplot(1, 1, 1)
    ax.barh([_text(label[:70]) for label, _ in items], [n for _, n in items], color="#e53935")
    ax.set(title="drops, quarantines and sandbox failures by reason", xlabel="count")
    return _png(fig)


def mismatch(series: dict[str, list[float]]) -> bytes | None:
    if not series["step"]:
        return None
    fig, (kl, iw) = _figure(2)
    kl.plot(series["step"], series["kl_behav_prox"], color="#8e24aa", label="KL(behaviour ‖ proximal)")
    if "abs_dlogp_behav_prox" in series:  # the engine/trainer log-prob gap (rollout.dtype, kernels) + staleness
        kl.plot(series["step"], series["abs_dlogp_behav_prox"], color="#fb8c00", label="mean |Δ log p|")
    kl.set(title="behaviour vs proximal policy", xlabel="step")
    kl.legend(loc="best", fontsize=8)
    iw.fill_between(
        series["step"],
        series["importance_weight_min"],
        series["importance_weight_max"],
        color="#1e88e5",
        alpha=0.3,
        label="min..max",
    )
    iw.plot(series["step"], series["importance_weight_mean"], color="#1e88e5", label="mean")
    iw.set(title="importance weight π_prox/π_behav", xlabel="step")
    iw.legend(loc="best", fontsize=8)
    return _png(fig)


Chart = Callable[..., bytes | None]
