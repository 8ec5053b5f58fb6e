"""The run report: series from events, the bottleneck doctor, the HTML page in a real browser,
the Deck and MLflow."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from areal_core.context import load_run_config
from areal_core.layout import LAYOUT
from areal_core.procs import kill_group
from areal_core.report import series
from areal_core.report.data import load_run
from areal_core.report.doctor import diagnose, dropped_share, limiting_role, stalled_workers
from areal_core.report.html import build_report, page
from areal_core.run import pipeline
from areal_core.run.launcher import launch, start_role, stop_all
from areal_core.run.tracking import Tracker
from areal_core.store import Store
from tests.conftest import ROOT, TINY, free_port, wait_until


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
    drops = [{"t": 1001.0, "kind": "trained", "step": 0, "samples": 0, "dropped": 6, "role": "trainer", "worker": "0"}]
    trained = [{"t": 1002.0, "kind": "trained", "step": 1, "samples": 94, "role": "trainer", "worker": "0"}]
    titles = [f.title for f in diagnose(ROLLOUT_BOUND + drops + trained, rows)[1:]]
    assert titles == ["reward collapse", "exploding importance weight", "drops above 5%"]
    healthy = [{"step": s, "reward_mean": 0.5, "importance_weight_max": 1.5} for s in range(1, 21)]
    few = [drops[0] | {"dropped": 4}]  # 4 of 98: under 5%
    assert diagnose(ROLLOUT_BOUND + few + trained, healthy)[1:] == []


# -- a real short run: its report against the trainer's own numbers, MLflow, the live Deck ------


def _prepared(root: Path, *extra: str, mlflow_uri: str = "") -> tuple[str, str]:
    overrides = [o for o in TINY if not o.startswith("tracking.")] + [f"store={root}", *extra]
    overrides += [f"tracking.enabled={'true' if mlflow_uri else 'false'}", f"tracking.uri={mlflow_uri}"]
    run_uri, _ = pipeline.prepare("", overrides)
    return run_uri, pipeline.sft(run_uri)


@pytest.fixture(scope="module")
def dropping_run(tmp_path_factory, mlflow_server) -> dict:
    """η = 1, admission off and slow training (tests/test_pipeline.py's hard-bound run): the
    trainer drops stale samples. Tracked in MLflow; the live report published every second."""
    root = tmp_path_factory.mktemp("report") / "run"
    run_uri, checkpoint = _prepared(
        root,
        "train.eta=1",
        "rollout.admission=false",
        "train.slow_step_s=0.5",
        "train.steps=6",
        "launcher.report_every_s=1",
        mlflow_uri=mlflow_server,
    )
    published: list[str] = []
    pipeline.run_async_rl(run_uri, checkpoint, publish=published.append)
    return {"uri": run_uri, "root": root, "published": published}


def trained_log(store: Store) -> list[dict]:
    return [store.read_json(p) for p in store.find(LAYOUT.trained_dir, ".json")]


@pytest.mark.slow
def test_report_numbers_agree_exactly_with_the_trainers_own(dropping_run):
    store = Store(dropping_run["uri"])
    data = load_run(store)
    assert any(r["kind"] == "trained" for r in data.records), "the roles recorded no events"
    tot = series.totals(data.records, data.rows, [])
    audits = trained_log(store)
    status = store.read_json(LAYOUT.status("trainer", "0"))
    assert tot.steps == len(audits) == len(data.rows) == data.rows[-1]["step"] == 6
    assert tot.trained_samples == sum(len(a["samples"]) for a in audits) == 6 * 2 * 4
    assert tot.dropped_samples == sum(len(a["dropped"]) for a in audits) == data.rows[-1]["dropped_samples"]
    assert tot.dropped_samples == status["dropped_samples"] > 0
    hist = Counter()
    for a in audits:
        hist.update({int(k): v for k, v in a["staleness_histogram"].items()})
    assert tot.staleness == dict(hist)
    trend = dict(series.staleness(data.records, [])[1])
    assert [trend[r["step"]] for r in data.rows] == pytest.approx([r["staleness_mean"] for r in data.rows], abs=1e-3)
    page = build_report(dropping_run["uri"])
    assert f"<td>steps trained</td><td>{tot.steps}</td>" in page
    assert f"<td>samples dropped (stale)</td><td>{tot.dropped_samples}</td>" in page


@pytest.mark.slow
def test_the_live_report_was_published_during_the_run_and_final_at_its_end(dropping_run):
    published = dropping_run["published"]
    assert len(published) >= 2  # at least one refresh while the roles ran, and the final one
    assert all(p.startswith('<div class="areal-report">') for p in published)
    assert "limits the run" in published[-1]


@pytest.mark.slow
def test_mlflow_holds_the_report_and_its_series(dropping_run, mlflow_server):
    import mlflow

    store = Store(dropping_run["uri"])
    run_id = Tracker.attach(store).run_id
    client = mlflow.MlflowClient(mlflow_server)
    assert [a.path for a in client.list_artifacts(run_id, "report")] == ["report/report.html"]
    local = client.download_artifacts(run_id, "report/report.html", str(dropping_run["root"].parent))
    html = Path(local).read_text()
    assert html.startswith("<!DOCTYPE html>") and "limits the run" in html
    data = load_run(store)
    expected = series.step_metrics(data.records, data.rows)
    logged = {m.step: m.value for m in client.get_metric_history(run_id, "report/staleness_mean")}
    assert logged == pytest.approx({s: m["staleness_mean"] for s, m in expected.items() if "staleness_mean" in m})
    assert len(logged) == 6
    waits = client.get_metric_history(run_id, "report/trainer_wait_frac")
    assert len(waits) == 6 and all(0 <= m.value <= 1 for m in waits)


@pytest.mark.slow
def test_the_command_line_on_a_local_and_an_s3_root_and_on_a_root_that_is_no_run(dropping_run, tmp_path, s3_bucket):
    out = tmp_path / "r.html"
    done = cli(dropping_run["uri"], "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "limits the run" in done.stdout and out.read_text().count("data:image/png;base64,") >= 7
    s3 = Store(f"{s3_bucket}/runs/copied")
    for rel in (LAYOUT.events_dir, LAYOUT.trainer_dir):
        s3.put_dir(dropping_run["root"] / rel, rel)
    s3.write_text(LAYOUT.config, (dropping_run["root"] / LAYOUT.config).read_text())
    remote = cli(s3.uri, "-o", str(tmp_path / "s3.html"))
    assert remote.returncode == 0, remote.stderr
    assert (tmp_path / "s3.html").read_text().count("data:image/png;base64,") == out.read_text().count(
        "data:image/png;base64,"
    )
    for bad in (str(tmp_path), f"{s3_bucket}/nothing-here"):
        refused = cli(bad, "-o", str(tmp_path / "x.html"))
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert "is not a run root" in refused.stderr
    assert not (tmp_path / "x.html").exists()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "areal_core.report", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


# -- a real browser: every chart drawn, no network request ------------------------------------


CHROMIUM = "/usr/bin/chromium"


def open_in_chromium(path: Path, shot: Path, tab: str = "") -> tuple[list[str], list[dict]]:
    """Open `path` in headless Chromium (and click the Deck tab `tab`); returns (every URL it
    requested, each visible <img>'s natural and rendered size and the standard deviation of its
    pixels in a screenshot)."""
    from PIL import Image, ImageStat
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto(path.as_uri(), wait_until="networkidle")
        if tab:
            page.click(f"li:text-is('{tab}')")
        images = []
        for i, img in enumerate(page.query_selector_all(".areal-report img")):
            img.scroll_into_view_if_needed()
            size = img.evaluate("i => [i.naturalWidth, i.naturalHeight, i.width, i.height, i.complete]")
            crop = shot.with_name(f"{shot.stem}-{i}.png")
            img.screenshot(path=str(crop))
            with Image.open(crop) as im:
                spread = max(ImageStat.Stat(im.convert("L")).stddev)
            images.append({"alt": img.get_attribute("alt"), "size": size, "spread": spread})
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    return requests, images


def assert_drawn(images: list[dict], alts: set[str]) -> None:
    assert {i["alt"] for i in images} == alts
    for img in images:
        natural_w, natural_h, w, h, complete = img["size"]
        assert complete and natural_w > 100 and natural_h > 60 and w > 100 and h > 60, img
        assert img["spread"] > 10, f"{img['alt']} is blank"


ALL_CHARTS = {"learning", "timeline", "staleness", "backlog", "publish-lag", "throughput", "reasons", "mismatch"}


@pytest.mark.slow
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")
def test_a_real_browser_draws_every_chart_and_requests_nothing(dropping_run, tmp_path):
    report = tmp_path / "report.html"
    report.write_text(page(build_report(dropping_run["uri"])))
    requests, images = open_in_chromium(report, tmp_path / "shot.png")
    assert requests == [report.as_uri()]
    assert_drawn(images, ALL_CHARTS)
    # the check can fail: a page with one remote image is caught
    leaky = tmp_path / "leaky.html"
    port = free_port()
    leaky.write_text(report.read_text().replace("</body>", f'<img src="http://127.0.0.1:{port}/x.png"></body>'))
    requests, _ = open_in_chromium(leaky, tmp_path / "leaky.png")
    assert f"http://127.0.0.1:{port}/x.png" in requests


@pytest.mark.slow
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")
def test_the_deck_shows_the_report_drawn_and_only_flytekits_own_font_is_requested(dropping_run, tmp_path):
    """The task's Deck (flytekit writes deck.html in its local sandbox): the report's charts are
    drawn and the report asks for nothing; flytekit's own Deck template links one web font
    stylesheet, the only request besides the file."""
    import flytekit
    from flytekit import task

    from tasks.pipeline import publish_report

    @task(enable_deck=True)
    def show(run_uri: str) -> None:
        publish_report(build_report(run_uri))

    sandbox = Path(flytekit.FlyteContextManager.current_context().file_access.local_sandbox_dir)
    before = set(sandbox.rglob("deck.html"))
    show(run_uri=dropping_run["uri"])
    decks = sorted(set(sandbox.rglob("deck.html")) - before, key=lambda p: p.stat().st_mtime)
    assert decks, "flytekit wrote no deck.html"
    deck = decks[-1]
    assert deck.read_text().count('<div class="areal-report">') == 1  # replaced, not appended
    requests, images = open_in_chromium(deck, tmp_path / "deck.png", tab="report")
    template = (Path(flytekit.__file__).parent / "deck" / "html" / "template.html").read_text()
    assert requests[0] == deck.as_uri()
    assert all(url.replace("%7C", "|") in template.replace("%7C", "|") for url in requests[1:]), requests
    assert_drawn(images, ALL_CHARTS)


# -- the doctor on real runs: a slow side, a killed worker --------------------------------------


def run_roles(run_uri: str) -> dict:
    cfg = load_run_config(Store(run_uri))
    return launch(run_uri, cfg.rollout.num_workers, cfg.reward.num_workers, timeout_s=600, progress=False)


@pytest.mark.slow
def test_a_killed_rollout_worker_is_named_stalled_while_the_run_goes_on(tmp_path):
    """Two rollout workers, one SIGKILLed (a lost pod: nothing restarts it here); the report of
    the still-running root names it."""
    run_uri, _ = _prepared(tmp_path / "run", "rollout.num_workers=2", "train.steps=200")
    store = Store(run_uri)
    procs = [start_role("trainer", run_uri), start_role("reward", run_uri)]
    procs += [start_role("rollout", run_uri, i) for i in range(2)]
    try:
        deadline = time.time() + 300
        while not store.find(f"{LAYOUT.events_dir}/rollout-1", ".jsonl") or not store.exists(LAYOUT.metrics):
            assert time.time() < deadline and all(p.proc.poll() is None for p in procs)
            time.sleep(0.5)
        kill_group(procs[3].proc.pid, signal.SIGKILL)
        killed_at = time.time()

        def stalled_now() -> list | None:  # the others go on recording until it is 5 s behind them
            assert all(p.proc.poll() is None for p in procs[:3])
            records = load_run(store).records
            return records if [name for name, _ in stalled_workers(records, stall_s=5)] == ["rollout-1"] else None

        records = wait_until(stalled_now, 300, "rollout-1, and only it, named stalled", poll_s=0.5)
        assert all(p.proc.poll() is None for p in procs[:3])
    finally:
        stop_all(procs)
    last = max(r["t"] for r in records if r["role"] == "rollout" and r["worker"] == "1")
    assert last <= killed_at
    flags = [f for f in diagnose(records, stall_s=5) if f.kind == "health"]
    assert flags and flags[0].title == "stalled worker rollout-1"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "role"),
    [
        # long generations one group at a time, and η high enough that admission never blocks
        (["rollout.max_new_tokens=64", "rollout.max_batch_groups=1", "train.eta=10", "train.steps=10"], "rollout"),
        # a trainer that sleeps a second a step (train.slow_step_s, the config's own knob)
        (["train.slow_step_s=1", "train.steps=6"], "trainer"),
    ],
)
def test_the_doctor_names_the_slow_side_of_a_real_run(tmp_path, overrides, role):
    run_uri, _ = _prepared(tmp_path / "run", *overrides)
    run_roles(run_uri)
    data = load_run(Store(run_uri))
    assert limiting_role(data.records) == role
    verdict = diagnose(data.records, data.rows)[0]
    assert (verdict.kind, verdict.role) == ("limit", role)


def test_hostile_names_and_reasons_are_shown_as_text(tmp_path):
    """A worker folder and failure reasons holding markup and matplotlib math: the page escapes
    them and the charts draw them as plain text."""
    from areal_core.events import EventLog

    store = Store(str(tmp_path / "run"))
    store.write_text(LAYOUT.config, "name: hostile\n")
    ev = EventLog(store, "rollout", "<b>x", flush_every_s=0)
    ev.emit("span", state="busy", on="generate $x^{", t0=time.time() - 1, t1=time.time())
    ev.emit("quarantine", path="a", reason="<script>alert(1)</script> $\\frac{")
    ev.emit("sandbox", reason="$$ unbalanced {")
    ev.emit("drop", reason="</table>", n=3)
    ev.close()
    html = build_report(store.uri)
    assert "<script" not in html and "alert(1)" not in html  # reasons are drawn in a chart, not written
    assert html.count("data:image/png;base64,") == 2  # the timeline and the reasons, drawn
    page_file = tmp_path / "report.html"
    page_file.write_text(page(html))
    assert cli(str(tmp_path / "run"), "-o", str(page_file)).returncode == 0


def test_a_restarted_trainer_repeating_a_step_is_counted_once_by_its_last_record():
    """A trainer resumed from a checkpoint trains the steps after it again and writes a second
    `trained` record for each: the report and the doctor count the last one only (events.py)."""
    first = {"kind": "trained", "role": "trainer", "worker": "0", "abandoned": 0}
    records = [
        first | {"t": 1001.0, "step": 0, "samples": 8, "staleness": {"0": 10}, "dropped": 1},
        first | {"t": 1002.0, "step": 1, "samples": 8, "staleness": {"1": 10}, "dropped": 0},  # lost attempt
        first | {"t": 1010.0, "step": 1, "samples": 6, "staleness": {"0": 4, "2": 4}, "dropped": 2},  # resumed
    ]
    tot = series.totals(records, [], [])
    assert (tot.steps, tot.trained_samples, tot.dropped_samples) == (2, 14, 3)
    assert tot.staleness == {0: 14, 2: 4}
    assert series.staleness(records, [])[1] == [(1, 0.0), (2, 1.0)]
    assert dropped_share(records) == (14, 3)


def test_a_hand_edited_root_gets_a_report_or_a_one_line_error_never_a_trace(tmp_path):
    """A config whose `train` is no mapping, a metrics file with a non-integer step and a null
    reward: the report is built from what makes sense; nothing prints a traceback."""
    store = Store(str(tmp_path / "run"))
    store.write_text(LAYOUT.config, "train: 3\n")
    store.write_text(
        LAYOUT.metrics, '{"step": 1, "reward_mean": null}\n{"step": "x"}\n{"step": 2, "reward_mean": 0.5}\n'
    )
    done = cli(store.uri, "-o", str(tmp_path / "r.html"))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert [r["step"] for r in load_run(store).rows] == [1, 2]


def test_stale_drops_of_a_step_a_resumed_trainer_repeats_are_counted_once():
    """The drop-reason chart's stale and abandoned counts are the trainer's audit, as the summary's:
    a step trained again after a resume counts by its last `trained` record; drops not yet in an
    audit (the step in progress, or a lost attempt's) are not counted."""
    tr = {"role": "trainer", "worker": "0", "abandoned": 0, "samples": 8}
    drop = {"kind": "drop", "role": "trainer", "worker": "0", "reason": "stale"}
    records = [
        drop | {"t": 1.0, "n": 2},
        tr | {"t": 2.0, "kind": "trained", "step": 0, "dropped": 2},
        drop | {"t": 3.0, "n": 3},
        tr | {"t": 4.0, "kind": "trained", "step": 1, "dropped": 3},  # lost: resumed from step 0
        drop | {"t": 5.0, "n": 5},  # the lost attempt's step in progress
        drop | {"t": 10.0, "n": 1},
        tr | {"t": 11.0, "kind": "trained", "step": 1, "dropped": 1, "abandoned": 2},
        drop | {"t": 12.0, "n": 4},  # the step in progress now
        {"t": 12.5, "kind": "drop", "role": "rollout", "worker": "0", "reason": "engine_failed", "n": 1},
    ]
    got = series.reasons(records)["drop"]
    assert got == {"stale": 2 + 1, "abandoned_version": 2, "engine_failed": 1}
    no_step_yet = [r for r in records if r["t"] < 2.0]
    assert series.reasons(no_step_yet)["drop"] == {"stale": 2}
    assert series.totals(records, [], []).dropped_samples == 3


def test_the_downtime_between_a_crash_and_a_resumed_attempt_counts_as_no_ones_time():
    """A run that stopped for 15 min and resumed (a retried task): each worker's fractions are of
    the time it was up, so the trainer that waited 75% of it is not diluted into a bottleneck."""
    retried = [r | {"t": r["t"] + 900, "t0": r["t0"] + 900, "t1": r["t1"] + 900} for r in ROLLOUT_BOUND]
    records = ROLLOUT_BOUND + retried
    assert limiting_role(records) == "rollout"
    assert "waited for batches 75%" in diagnose(records)[0].line()


def test_a_version_published_again_after_a_resume_lags_from_the_publish_each_load_saw():
    """A resumed trainer publishes its checkpoint's version again: a worker's load of the first
    publish is measured from that first publish, never from the later one (a negative lag)."""
    pub = {"kind": "publish", "role": "trainer", "worker": "0", "version": 5, "bytes": 1}
    load = {"kind": "load", "role": "rollout", "worker": "0", "version": 5, "seconds": 0.1}
    records = [
        pub | {"t": 100.0, "seconds": 1.0},
        load | {"t": 101.5},
        pub | {"t": 500.0, "seconds": 2.0},
        load | {"t": 503.0},
    ]
    assert series.publish_lag(records) == {"rollout-0": [(5, 2.5), (5, 5.0)]}
    assert series.step_metrics(records, [])[5]["publish_lag_s"] == 3.75


def test_throughput_per_active_second_leaves_out_the_downtime_before_a_resumed_attempt():
    """100 completions in 10 s, a 15-min stop, 100 more in 10 s: 10 per active second."""
    base = {"kind": "count", "role": "rollout", "worker": "0", "completions": 10}
    records = [base | {"t": 1000.0 + t} for t in range(0, 11)]
    records += [base | {"t": 1910.0 + t} for t in range(0, 11)]
    tp = series.throughput(records, 1000.0)
    assert tp.totals["rollout"]["completions"] == 220
    assert tp.rates["rollout"]["completions"] == pytest.approx(220 / 20)
