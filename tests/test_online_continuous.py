"""Continuous online RL: live sessions under the trainer's staleness bound (AReaL #1481), the proxy
as the rollout source, admission when users outrun the trainer, and the promotion gate."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from areal_core.config import load_config
from areal_core.layout import LAYOUT
from areal_core.proxy.examples import calculator_agent
from areal_core.proxy.runner import ProxyServer
from areal_core.proxy.sessions import session_id_for_key
from areal_core.store import Store
from task_data.arithmetic import generate
from tests.conftest import wait_until
from tests.test_flyte import serialize
from tests.test_online import MODEL, one_torch_thread  # noqa: F401 - the autouse fixture: one torch thread


# ---------------------------------------------------------------------------------------------
# Continuous online RL: live sessions under the trainer's staleness bound (AReaL #1481)
# ---------------------------------------------------------------------------------------------
def _session_row(i: int, versions: list[int], prompt_id: str = "", reward: float = 1.0, worker: str = "proxy-0"):
    from areal_core.protocol import Sample

    n = len(versions)
    return Sample(
        f"s{i}", f"sess-{i}", prompt_id, worker, list(range(1, n + 2)), 1, [0] + [1] * n, [0.0] + [-0.1] * n,
        [-1, *versions], reward=reward,
    )  # fmt: skip


def test_live_sessions_drop_and_count_sessions_beyond_the_staleness_bound(tmp_path):
    """Trainer version 3, η = 1: a session whose oldest served token is older than v − η = 2 is
    dropped (and given to the trainer to count) even when its later tokens are fresh; a reward out
    of range is left out; the B·G = 4 oldest fresh rows are trained, regrouped by prompt_id."""
    from areal_core.events import EventLog
    from areal_core.online.live_sessions import LiveSessions
    from areal_core.protocol import write_shard
    from areal_core.train.checkpoint import TrainerState

    store = Store(str(tmp_path / "run"))
    cfg = load_config(None, [*MODEL, "train.batch_groups=2", "rollout.group_size=2", "train.eta=1"])
    fresh = [_session_row(0, [3, 3]), _session_row(1, [2, 3]), _session_row(2, [3], "p"), _session_row(3, [2, 3], "p")]
    stale = [_session_row(5, [1, 2, 3]), _session_row(6, [0])]  # a long live session; an old one
    write_shard(store, LAYOUT.shard("graded", "proxy-0", 0), [*fresh, _session_row(4, [3])])
    write_shard(store, LAYOUT.shard("graded", "proxy-0", 1), [*stale, _session_row(7, [3], reward=1e6)])
    state = TrainerState(version=3)
    source = LiveSessions(store, cfg, state, EventLog(None, "trainer", "0"))
    batch = source.next_batch(state)
    assert sorted(s.sample_id for s in batch.dropped) == ["s5", "s6"] and source.left_out == 1
    groups = {s.sample_id: s.group_id for s in batch.samples}
    assert groups == {"s1": "live-0", "s3": "live-0-p", "s0": "live-0", "s2": "live-0-p"}
    assert [s.sample_id for s in source.pending()] == ["s4"]  # waits for the next step (saved with a checkpoint)
    assert source.next_batch(state).samples is None  # one row: too few for a step, nothing dropped
    write_shard(store, LAYOUT.shard("graded", "proxy-0", 2), [_session_row(8 + i, [3]) for i in range(3)])
    again = source.next_batch(state)
    assert len(again.samples) == 4 and again.dropped == [] and source.pending() == []


def test_online_continuous_serializes_as_prepare_sft_then_the_continuous_task():
    from workflows.online import online_continuous

    wf = serialize(online_continuous)
    assert [n.id for n in wf.template.nodes] == ["n0", "n1", "n2"]
    assert set(wf.template.interface.inputs) == {"cfg", "config", "overrides", "resume_run"}


@pytest.mark.slow
def test_continuous_online_rl_trains_on_the_sessions_of_a_proxy_that_follows_the_trainer(tmp_path):
    """The continuous task (reward pool + trainer) on a run root; a proxy `--follow RUN/weights
    --store RUN` serves simulated calculator users, each session ended with its reward. The trainer
    steps on B·G sessions at a time and publishes each version; the proxy serves it. Sessions older
    than η (written in as a proxy that fell behind would) are dropped and counted, never trained.
    The trainer is slowed so that the users outrun it: the proxy then refuses new sessions (429,
    trainer_behind) and never lets more than (η + 1)·B·G of its rows wait, plus the open sessions'."""
    import threading

    import openai

    from areal_core.online.continuous import run_continuous
    from areal_core.protocol import write_shard
    from areal_core.proxy.__main__ import build_app, parse_args
    from areal_core.run import pipeline

    ov = [
        *MODEL,
        f"store={tmp_path / 'run'}",
        "sft.enabled=false",
        *("task.num_train=40", "task.num_eval=4", "rollout.group_size=2", "train.batch_groups=2"),
        *("train.steps=4", "train.eta=1", "train.checkpoint_every=10", "train.lr_warmup_steps=0"),
        "train.slow_step_s=1.5",  # traffic outruns the trainer: new sessions wait at the admission bound
        *("online.promote_every=2", "online.model_name=continuous-gate", "tracking.enabled=false"),
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ]
    run_uri, _ = pipeline.prepare("configs/agent_calculator.yaml", ov)
    checkpoint = pipeline.sft(run_uri)
    run = Store(run_uri)
    result: dict = {}
    trainer = threading.Thread(target=lambda: result.update(run_continuous(run_uri, checkpoint)), daemon=True)
    trainer.start()
    keys = ["sk-user-0", "sk-user-1"]
    follow = ["--follow", run.url(LAYOUT.weights_root), "--store", run_uri, "--poll-interval-s", "0.1"]
    flags = ["--tool-prompt", "none", "--default-max-tokens", "12"]
    args = parse_args([*follow, *(a for k in keys for a in ("--api-key", k)), *flags])
    tasks, _ = generate(7, 40, 1, ops="+-", lo=1, hi=9, max_steps=1)
    served: list[int] = []
    refused: list[str] = []
    start: dict[str, int] = {}

    async def user(server: ProxyServer, key: str, offset: int) -> None:
        n = offset
        auth = {"Authorization": f"Bearer {key}"}
        while trainer.is_alive():
            task = tasks[n % len(tasks)]
            try:
                reward = await calculator_agent(task, server.base_url, key, max_turns=1)
            except openai.RateLimitError as exc:  # the trainer is behind: a new session waits (admission)
                assert exc.code == "trainer_behind", exc
                refused.append(exc.message)
                await asyncio.sleep(0.2)
                continue
            async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=120) as http:
                r = await http.post(
                    f"/v1/sessions/{session_id_for_key(key)}/end",
                    json={"reward": reward, "prompt_id": task["prompt_id"], "return_trajectory": True},
                )
                assert r.status_code == 200, r.text
                health = (await http.get("/health")).json()
            served.append(health["policy_version"])
            adm = health["admission"]  # once the trainer publishes its settled rows, the bound holds: what waits
            if adm["active"]:  # then grows past the bound (or what waited when it began) by open sessions at most
                start.setdefault("waiting", adm["waiting_rows"])
                assert adm["waiting_rows"] <= max(adm["bound"], start["waiting"]) + len(keys), health
            if health["policy_version"] >= 2 and not run.exists(LAYOUT.shard("graded", "proxy-9", 0)):
                old = [_session_row(100 + i, [0, health["policy_version"]], worker="proxy-9") for i in range(2)]
                write_shard(run, LAYOUT.shard("graded", "proxy-9", 0), old)  # oldest token v0 < v - η
            n += len(keys)

    with ProxyServer(build_app(args)) as server:

        async def users() -> None:
            await asyncio.gather(*(user(server, k, i) for i, k in enumerate(keys)))

        asyncio.run(users())
        trainer.join(timeout=300)

        def serving_last() -> dict | None:  # the proxy follows at its next poll: waited for, not assumed
            health = httpx.get(f"{server.url}/health", timeout=60).json()
            return health if health["policy_version"] == run.latest_version() else None

        final = wait_until(serving_last, 120, "the proxy to serve the last version", poll_s=0.1)
    assert result["step"] == 4 and run.done()
    assert run.latest_version() == 4 and final["policy_version"] == 4  # the proxy serves the last version
    assert len(set(served)) >= 2  # sessions were served by more than one trainer version
    assert result["dropped_samples"] >= 2
    dropped = []
    for step in range(4):
        record = run.read_json(LAYOUT.trained_record(step))
        assert all(int(k) <= 1 for k in record["staleness_histogram"])  # no trained token older than η
        assert set(record["sample_workers"]) == {"proxy-0"}
        assert all(v < record["trainer_version"] - 1 for _, v in record["dropped"])  # only what η forbids
        dropped += [f"{w}/{sid}" for w, (sid, _) in zip(record["dropped_workers"], record["dropped"])]
    assert {"proxy-9/s100", "proxy-9/s101"} <= set(dropped) and len(dropped) == result["dropped_samples"]
    assert refused and all("(bound 8)" in m for m in refused)  # (η + 1)·B·G = 2·4 rows of the proxy's may wait
    assert "waiting" in start  # the trainer published its settled rows while users were served
    # the promotion gate scored versions 2 and 4 against the starting policy's score; the alias is at the
    # last version that won (or nowhere, when none did)
    from areal_core.events import read_events
    from areal_core.online.registry import aliased
    from areal_core.run.tracking import mlflow_client

    gate = run.read_json(LAYOUT.promotions)
    assert [o["version"] for o in gate["offers"]] == [2, 4]
    won = [o for o in gate["offers"] if o["promoted"]]
    champion = aliased(mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}"), "continuous-gate")
    assert (champion is None) == (not won)
    if won:
        assert champion.tags["trainer_version"] == str(won[-1]["version"])
        assert gate["champion_score"] == won[-1]["score"]
    events = [e for e in read_events(run) if e["kind"] == "promotion"]
    assert [(e["version"], e["promoted"]) for e in events] == [(o["version"], o["promoted"]) for o in gate["offers"]]
    print(f"{len(served)} sessions served by versions {sorted(set(served))}; dropped {dropped}; refused {len(refused)}")
