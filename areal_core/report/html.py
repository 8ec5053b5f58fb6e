"""The report as one self-contained HTML page: the doctor's verdict at the top, then every chart
as an inline PNG (data: URI), the first held-out questions answered before and after RL (a VLM's
with its picture, inline too: report/answers.py), no script, no external font or stylesheet: it
opens offline, in a browser, a Flyte Deck or MLflow's artifact view."""

from __future__ import annotations

import base64
import datetime
import html
import time
from typing import Any

from areal_core.report import answers, plots, series
from areal_core.report.data import RunData, load_run
from areal_core.report.doctor import Finding, diagnose, rl_start
from areal_core.report.timing import role_time
from areal_core.store import Store

# scoped to the report's own <div>: inside a Deck the page sits in flytekit's template
STYLE = """
.areal-report{font-family:sans-serif;margin:1.2em;color:#222;max-width:1100px}
.areal-report h1{font-size:1.4em;margin-bottom:.2em} .areal-report h2{font-size:1.1em;margin-top:1.4em}
.areal-report .verdict{border-left:6px solid #1e88e5;background:#f1f6fd;padding:.6em 1em;margin:1em 0}
.areal-report .limit b{color:#0d47a1} .areal-report .health{border-left-color:#e53935;background:#fdf1f1}
.areal-report table{border-collapse:collapse;font-size:.9em}
.areal-report td,.areal-report th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
.areal-report th{background:#f5f5f5} .areal-report td:first-child,.areal-report th:first-child{text-align:left}
.areal-report figure{margin:.6em 0} .areal-report img{max-width:100%}
.areal-report .empty{color:#777;font-style:italic} .areal-report .meta{color:#666;font-size:.85em}
.areal-report table.answers td,.areal-report table.answers th{text-align:left;vertical-align:top}
.areal-report .txt{white-space:pre-wrap}
.areal-report td.right{background:#edf7ed} .areal-report td.wrong{background:#fbeeee}
.areal-report img.scene{width:128px;image-rendering:pixelated}
"""


def _img(png: bytes | None, alt: str, empty: str) -> str:
    if png is None:
        return f'<p class="empty">{html.escape(empty)}</p>'
    data = base64.b64encode(png).decode()
    return f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"/></figure>'


def _shares(fractions: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0%}" for k, v in fractions.items())


def _table(head: list[str], rows: list[list[Any]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table>{f'<tr>{th}</tr>' if any(head) else ''}{body}</table>"


def _findings(findings: list[Finding]) -> str:
    out = []
    for f in findings:
        cls = "verdict limit" if f.kind == "limit" else "verdict health" if f.kind == "health" else "verdict"
        advice = f"<br/>→ {html.escape(f.advice)}" if f.advice else ""
        out.append(f'<div class="{cls}"><b>{html.escape(f.title)}</b>: {html.escape(f.evidence)}{advice}</div>')
    return "".join(out)


def render(data: RunData, heldout: tuple[float, float] | None = None) -> str:
    """The report of `data` as one <div> with its own scoped style, to stand alone (`page`) or sit
    inside another page (a Deck). `heldout` (before, after) adds the held-out scores."""
    recs, rows = data.records, data.rows
    t0 = series.run_start(recs)
    times = series.step_times(recs)
    findings = diagnose(recs, rows)
    tot = series.totals(recs, rows, data.audits)
    train = data.config.get("train")
    eta = train.get("eta") if isinstance(train, dict) else None
    hist, trend = series.staleness(recs, data.audits)
    tp = series.throughput(recs, t0)
    wall = max(tot.wall_s, 1e-9)
    state = "finished (DONE)" if data.done else "running, or stopped before DONE"
    summary = [
        ["steps trained", tot.steps],
        ["samples trained", tot.trained_samples],
        ["samples dropped (stale)", tot.dropped_samples],
        ["samples dropped (abandoned version)", tot.abandoned_samples],
        ["wall time of the events (s)", f"{tot.wall_s:.1f}"],
    ]
    summary += [["rollout engine", line] for line in series.engine_choices(recs)]
    if heldout is not None:
        summary.append(["held-out accuracy before → after RL", f"{heldout[0]:.3f} → {heldout[1]:.3f}"])
    roles = [
        [r.role, r.workers, f"{r.busy:.0%}", f"{r.wait:.0%}", _shares(r.wait_on), _shares(r.background_on)]
        for r in role_time(recs, rl_start(recs)).values()
    ]
    rates = [
        [role, k, n, f"{tp.rates[role][k]:.2f}", f"{n / wall:.2f}"]
        for role, keys in sorted(tp.totals.items())
        for k, n in sorted(keys.items())
    ]
    lanes = series.timeline(recs, t0, resolution_s=wall / 1500)
    reward = series.metric_series(rows, "reward_mean", times, t0)
    accuracy = series.metric_series(rows, "eval_accuracy", times, t0)
    stamp = datetime.datetime.fromtimestamp(time.time(), datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    parts = [
        f'<div class="areal-report"><style>{STYLE}</style>',
        f"<h1>Run report</h1><p class='meta'>{html.escape(data.uri)} · {state} · built {stamp}</p>",
        _findings(findings),
        "<h2>Summary</h2>",
        _table(["", ""], summary),
        "<h2>Learning</h2>",
        _img(plots.learning(reward, accuracy, heldout), "learning", "no trained step yet"),
        "<h2>Held-out answers before and after RL</h2>",
        answers.section(data.answers),
        "<h2>Where the time went</h2>",
        _table(["role", "workers", "busy", "waiting", "waiting on", "helper threads (beside both)"], roles)
        if roles
        else "",
        _img(plots.timeline(lanes), "timeline", "no timing events yet"),
        "<h2>Staleness</h2>",
        _img(plots.staleness(hist, trend, eta), "staleness", "no trained samples yet"),
        "<h2>Backlog</h2>",
        _img(plots.backlog(series.backlog(recs, t0)), "backlog", "no backlog records yet"),
        "<h2>Weight publication lag</h2>",
        _img(plots.publish_lag(series.publish_lag(recs)), "publish-lag", "no weight loads recorded yet"),
        "<h2>Throughput</h2>",
        _table(["role", "what", "total", "per s (role active)", "per s (run)"], rates) if rates else "",
        _img(plots.throughput(tp), "throughput", "no work counted yet"),
        "<h2>Drops, quarantines, sandbox failures</h2>",
        _img(plots.reasons(series.reasons(recs)), "reasons", "none recorded"),
        "<h2>Behaviour / proximal mismatch</h2>",
        _img(plots.mismatch(series.mismatch(rows)), "mismatch", "no trained step yet"),
        "</div>",
    ]
    return "\n".join(parts)


def page(report: str) -> str:
    """A `render`ed report as a whole HTML document."""
    head = "<!DOCTYPE html><html><head><meta charset='utf-8'><title>run report</title></head><body>"
    return f"{head}\n{report}\n</body></html>"


def build_report(run_uri: str, heldout: tuple[float, float] | None = None) -> str:
    """The report of the run at `run_uri` (`render`: a <div>; NotARun when it holds no run)."""
    return render(load_run(Store(run_uri)), heldout)
