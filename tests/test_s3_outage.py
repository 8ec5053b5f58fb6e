"""A short S3 outage does not kill the run: S3 refuses connections for 10 s at a random point
of a run (a TCP forwarder in front of moto stops listening and cuts its connections; moto keeps
its state). Every run reaches DONE with no sample lost or trained twice, the outage is counted
as store retries, and no process is left behind."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from areal_core.context import load_run_config
from areal_core.layout import LAYOUT
from areal_core.procs import descendants
from areal_core.run import pipeline
from areal_core.run.launcher import launch
from areal_core.store import Store
from tests.conftest import TINY
from tests.test_fault import assert_every_sample_accounted, samples_in
from tests.test_store_retry import alive

OUTAGE_S = 10.0
STEPS = 40  # long enough (~10 s on 2 quiet cores) that the outage lands before DONE


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.parametrize("seed", [1, 3])  # two random points (~55 s each on 2 cores); more seeds: benchmarks
def test_a_10s_s3_outage_at_a_random_point_loses_no_sample(seed, s3_bucket, s3_forwarder, monkeypatch):
    rng = random.Random(seed)
    overrides = [
        *TINY,
        f"store={s3_bucket}/runs/outage",
        f"train.steps={STEPS}",
        "launcher.progress=true",
    ]
    run_uri, _ = pipeline.prepare("", overrides)
    pipeline.sft(run_uri)
    watch = Store(run_uri)  # straight to moto: the test sees the run through the outage
    cfg = load_run_config(watch)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_forwarder.endpoint)  # the launcher and every role

    at_step, delay = rng.randrange(1, STEPS // 2), rng.uniform(0.0, 0.5)
    outage: dict[str, float] = {}

    def inject() -> None:
        """Once the roles are at work (a first shard) and the trainer is past step `at_step`."""
        while not watch.done():
            try:
                step = watch.read_json(LAYOUT.status("trainer", "0")).get("step", 0)
            except FileNotFoundError:
                step = 0
            if step >= at_step and watch.find(LAYOUT.ungraded_dir, ".arrow"):
                time.sleep(delay)
                outage["start"] = time.time()
                s3_forwarder.outage(OUTAGE_S)
                outage["end"] = time.time()
                return
            time.sleep(0.2)

    before = set(descendants(os.getpid()))
    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    result = launch(run_uri, cfg.rollout.num_workers, cfg.reward.num_workers, timeout_s=300, progress=True)
    injector.join(timeout=OUTAGE_S + 5)
    done_at = time.time()

    assert "start" in outage and outage["end"] < done_at, f"the outage did not land mid-run: {outage}"
    assert watch.done()
    graded, _, _ = assert_every_sample_accounted(watch, cfg)
    # every generated sample was graded, or is in a shard written after the reward side stopped
    generated = samples_in(watch, LAYOUT.ungraded_dir)
    for rel, shard in graded.items():
        assert [s.sample_id for s in shard] == [s.sample_id for s in generated[LAYOUT.ungraded_twin(rel)]]
    # the outage was seen and ridden out by retries, in the roles and in the launcher
    retries = {name: st.get("store_retries", 0) for name, st in watch.statuses().items()}
    assert sum(retries.values()) > 0, retries
    assert result["launcher_store_retries"] + result["progress_skipped"] > 0, result
    # no process left behind
    deadline = time.time() + 120  # they die at once: only a leak reaches this
    while (left := [p for p in set(descendants(os.getpid())) - before if alive(p)]) and time.time() < deadline:
        time.sleep(0.5)
    assert left == []
    print(f"seed {seed}: outage after step {at_step} + {delay:.1f}s; retries {retries}; wall {result['wall_s']:.0f}s")
