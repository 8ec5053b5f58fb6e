"""A run root has one owner: the lease, its takeover and resume, fencing a run that lost the
root, samples deduplicated by identity (a copied shard is not trained twice), and the CLI."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time

import pytest

from areal_core.config import ConfigError, LeaseConfig, load_config
from areal_core.context import load_run_config
from areal_core.layout import LAYOUT
from areal_core.online import retrain
from areal_core.protocol import Sample, encode_identities, write_shard
from areal_core.reward.labels import read_graded
from areal_core.run import pipeline
from areal_core.run.ownership import Holder, Lease, RootInUse, claim, read_lease, renew
from areal_core.store import RootLost, Store
from tests.conftest import TINY, wait_until


def sample(worker: str, sid: str, reward: float | None = 1.0, prompt: str = "p") -> Sample:
    return Sample(
        sample_id=sid,
        group_id=f"{sid}-g",
        prompt_id=prompt,
        worker_id=worker,
        input_ids=[1, 2, 3, 4],
        prompt_len=2,
        loss_mask=[0, 0, 1, 1],
        behav_logprobs=[0.0, 0.0, -0.5, -0.5],
        versions=[-1, -1, 0, 0],
        reward=reward,
    )


def rewrite_lease(store: Store, **changes) -> None:
    lease, _ = read_lease(store)
    store.write_bytes(LAYOUT.lease, Lease(**{**vars(lease), **changes}).encode())


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue("s3_bucket") + "/runs/one"


# -- the lease ---------------------------------------------------------------------------------
def test_conditional_writes_let_one_writer_win(root):
    store = Store(root)
    assert store.write_if("x.json", b"1", None)
    assert not store.write_if("x.json", b"2", None)  # exists
    data, token = store.read_versioned("x.json")
    assert data == b"1"
    assert store.write_if("x.json", b"3", token)
    assert not store.write_if("x.json", b"4", token)  # token of a replaced version
    assert store.read_bytes("x.json") == b"3" and store.read_versioned("nope") is None


def test_a_second_run_into_a_live_root_is_refused(root):
    run_uri, _ = pipeline.prepare("", [*TINY, f"store={root}"])
    store = Store(run_uri)
    first = read_lease(store)[0].run_id
    store.write_text("trajectories/graded/rollout-0/00000000.arrow", "run 1's data")
    with pytest.raises(RootInUse) as err:
        pipeline.prepare("", [*TINY, f"store={root}", "train.steps=7"])
    text = one_line(err)
    assert first in text and "lease.takeover=true" in text
    assert read_lease(store)[0].run_id == first and load_run_config(store).train.steps == 4
    assert store.exists("trajectories/graded/rollout-0/00000000.arrow")  # nothing cleared
    with pytest.raises(RootInUse):  # a resume of a live run too: it would run twice
        pipeline.prepare("", [*TINY, f"store={root}"], resume=True)
    with pytest.raises(RootInUse):  # takeover never applies to a live lease
        pipeline.prepare("", [*TINY, f"store={root}", "lease.takeover=true"])


def test_a_stale_lease_is_taken_over_only_when_asked(root):
    run_uri, _ = pipeline.prepare("", [*TINY, f"store={root}"])
    store = Store(run_uri)
    first = read_lease(store)[0].run_id
    store.write_text("trajectories/graded/rollout-0/00000000.arrow", "run 1's data")
    rewrite_lease(store, heartbeat=time.time() - 301)  # no heartbeat for longer than lease.timeout_s
    with pytest.raises(RootInUse) as err:
        pipeline.prepare("", [*TINY, f"store={root}"])
    assert "stopped without finishing" in one_line(err) and first in str(err.value)
    assert store.exists("trajectories/graded/rollout-0/00000000.arrow")
    pipeline.prepare("", [*TINY, f"store={root}", "lease.takeover=true"])
    lease = read_lease(store)[0]
    assert lease.run_id != first and lease.status(300) == "live"
    assert not store.exists("trajectories/graded/rollout-0/00000000.arrow")  # the new run starts clean
    assert load_run_config(store).lease.takeover is False  # a one-time request, not kept


def test_a_newcomer_s_short_lease_timeout_cannot_make_a_live_run_stale(tmp_path):
    """The owner heartbeats by its own lease.timeout_s (recorded in the lease): a second run that
    sets a tiny timeout must not see a live owner as stale, to take it over or to resume it."""
    root = str(tmp_path / "run")
    run_uri, _ = pipeline.prepare("", [*TINY, f"store={root}"])
    store = Store(run_uri)
    rewrite_lease(store, host="another-host", heartbeat=time.time() - 30)  # live: 30 s < its 300 s
    assert read_lease(store)[0].timeout_s == 300.0
    short = ["lease.timeout_s=0.002", "lease.interval_s=0.001"]
    for extra, resume in ((["lease.takeover=true"], False), ([], True)):
        with pytest.raises(RootInUse, match="owned by live run.*no heartbeat for 300s"):  # the owner's timeout
            pipeline.prepare("", [*TINY, f"store={root}", *short, *extra], resume=resume)
    rewrite_lease(store, heartbeat=time.time() - 301)  # stale by the owner's own timeout
    pipeline.prepare("", [*TINY, f"store={root}", *short, "lease.takeover=true"])
    assert read_lease(store)[0].timeout_s == 0.002


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"[]",
        b'{"run_id": "x"}',
        b'{"run_id": 1, "host": "h", "pid": 1, "started": 0, "heartbeat": 0}',
        b'{"run_id": "x", "host": "h", "pid": "1", "started": 0, "heartbeat": 0}',
        b"[" * 100_000,
    ],
)
def test_a_lease_file_that_is_not_a_lease_refuses_a_claim_and_stops_a_holder(tmp_path, text):
    store = Store(str(tmp_path / "run"))
    store.write_bytes(LAYOUT.lease, text)
    with pytest.raises(RootInUse, match="is not a lease.*delete that file"):
        claim(store, LeaseConfig(), resume=False)
    with pytest.raises(RootLost, match="is not a lease"):
        renew(store, "x")
    assert store.read_bytes(LAYOUT.lease) == text  # left as evidence


def test_a_dead_owner_on_this_host_is_stale_at_once_and_resume_keeps_the_run_id(tmp_path):
    run_uri, _ = pipeline.prepare("", [*TINY, f"store={tmp_path / 'run'}"])
    store = Store(run_uri)
    first = read_lease(store)[0].run_id
    store.write_text("trajectories/graded/rollout-0/00000000.arrow", "kept")
    proc = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    proc.start()
    proc.join()
    rewrite_lease(store, pid=proc.pid)  # the owner process is gone, its heartbeat is fresh
    assert read_lease(store)[0].status(300) == "stale"
    pipeline.prepare("", [*TINY, f"store={tmp_path / 'run'}"], resume=True)
    assert read_lease(store)[0].run_id == first and read_lease(store)[0].pid == os.getpid()
    assert store.exists("trajectories/graded/rollout-0/00000000.arrow")  # a resume keeps the state


def test_a_finished_run_leaves_the_root_free_for_the_next_one(tmp_path):
    run_uri, _ = pipeline.prepare("", [*TINY, f"store={tmp_path / 'run'}"])
    store = Store(run_uri)
    first = read_lease(store)[0].run_id
    renew(store, first, "done")
    renew(store, first)  # a late renewal (the launcher's thread) does not reopen a finished run
    assert read_lease(store)[0].state == "done"
    pipeline.prepare("", [*TINY, f"store={tmp_path / 'run'}"])
    assert read_lease(store)[0].run_id != first


def _race(uri: str, barrier, results) -> None:
    store = Store(uri)
    barrier.wait()
    try:
        results.put(("won", claim(store, LeaseConfig(), resume=False)))
    except RootInUse as exc:
        results.put(("lost", str(exc)))


def test_two_racing_starts_exactly_one_wins(root):
    ctx = multiprocessing.get_context("fork")
    for attempt in range(4):
        uri = f"{root}/race-{attempt}"
        barrier, results = ctx.Barrier(3), ctx.Queue()
        procs = [ctx.Process(target=_race, args=(uri, barrier, results)) for _ in range(3)]
        for p in procs:
            p.start()
        outcome = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        winners = [value for what, value in outcome if what == "won"]
        assert len(winners) == 1, outcome
        assert read_lease(Store(uri))[0].run_id == winners[0]


# -- roles that lost the root ------------------------------------------------------------------
@pytest.fixture
def owned(root):
    run_uri, _ = pipeline.prepare("", [*TINY, f"store={root}"])
    store = Store(run_uri)
    yield store, read_lease(store)[0].run_id
    Store.fence(store.uri, None)


def wait_fenced(store: Store, holder: Holder, timeout_s: float = 120.0) -> str:  # checks every 0.1 s
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            store.exists(LAYOUT.config)
        except RootLost as exc:
            holder.stop()
            return str(exc)
        time.sleep(0.05)
    holder.stop()
    raise AssertionError("the role was not fenced out of the root")


def test_a_role_stops_when_another_run_takes_the_root_over(owned):
    store, run_id = owned
    holder = Holder(store, run_id, interval_s=0.1, renew=True).start()
    rewrite_lease(store, run_id="intruder", pid=os.getpid())
    reason = wait_fenced(store, holder)
    assert "taken over by run intruder" in reason and run_id in reason
    with pytest.raises(RootLost):  # every Store on the root, every operation
        Store(store.uri).write_text("weights/LATEST", "9")
    Store.fence(store.uri, None)
    assert read_lease(store)[0].run_id == "intruder"  # the fenced run did not write over it


@pytest.mark.parametrize("lost", ["config", "lease", "checkpoint", "everything"])
def test_a_root_that_lost_its_history_stops_the_run(owned, lost):
    store, run_id = owned
    store.write_text(LAYOUT.committed(LAYOUT.checkpoint_dir(2)), "2")
    holder = Holder(store, run_id, interval_s=0.1, renew=True, checkpoints=True).start()
    assert holder.newest_checkpoint == 2
    if lost == "config":
        store.delete(LAYOUT.config)
    elif lost == "lease":
        store.delete(LAYOUT.lease)
    elif lost == "checkpoint":
        store.delete(LAYOUT.checkpoint_dir(2), recursive=True)
    else:  # the bucket / folder wiped (and recreated): by the raw filesystem, as another actor would; the holder
        # may fence this process's Store while the wipe is under way, so the test must not delete through it
        store.fs.rm([store.path(rel) for rel in store.find("")])
    reason = wait_fenced(store, holder)
    assert (
        run_id in reason
        and {"config": "config.yaml", "lease": "wiped", "everything": "wiped"}.get(lost, "checkpoint step 2") in reason
    )


def test_a_role_of_a_root_with_no_lease_refuses_to_start(tmp_path):
    from areal_core.run.roles import run_role

    run_uri, _ = pipeline.prepare("", [*TINY, f"store={tmp_path / 'run'}"])
    Store(run_uri).delete(LAYOUT.lease)
    with pytest.raises(RootLost, match="has no LEASE.json"):
        run_role("reward", run_uri)


# -- samples deduplicated by identity ----------------------------------------------------------
def test_a_copied_graded_shard_is_not_trained_twice(tmp_path):
    """A trainer with real shards: a shard copied under a new name (before and after a
    checkpoint and restart) adds no sample to the buffer and is counted."""
    from areal_core.train.run_trainer import build_run_trainer

    run_uri, _ = pipeline.prepare("", [*TINY, f"store={tmp_path / 'run'}"])
    pipeline.sft(run_uri)
    store = Store(run_uri)
    cfg = load_run_config(store)
    shard = [sample("rollout-0", f"rollout-0-g0000000-{k}") for k in range(4)]
    write_shard(store, LAYOUT.graded_shard("rollout-0", 0), shard)
    store.write_bytes(LAYOUT.graded_shard("copy", 0), store.read_bytes(LAYOUT.graded_shard("rollout-0", 0)))
    trainer = build_run_trainer(run_uri, cfg)
    trainer.source.ingest()
    assert len(trainer.source.pending()) == 4 and trainer.state.counters.duplicate_samples == 4
    trainer.save_checkpoint()
    again = build_run_trainer(run_uri, cfg)  # restored: the identities came back with the checkpoint
    store.write_bytes(LAYOUT.graded_shard("rollout-7", 3), store.read_bytes(LAYOUT.graded_shard("rollout-0", 0)))
    write_shard(store, LAYOUT.graded_shard("rollout-0", 1), [sample("rollout-0", "rollout-0-g0000001-0")])
    again.source.ingest()
    ids = sorted(s.sample_id for s in again.source.pending())
    assert ids == sorted([s.sample_id for s in shard] + ["rollout-0-g0000001-0"])
    assert again.state.counters.duplicate_samples == 8


def test_preference_export_and_online_retraining_read_each_sample_once(tmp_path):
    store = Store(str(tmp_path / "sessions"))
    rows = [sample("proxy-0", f"s{k}", reward=float(k % 2)) for k in range(4)]
    write_shard(store, LAYOUT.graded_shard("proxy-0", 0), rows)
    store.write_bytes(LAYOUT.graded_shard("proxy-0", 5), store.read_bytes(LAYOUT.graded_shard("proxy-0", 0)))
    samples, bad = read_graded(store)
    assert sorted(s.sample_id for s in samples) == ["s0", "s1", "s2", "s3"] and bad == 0
    # an online run trained on proxy-0/0 (recorded next to the cursor); a copy of it under a later
    # sequence number is past the cursor, but its rows are not trained again
    store.write_bytes(LAYOUT.online_consumed("20250101T000000"), encode_identities([s.identity() for s in rows]))
    store.write_json(LAYOUT.online_cursor, {"workers": {"proxy-0": 0}, "runs": ["20250101T000000"]})
    store.write_bytes(LAYOUT.graded_shard("proxy-0", 6), store.read_bytes(LAYOUT.graded_shard("proxy-0", 0)))
    cfg = [*TINY, f"store={tmp_path / 'online'}"]
    run = Store(retrain.retrain_candidate("", cfg, store.uri, "policy", run_id="r2"))
    plan = run.read_json(LAYOUT.online_plan)
    assert len(plan["shards"]) == 2 and plan["rows"] == 0 and plan["trained"] is False


# -- the CLI -------------------------------------------------------------------------------------
def test_overrides_are_not_split_on_commas(tmp_path):
    root = tmp_path / "runs,with,commas"
    assert pipeline.parse_overrides(f"store={root} train.steps=3 'task.ops=+-'") == [
        f"store={root}",
        "train.steps=3",
        "task.ops=+-",
    ]
    assert pipeline.parse_overrides('name="two words, one comma"') == ["name=two words, one comma"]
    run_uri, _ = pipeline.prepare("", " ".join([*TINY, f"store={root}"]))
    assert Store(run_uri).local_path() == root and (root / "config.yaml").exists()
    with pytest.raises(ConfigError) as err:
        pipeline.parse_overrides("store='unbalanced")
    one_line(err)


def test_a_store_path_that_is_a_file_is_a_one_line_config_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    for store in (tmp_path / "afile", tmp_path / "afile" / "run"):
        with pytest.raises(ConfigError) as err:
            pipeline.prepare("", [*TINY, f"store={store}"])
        assert "config key 'store'" in one_line(err)
    assert (tmp_path / "afile").read_text() == "x"


def test_a_store_object_on_s3_is_a_one_line_config_error(s3_bucket):
    Store(s3_bucket).write_text("runs/file", "x")
    with pytest.raises(ConfigError) as err:
        pipeline.prepare("", [*TINY, f"store={s3_bucket}/runs/file"])
    assert "config key 'store'" in one_line(err)


def test_resume_on_a_store_that_never_ran_is_a_one_line_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        pipeline.prepare("", [*TINY, f"store={tmp_path / 'never'}"], resume=True)
    assert "no run was started there" in one_line(err)
    assert not (tmp_path / "never").exists()
    assert load_config(None, ["lease.takeover=true"]).lease.takeover is True


# -- whole runs ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_live_run_refuses_a_second_run_and_trains_a_copied_shard_once(tiny_overrides):
    from tests.test_pipeline import assert_contract

    overrides = [*tiny_overrides, "train.steps=6", "train.slow_step_s=0.3", "lease.interval_s=0.5"]
    run_uri, _ = pipeline.prepare("", overrides)
    init_model = pipeline.sft(run_uri)
    store = Store(run_uri)
    failures: list[BaseException] = []

    def intrude() -> None:
        try:
            # the copy first, as soon as there is a graded shard: the run has all its steps left to
            # read it (waited for, not assumed to exist once the trainer is up); then the two starts
            first = wait_until(lambda: store.find(LAYOUT.graded_dir, ".arrow"), 300, "a graded shard")[0]
            store.write_bytes(LAYOUT.graded_shard("copied", 0), store.read_bytes(first))
            with pytest.raises(RootInUse):
                pipeline.prepare("", overrides)
            with pytest.raises(RootInUse):
                pipeline.prepare("", [*overrides, "lease.takeover=true"])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    thread = threading.Thread(target=intrude)
    thread.start()
    pipeline.run_async_rl(run_uri, init_model)
    thread.join()
    assert not failures, failures
    logs = assert_contract(store, 6, 2)
    ids = [sid for entry in logs for sid, _ in entry["samples"]]
    assert len(ids) == len(set(ids)) == 6 * 2 * 4
    done = store.read_json(LAYOUT.done)
    assert done["counters"]["duplicate_samples"] >= 1
    assert read_lease(store)[0].state == "done"


@pytest.mark.slow
def test_a_run_whose_root_is_wiped_stops_instead_of_reporting_done(tiny_overrides):
    overrides = [*tiny_overrides, "train.steps=40", "train.slow_step_s=0.3", "lease.interval_s=0.5"]
    run_uri, _ = pipeline.prepare("", overrides)
    init_model = pipeline.sft(run_uri)
    store = Store(run_uri)

    def wipe() -> None:
        deadline = time.time() + 240
        while time.time() < deadline:
            try:
                if json.loads(store.read_text(LAYOUT.status("trainer", "0"))).get("step", 0) >= 2:
                    break
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.1)
        store.delete(LAYOUT.config)

    thread = threading.Thread(target=wipe)
    thread.start()
    with pytest.raises(RootLost, match="lost its config.yaml"):
        pipeline.run_async_rl(run_uri, init_model)
    thread.join()
    Store.fence(store.uri, None)
    assert not store.done()


def test_a_run_resumed_elsewhere_fences_the_old_run_that_only_looked_stale(owned):
    """A run whose heartbeat lapsed (a long store outage) but whose roles live on is resumed by
    another process: the resume keeps the run id, so only the claim token tells them apart. The
    old roles stop, and cannot mark the resumed run's lease done."""
    store, run_id = owned
    holder = Holder(store, run_id, interval_s=0.1, renew=True).start()
    old_claim = holder.claim
    holder.stop()  # the old run's heartbeat stalls ...
    rewrite_lease(store, heartbeat=time.time() - 301)
    assert claim(store, LeaseConfig(), resume=True) == run_id  # ... and another process resumes it
    new_claim = read_lease(store)[0].claim
    assert new_claim and new_claim != old_claim
    with pytest.raises(RootLost, match="resumed by another process"):
        holder.check()  # the old run's next check (its thread is back after the outage)
    with pytest.raises(RootLost):
        renew(store, run_id, "done", old_claim)
    lease = read_lease(store)[0]
    assert lease.state == "running" and lease.claim == new_claim
    resumed = Holder(store, run_id, interval_s=0.1, renew=True).start()  # the resumed run holds it
    resumed.stop()
    renew(store, run_id, "done", resumed.claim)
    assert read_lease(store)[0].state == "done"
