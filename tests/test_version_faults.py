"""A version its readers cannot load never stalls a run (issue 46): the readers report it, the
trainer republishes it whole or stops the run with the reason (weights/faults.py). A reader that
alone fails a version that verifies restarts its loader once, then is retired while the run goes
on (issue 54; the whole run: tests/test_bad_reader.py)."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch
from safetensors.torch import save as st_save

from areal_core.context import load_run_config
from areal_core.events import EventLog, read_events
from areal_core.layout import LAYOUT
from areal_core.report.doctor import diagnose
from areal_core.run import pipeline
from areal_core.run.launcher import start_role
from areal_core.store import Store
from areal_core.train.run_trainer import build_run_trainer
from areal_core.train.sinks import PublishingSink
from areal_core.weights import DELTA_FILE, WEIGHTS_FILE, WeightsError
from areal_core.weights.faults import (
    MAX_REPAIRS,
    REPORT_AFTER,
    RESTART_AFTER,
    RETIRE_AFTER,
    Decision,
    RepairPolicy,
    Report,
    Reporter,
    VersionCheck,
    VersionUnloadable,
    check_readers_left,
    report_due,
    reports,
    retire,
    retired_groups,
    verify_version,
)
from areal_core.weights.publisher import WeightPublisher
from areal_core.weights.reader import load_state_dict, load_weights_bytes
from areal_core.weights.watcher import WeightWatcher
from tests.test_fault import assert_every_sample_accounted, kill_tree

WAIT, REPAIR = Decision("wait"), Decision("repair")


def flip(store: Store, version: int) -> None:
    """Flip one byte of the weights (or delta) file of `version`, leaving its manifest as it was."""
    name = DELTA_FILE if store.exists(LAYOUT.weights_file(version, DELTA_FILE)) else WEIGHTS_FILE
    blob = bytearray(store.read_bytes(LAYOUT.weights_file(version, name)))
    blob[len(blob) // 2] ^= 0xFF
    store.write_bytes(LAYOUT.weights_file(version, name), bytes(blob))


def weights(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return st_save({"w": torch.randn(16, 16, generator=g), "b": torch.randn(16, generator=g)})


def test_a_reader_reports_at_three_failures_and_each_doubling():
    assert [n for n in range(1, 100) if report_due(n)] == [3, 6, 12, 24, 48, 96]


def test_the_policy_repairs_a_failing_version_then_stops_with_the_reason():
    policy = RepairPolicy()
    failing = [Report("rollout-0", 7, REPORT_AFTER, "weights v7: model.safetensors fails its sha256 check")]
    assert policy.decide(7, [], lambda v: "bad") == WAIT
    assert policy.decide(7, [Report("rollout-0", 7, REPORT_AFTER - 1, "x")], lambda v: "bad") == WAIT
    assert policy.decide(6, failing, lambda v: "bad") == WAIT  # a version newer than the trainer's: forged
    assert policy.decide(8, failing, lambda v: None) == WAIT  # an older version's: the newest verifies
    assert policy.decide(8, failing, lambda v: "chain") == REPAIR  # a chain broken below it fails the newest too
    for _ in range(MAX_REPAIRS):
        assert policy.decide(7, failing, lambda v: "sha256 mismatch") == REPAIR
        policy.repaired(7)
    with pytest.raises(VersionUnloadable, match=r"v7 still fails its check after 2 republications.*rollout-0"):
        policy.decide(7, failing, lambda v: "sha256 mismatch")


def test_a_reader_failing_a_version_that_verifies_is_retired_and_the_run_stops_only_when_none_is_left():
    policy, verifies, readers = RepairPolicy(), lambda v: None, {"rollout-0", "rollout-1"}
    early = Report("rollout-1", 9, RETIRE_AFTER - 1, "engine")
    assert policy.decide(9, [early], verifies) == WAIT and not policy.retired
    stuck = Report("rollout-1", 9, RETIRE_AFTER, "engine")
    assert policy.decide(9, [stuck], verifies) == Decision("wait", (stuck,))  # retired, not a stop
    assert policy.retired == {"rollout-1": stuck}
    check_readers_left(readers, policy.retired)  # rollout-0 goes on
    # a retired reader's report counts no more: it is not retired twice, nor repaired for
    assert policy.decide(9, [Report("rollout-1", 9, 4 * RETIRE_AFTER, "engine")], lambda v: "bad") == WAIT
    # a version the trainer's own check fails is still repaired, whoever reports it
    assert policy.decide(9, [Report("rollout-0", 9, REPORT_AFTER, "disk")], lambda v: "bad") == REPAIR
    last = Report("rollout-0", 9, RETIRE_AFTER, "disk")
    assert policy.decide(9, [last], verifies) == Decision("wait", (last,))
    with pytest.raises(VersionUnloadable, match=r"no reader is left: rollout-0, rollout-1 retired.*v9 passes"):
        check_readers_left(readers, policy.retired)
    check_readers_left({*readers, "proxy-0"}, policy.retired)  # a reader not retired: the run goes on
    # a report at the retirement count from before this trainer started (a reader of an earlier attempt,
    # a file written once by hand) retires nothing until it grows while this trainer watches
    fresh = RepairPolicy()
    assert fresh.decide(9, [Report("rollout-2", 9, 2 * RETIRE_AFTER, "old")], verifies) == WAIT
    assert fresh.decide(9, [Report("rollout-2", 9, 2 * RETIRE_AFTER, "old")], verifies) == WAIT
    assert fresh.decide(9, [Report("rollout-2", 9, 4 * RETIRE_AFTER, "now")], verifies).retire[0].error == "now"


def test_a_reader_restarts_its_loader_once_then_stops_when_retired(tmp_path):
    store, restarts, stopped = Store(str(tmp_path)), [], []
    store.write_json(LAYOUT.reader_retired("rollout-1"), {"worker": "rollout-1", "groups": 3})  # an earlier process's
    reporter = Reporter(store, "rollout-1", restart=lambda: restarts.append(1), on_retired=lambda: stopped.append(1))
    assert retired_groups(store) == {}  # a new process starts afresh
    for n in range(1, RETIRE_AFTER + REPORT_AFTER + 1):
        reporter.failed(5, n, WeightsError("bad"))
    assert restarts == [1] and stopped == [] and reporter.retired is None  # the trainer has not retired it
    retire(store, Report("rollout-1", 5, RETIRE_AFTER, "bad"))
    for n in range(RETIRE_AFTER + REPORT_AFTER + 1, RETIRE_AFTER + 2 * REPORT_AFTER + 1):
        reporter.failed(5, n, WeightsError("bad"))
    assert stopped == [1] and reporter.retired["version"] == 5 and restarts == [1]
    assert retired_groups(store) == {}  # stopping: its groups are not final yet
    reporter.retire(4)
    assert retired_groups(store) == {"rollout-1": 4} and reports(store) == []


def test_a_restart_clears_a_corrupt_cache_of_the_reader(tmp_path):
    """A reader whose kept delta base went bad (a flipped bit in memory) fails every newer delta
    version, which verifies in the store; its restart at RESTART_AFTER drops the cache and the next
    try loads the version from the store."""
    from areal_core.rollout.worker import restart_loader
    from areal_core.weights import reader

    store = Store(str(tmp_path))
    pub = WeightPublisher(store, {}, delta=True, full_every=8)
    pub.publish(0, weights(0))
    pub.publish(1, weights(1))
    load_state_dict(store, 0)
    version, kept = reader._last_loaded[store.uri]
    reader._last_loaded[store.uri] = (version, kept[:-1] + bytes([kept[-1] ^ 1]))
    reporter = Reporter(store, "rollout-0", restart=lambda: restart_loader(store, None))
    for n in range(1, 2 * RESTART_AFTER):
        try:
            load_state_dict(store, 1)
            break
        except WeightsError as exc:
            reporter.failed(1, n, exc)
    assert n == RESTART_AFTER + 1 and reporter.restarts == 1 and verify_version(store, 1) is None


def test_a_new_reader_deletes_the_report_its_ids_earlier_process_left(tmp_path):
    store = Store(str(tmp_path))
    store.write_json(LAYOUT.weights_fault("rollout-0"), {"worker": "rollout-0", "version": 5, "failures": 24})
    Reporter(store, "rollout-0")
    assert reports(store) == []


def test_a_store_that_fails_the_report_never_fails_the_reader(tmp_path):
    class Broken(Store):
        def write_json(self, rel, obj):
            raise OSError("store down")

        def delete(self, rel, recursive=False):
            raise OSError("store down")

    reporter = Reporter(Broken(str(tmp_path)), "rollout-0")  # the start's delete fails: logged
    reporter.failed(3, REPORT_AFTER, RuntimeError("bad"))
    reporter.loaded()
    assert reporter.reported  # deleted at the next load


def test_the_check_of_a_version_is_remembered_until_its_manifest_changes(tmp_path, monkeypatch):
    from areal_core.weights import faults

    store = Store(str(tmp_path))
    pub = WeightPublisher(store, {})
    pub.publish(0, weights(0))
    flip(store, 0)
    calls = []
    real = faults.verify_version
    monkeypatch.setattr(faults, "verify_version", lambda s, v: calls.append(v) or real(s, v))
    check = VersionCheck(store)
    assert "sha256" in check(0) and "sha256" in check(0) and calls == [0]  # hashed once
    pub.republish(0, weights(0))
    assert check(0) is None and check(0) is None and calls == [0, 0]  # a new manifest: checked once more
    assert sorted(store.listdir(LAYOUT.weights_dir(0))) == sorted([LAYOUT.manifest_name, WEIGHTS_FILE])


def test_an_unreadable_latest_is_not_a_load_failure(tmp_path):
    """A proxy's source may be unreachable (a registry outage): the watcher logs it and asks again,
    it does not count it against the version it serves, nor die."""
    from areal_core.weights import WeightsError

    class Source:
        store = None
        down, polls = True, 0

        def latest_version(self):
            self.polls += 1
            if self.down:
                raise WeightsError("the registry cannot be read")
            return 1

    source, got = Source(), []
    w = WeightWatcher(source, got.append, 0.001, version=0, on_failure=lambda *a: got.append(("failed", a))).start()
    try:
        deadline = time.monotonic() + 120
        while source.polls < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.alive() and w.error is None and w.failing is None and got == []  # 20 polls of an outage
        source.down = False
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        w.stop()
    assert got == [1]


def test_forged_reports_are_ignored_and_bounded(tmp_path):
    store = Store(str(tmp_path))
    store.write_json(LAYOUT.weights_fault("a"), {"worker": "a", "version": 3, "failures": 4, "error": "e"})
    store.write_json(LAYOUT.weights_fault("b"), {"worker": "b", "version": True, "failures": 4})
    store.write_json(LAYOUT.weights_fault("c"), {"worker": "c", "version": 3, "failures": -1})
    store.write_json(LAYOUT.weights_fault("d"), [1, 2])
    store.write_bytes(LAYOUT.weights_fault("e"), b"[" * 200_000 + b"]" * 200_000)
    huge = b'{"worker": "f", "version": 3, "failures": 4, "e": "' + b"x" * 3_000_000 + b'"}'
    store.write_bytes(LAYOUT.weights_fault("f"), huge)
    assert reports(store) == [Report("a", 3, 4, "e")]


def test_verify_version_checks_the_delta_chain_and_side_files(tmp_path):
    store = Store(str(tmp_path))
    pub = WeightPublisher(store, {"config.json": b"{}"}, delta=True, full_every=8)
    for v in range(3):
        pub.publish(v, weights(v))
    assert all(verify_version(store, v) is None for v in range(3))
    flip(store, 1)  # a delta in the middle of the chain: v1 and v2 fail, v0 does not
    assert verify_version(store, 0) is None
    assert "v1" in verify_version(store, 1) and "v1" in verify_version(store, 2)
    pub.republish(2, weights(2))  # whole: no longer rebuilt through v1
    assert verify_version(store, 2) is None and store.read_json(LAYOUT.manifest(2))["weights"]["base"] is None
    pub.publish(3, weights(3))  # and the next version is a delta against the repaired one
    assert store.read_json(LAYOUT.manifest(3))["weights"]["base"] == 2 and verify_version(store, 3) is None
    store.write_bytes(LAYOUT.weights_file(3, "config.json"), b"{ }")
    assert "config.json" in verify_version(store, 3)


def test_the_watcher_logs_a_failing_version_at_doublings_reports_it_and_clears_it(tmp_path, caplog):
    store = Store(str(tmp_path))
    pub = WeightPublisher(store, {})
    pub.publish(0, weights(0))
    pub.publish(1, weights(1))
    flip(store, 1)
    reporter = Reporter(store, "rollout-0")
    loaded: list[int] = []

    def receive(v: int) -> None:
        load_weights_bytes(store, v)
        loaded.append(v)
        reporter.loaded()

    with caplog.at_level(logging.WARNING, logger="areal.weights"):
        w = WeightWatcher(store, receive, 0.001, version=0, on_failure=reporter.failed).start()
        try:
            deadline = time.monotonic() + 120
            while (w.failing is None or w.failing[1] < 64) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert w.failing is not None and w.failing[0] == 1 and w.failing[1] >= 64
            report = store.read_json(LAYOUT.weights_fault("rollout-0"))
            assert report["version"] == 1 and report["failures"] in (48, 96) and "sha256" in report["error"]
            pub.republish(1, weights(1))
            while not loaded and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            w.stop()
    assert loaded == [1] and w.failing is None
    assert not store.exists(LAYOUT.weights_fault("rollout-0"))
    lines = [r for r in caplog.records if "failed to load" in r.getMessage()]
    assert 7 <= len(lines) <= 8, len(lines)  # 1, 2, 4, ..., 64 (128 at most): not one per poll


class CorruptingStore(Store):
    """The trainer's publisher writes through this store: the weights (or delta) file of
    weights/v{version} is written damaged (one byte flipped, the manifest's checksum of the good bytes),
    `times` times (each publication of that version until then). Damaged as it is written, never
    after: a republication of a version LATEST already names is never readable intact, so a reader
    polling in between cannot load a good copy (which made the test depend on timing)."""

    def __init__(self, uri: str, version: int, times: int):
        super().__init__(uri)
        self.version, self.left = version, times
        self.targets = {LAYOUT.weights_file(version, name) for name in (WEIGHTS_FILE, DELTA_FILE)}

    def write_bytes(self, rel: str, data: bytes) -> None:
        if rel in self.targets and self.left > 0:
            self.left -= 1
            blob = bytearray(data)
            blob[len(blob) // 2] ^= 0xFF
            data = bytes(blob)
        super().write_bytes(rel, data)


def run_with_a_damaged_version(tmp_path, overrides, damaged: int, times: int):
    """An in-process trainer whose publication of `damaged` is damaged `times` times; a rollout and
    a reward worker as processes. Returns (store, cfg, the trainer's error or None)."""
    run_uri, _ = pipeline.prepare("", [*overrides, "train.eta=0", "rollout.poll_interval_s=0.05"])
    pipeline.sft(run_uri)
    store = Store(run_uri)
    cfg = load_run_config(store)

    def sink(publisher: WeightPublisher) -> PublishingSink:
        publisher.store = CorruptingStore(run_uri, damaged, times)
        return PublishingSink(publisher)

    events = EventLog(store, "trainer", "0")
    trainer = build_run_trainer(run_uri, cfg, make_sink=sink, events=events)
    log = (tmp_path / "roles.log").open("w")
    procs = [start_role(role, run_uri, 0, log_sink=log) for role in ("rollout", "reward")]
    box: dict[str, BaseException] = {}

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            box["err"] = exc

    t = threading.Thread(target=fit, daemon=True)
    t.start()
    t.join(timeout=600)  # a stall is a failure, not a hang of the suite
    for p in procs:
        kill_tree(p.proc)
    log.close()
    events.close()
    assert not t.is_alive(), f"the run stalled: {(tmp_path / 'roles.log').read_text()[-3000:]}"
    return store, cfg, box.get("err")


@pytest.mark.slow
def test_a_damaged_delta_version_is_republished_and_the_run_reaches_done(tiny_overrides, tmp_path):
    """η = 0: no group can start under an older version, so a damaged newest version stalled the
    run for ever. Now the reader reports it, the trainer republishes it whole, the run completes and
    every sample is accounted for."""
    store, cfg, err = run_with_a_damaged_version(tmp_path, [*tiny_overrides, "train.weight_delta=true"], 2, 1)
    assert err is None, err
    assert store.done()
    events = [e for e in read_events(store) if e.get("kind") == "republish"]
    assert [e["version"] for e in events] == [2]
    assert store.read_json(LAYOUT.manifest(2))["weights"]["base"] is None
    assert not store.find(LAYOUT.weights_faults_dir, ".json")  # the reader loaded it and cleared its report
    assert_every_sample_accounted(store, cfg)
    findings = [f.title for f in diagnose(read_events(store))]
    assert "weights v2 republished" in findings, findings


@pytest.mark.slow
def test_a_version_that_stays_damaged_stops_the_run_with_the_reason(tiny_overrides, tmp_path):
    store, _, err = run_with_a_damaged_version(tmp_path, tiny_overrides, 1, 1 + MAX_REPAIRS)
    assert isinstance(err, VersionUnloadable), err
    assert "weights v1 still fails its check after 2 republications" in str(err) and "rollout-0" in str(err)
    assert not store.done()
    kinds = [e.get("kind") for e in read_events(store)]
    assert kinds.count("republish") == MAX_REPAIRS and "version_unloadable" in kinds
    assert json.loads(store.read_text(LAYOUT.weights_fault("rollout-0")))["version"] == 1
    assert "weights v1 could not be loaded: the run stopped" in [f.title for f in diagnose(read_events(store))]


def test_a_proxy_following_a_runs_weights_reports_a_version_it_cannot_load(tmp_path):
    """The online loop's readers are proxies: a proxy `--follow RUN/weights` reports the damaged
    newest version under its worker id (the trainer then republishes it), and clears the report
    once it loads the repaired one."""
    from areal_core.proxy.versions import Follower, make_source

    store = Store(str(tmp_path / "run"))
    pub = WeightPublisher(store, {})
    pub.publish(0, weights(0))
    pub.publish(1, weights(1))
    flip(store, 1)

    class Engine:  # what the follower asks of an engine: its version, and receive (which verifies)
        version = 0

        def receive(self, s: Store, v: int) -> None:
            load_weights_bytes(s, v)
            self.version = v

    engine = Engine()
    follower = Follower(make_source(store.url(LAYOUT.weights_root)), engine, 0.001, worker_id="proxy-3").start()
    try:
        deadline = time.monotonic() + 120
        while not store.exists(LAYOUT.weights_fault("proxy-3")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reports(store)[0].worker == "proxy-3" and reports(store)[0].version == 1
        pub.republish(1, weights(1))
        while engine.version != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        follower.stop()
    assert engine.version == 1 and not store.exists(LAYOUT.weights_fault("proxy-3"))


def test_a_retired_proxy_stops_following_and_says_so(tmp_path):
    """A proxy following a run's weights that fails a version the trainer verifies: restarted once,
    then, once the trainer retires it, it stops following and /health's ok turns false."""
    from areal_core.proxy.versions import Follower, make_source

    store = Store(str(tmp_path / "run"))
    pub = WeightPublisher(store, {})
    pub.publish(0, weights(0))
    pub.publish(1, weights(1))

    class Engine:  # a bad pod: every load fails, though the store holds good versions
        version = 0

        def receive(self, s: Store, v: int) -> None:
            raise WeightsError(f"weights v{v}: the engine's memory is bad")

    follower = Follower(make_source(store.url(LAYOUT.weights_root)), Engine(), 0.001, worker_id="proxy-3").start()
    try:
        deadline = time.monotonic() + 120
        while not [r for r in reports(store) if r.failures >= RETIRE_AFTER] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert follower.healthy() and follower.faults.restarts == 1
        retire(store, reports(store)[0])  # what the waiting trainer does (train/sinks.py)
        while follower.watcher.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        follower.stop()
    assert not follower.healthy() and follower.describe()["retired"] and not follower.watcher.alive()
    assert retired_groups(store) == {"proxy-3": 0} and reports(store) == []
