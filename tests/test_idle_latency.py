"""Latency between the roles when one waits on another (issue 57): a staged weight version is installed by an
idle engine at once and wakes a rollout loop that admission blocked; the reward worker keeps its poll interval
while shards keep coming and backs off only after a second without one.

The waits here are set to an hour (`idle_poll_s`, `poll_interval_s`), so only the wake-up can make these tests
pass; each bounds its wait at a minute, which the wake-up beats by orders of magnitude on a busy machine."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from areal_core.config import RunConfig
from areal_core.models import build_tokenizer
from areal_core.proxy.examples import ScriptedEngine
from areal_core.reward.worker import IDLE_SLEEP_CAP_S, idle_sleep_s
from areal_core.rollout.admission import Admission
from areal_core.rollout.async_engine import AsyncEngine
from areal_core.rollout.single_turn import SingleTurnWorkflow
from areal_core.rollout.workflow import WorkflowContext
from areal_core.store import Store

HOUR = 3600.0


class StagedEngine(ScriptedEngine):
    """A scripted engine with a mailbox: `staged` is installed by `load_version` (the idle install)."""

    staged = 0

    def load_version(self, version: int) -> None:
        self.version = max(self.version, version, self.staged)


def tasks_and_engine():
    tasks = [{"prompt_id": f"p{i}", "prompt": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(8)]
    tok = build_tokenizer([t["prompt"] + " #### 12" for t in tasks], 300)
    return tasks, tok, StagedEngine(tok, lambda _: "#### 12")


def test_wake_installs_a_staged_version_on_an_idle_engine_and_tells_the_listeners():
    _, _, engine = tasks_and_engine()
    aengine = AsyncEngine(engine, idle_poll_s=HOUR)  # its own idle install would come in an hour
    heard = threading.Event()
    stop = aengine.on_new_version(heard.set)
    try:
        engine.staged = 3
        aengine.wake()
        assert heard.wait(60) and engine.version == 3
        heard.clear()
        stop()  # no longer told
        engine.staged = 4
        aengine.wake()
        deadline = time.monotonic() + 60
        while engine.version != 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.version == 4 and not heard.is_set()
    finally:
        aengine.close()


def test_a_version_staged_behind_a_queued_call_is_installed_when_that_batch_ends():
    """The wake-up is queued behind a call while the engine runs another: the engine thread takes both from the
    queue together for its next batch, and installs the version once that batch ends (swap_mid_generation off
    waits for the end of a call), not at its idle poll an hour later."""
    from areal_core.rollout.engine import SamplingParams

    _, tok, engine = tasks_and_engine()
    busy, go = threading.Event(), threading.Event()
    generate = engine.generate

    def slow_generate(prompts, params):
        busy.set()
        assert go.wait(60)
        return generate(prompts, params)

    engine.generate = slow_generate
    aengine = AsyncEngine(engine, idle_poll_s=HOUR)
    heard = threading.Event()
    aengine.on_new_version(heard.set)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0)

    def call() -> threading.Thread:
        t = threading.Thread(target=lambda: asyncio.run(aengine.generate(tok.encode("1 + 1"), params)), daemon=True)
        t.start()
        return t

    callers = [call()]
    try:
        assert busy.wait(60)  # the first call runs
        callers.append(call())
        deadline = time.monotonic() + 60
        while aengine._q.qsize() < 1 and time.monotonic() < deadline:  # the second call waits in the queue
            time.sleep(0.01)
        engine.staged = 2
        aengine.wake()  # queued behind the second call
        go.set()
        assert heard.wait(60) and engine.version == 2
        assert engine.calls == [1, 1]
    finally:
        go.set()
        for t in callers:
            t.join(timeout=60)
        aengine.close()


def test_a_rollout_loop_blocked_by_admission_starts_as_soon_as_the_next_version_is_installed(tmp_path):
    """η = 0, 2 groups a version: the loop starts 2 groups, writes them, and is blocked until version 1.
    Its poll interval is an hour: the version staged and woken from another thread (the weight watcher's
    role) must let it start the next 2 groups within the minute the test allows."""
    from areal_core.rollout.worker import RolloutLoop

    tasks, tok, engine = tasks_and_engine()
    cfg = RunConfig.model_validate(
        {"rollout": {"group_size": 2, "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0}}
    )
    workflow = SingleTurnWorkflow(WorkflowContext(cfg, tok))
    store = Store(str(tmp_path / "run"))
    adm = Admission(num_prompts=len(tasks), seed=0, batch_groups=2, eta=0)
    aengine = AsyncEngine(engine, idle_poll_s=HOUR)

    def watcher() -> None:  # once the first two groups are generated, version 1 arrives
        deadline = time.monotonic() + 60
        while not engine.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.staged = 1
        aengine.wake()

    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    loop = RolloutLoop(workflow, aengine, tasks, adm, store, "rollout-0", max_in_flight=4, poll_interval_s=HOUR)
    try:
        result = asyncio.run(asyncio.wait_for(loop.run(num_groups=4), 60))
    finally:
        aengine.close()
        thread.join(timeout=60)
    assert result["groups"] == 4 and engine.version == 1
    assert engine.calls == [4, 4]  # two groups of 2 under version 0, then two under version 1


@pytest.mark.parametrize(
    "idle_for,base,expected",
    [
        (0.0, 0.02, 0.02),
        (0.99, 0.02, 0.02),  # between the shards of a running job: the configured interval
        (1.0, 0.02, 0.04),
        (2.5, 0.02, 0.08),
        (3.0, 0.02, 0.16),
        (4.0, 0.02, IDLE_SLEEP_CAP_S),
        (3600.0, 0.02, IDLE_SLEEP_CAP_S),
        (86400.0 * 365, 1e-9, IDLE_SLEEP_CAP_S),  # a year idle: no overflow
        (5.0, 0.5, 0.5),  # never below the configured interval, even past the cap
    ],
)
def test_reward_idle_sleep(idle_for, base, expected):
    assert idle_sleep_s(idle_for, base) == pytest.approx(expected)
