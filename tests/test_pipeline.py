"""The roles as separate processes on one run root: local folder and a real S3 endpoint."""

from __future__ import annotations

import hashlib

import pytest

from areal_core.context import load_run_config
from areal_core.protocol import decode_shard, encode_shard
from areal_core.rollout.single_turn import SingleTurnWorkflow
from areal_core.rollout.workflow import RolloutWorkflow, WorkflowContext
from areal_core.run import pipeline
from areal_core.run.launcher import RoleFailed, launch
from areal_core.store import Store
from tests.conftest import TINY


def prepared(overrides: list[str]) -> Store:
    run_uri, _ = pipeline.prepare("", overrides)
    pipeline.sft(run_uri)
    return Store(run_uri)


def trained_log(store: Store) -> list[dict]:
    return [store.read_json(p) for p in store.find("trainer/trained", ".json")]


def assert_contract(store: Store, steps: int, eta: int) -> list[dict]:
    logs = trained_log(store)
    assert [entry["step"] for entry in logs] == list(range(steps))
    for entry in logs:
        for _, min_version in entry["samples"]:
            assert min_version >= entry["trainer_version"] - eta
    return logs


def run_and_check(store: Store) -> dict:
    cfg = load_run_config(store)
    result = launch(store.uri, cfg.rollout.num_workers, cfg.reward.num_workers, timeout_s=300, progress=False)
    assert store.done()
    logs = assert_contract(store, cfg.train.steps, cfg.train.eta)
    ids = [sid for entry in logs for sid, _ in entry["samples"]]
    assert len(ids) == len(set(ids)) == cfg.train.steps * cfg.train.batch_groups * cfg.rollout.group_size
    assert store.latest_version() == cfg.train.steps
    assert store.exists("final_model/COMMITTED") and store.exists("final_model/model.safetensors")
    return result


@pytest.mark.slow
def test_roles_on_a_local_folder_with_two_rollout_workers(tiny_overrides):
    store = prepared([*tiny_overrides, "rollout.num_workers=2", "reward.num_workers=2"])
    # a corrupt graded shard already in the store is quarantined, not fatal
    store.write_bytes("trajectories/graded/rollout-9/00000000.arrow", b"not arrow at all")
    store.write_bytes("trajectories/ungraded/rollout-8/00000000.arrow", encode_shard([])[:40])
    result = run_and_check(store)
    assert result["counters"]["quarantined_shards"] == 1
    assert len([p for p in store.find("quarantine") if p.endswith(".reason.json")]) == 2
    statuses = store.statuses()
    assert {"rollout-0", "rollout-1", "reward-0", "reward-1", "trainer-0"} <= set(statuses)


@pytest.mark.slow
@pytest.mark.s3
def test_roles_on_s3_with_two_rollout_and_two_reward_workers(tiny_overrides, s3_bucket):
    overrides = [o for o in tiny_overrides if not o.startswith("store=")]
    workers = ["rollout.num_workers=2", "reward.num_workers=2"]
    store = prepared([*overrides, *workers, f"store={s3_bucket}/runs/tiny"])
    assert store.uri.startswith("s3://")
    run_and_check(store)
    statuses = store.statuses()
    assert {"rollout-0", "rollout-1", "reward-0", "reward-1", "trainer-0"} <= set(statuses)
    trained = {w for entry in trained_log(store) for w in entry["sample_workers"]}
    assert trained == {"rollout-0", "rollout-1"}  # both workers' samples reached the trainer


@pytest.mark.slow
def test_a_two_rank_fsdp2_trainer_inside_the_pipeline(tiny_overrides):
    """train.nproc_per_node=2: the launcher starts the trainer under torchrun (2 gloo ranks,
    FSDP2); the run honours the same contract and DONE records the world size."""
    store = prepared([*tiny_overrides, "train.nproc_per_node=2"])
    result = run_and_check(store)
    assert result["world_size"] == 2


@pytest.mark.slow
def test_hard_bound_drops_and_counts_stale_samples(tiny_overrides):
    """η = 1, admission off and slow training: the rollout side floods the trainer, which
    must drop (and count) every sample older than its version − η."""
    store = prepared(
        [*tiny_overrides, "train.eta=1", "rollout.admission=false", "train.slow_step_s=0.5", "train.steps=5"]
    )
    cfg = load_run_config(store)
    result = launch(store.uri, 1, 1, timeout_s=300, progress=False)
    logs = assert_contract(store, 5, 1)
    dropped = [d for entry in logs for d in entry["dropped"]]
    assert result["counters"]["dropped_samples"] >= len(dropped) > 0
    assert all(min_v < entry["trainer_version"] - 1 for entry in logs for _, min_v in entry["dropped"])
    assert cfg.train.eta == 1


@pytest.mark.slow
def test_eta_zero_is_synchronous_on_policy(tiny_overrides):
    store = prepared([*tiny_overrides, "train.eta=0"])
    result = run_and_check(store)
    for entry in trained_log(store):
        assert {v for _, v in entry["samples"]} == {entry["trainer_version"]}
        assert set(entry["staleness_histogram"]) == {"0"}
    assert result["counters"]["dropped_samples"] == 0


@pytest.mark.slow
def test_a_failing_role_stops_the_run_and_is_named(tiny_overrides):
    store = prepared(tiny_overrides)
    store.delete("prompts", recursive=True)  # rollout and reward cannot start without prompts
    with pytest.raises(RoleFailed, match=r"role (trainer|rollout|reward)-0 exited with code 1"):
        launch(store.uri, 1, 1, timeout_s=120, progress=False)


def test_prepare_fails_before_any_work_on_bad_config(tmp_path):
    from areal_core.config import ConfigError

    with pytest.raises(ConfigError, match="unknown config key 'train.stepz'"):
        pipeline.prepare("", [f"store={tmp_path / 'r'}", "train.stepz=3"])
    assert not (tmp_path / "r").exists()


def test_prepare_fails_on_missing_dataset(tmp_path):
    from areal_core.config import ConfigError

    with pytest.raises(ConfigError, match="config section 'task' \\(gsm8k\\): dataset file .* does not exist"):
        pipeline.prepare("", [f"store={tmp_path / 'r'}", "task.name=gsm8k", f"task.path={tmp_path / 'nope'}"])
    assert not (tmp_path / "r" / "config.yaml").exists()


def hash_reward(completion: str) -> float:
    """1 for about a third of completions, by a stable hash: some groups all equal, some mixed."""
    return float(int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 3 == 0)


@pytest.mark.slow
def test_dynamic_sampling_gives_admission_back_and_does_not_deadlock(tiny_overrides):
    """DAPO at η = 0: the trainer drops every group whose rewards are all equal. Those groups
    were admitted under (v + η + 1)·B, so without giving their admission back the rollout side
    would never start the groups the trainer waits for."""
    store = prepared(
        [
            *tiny_overrides,
            "algo.dynamic_sampling=true",
            "train.eta=0",
            "rollout.temperature=1.5",
            "reward.function=tests.test_pipeline:hash_reward",
        ]
    )
    result = run_and_check(store)
    discarded = store.read_json("trainer/discarded_groups.json")["groups"]
    assert result["counters"]["filtered_groups"] == result["counters"]["discarded_groups"] == discarded > 0
    for entry in trained_log(store):
        assert {v for _, v in entry["samples"]} == {entry["trainer_version"]}  # still on-policy


@pytest.mark.slow
def test_code_config_runs_the_pipeline_with_the_sandboxed_reward(tmp_path):
    """configs/code.yaml: code tasks graded by unit tests in the sandbox, through the roles.
    (The tiny model writes no code, so every reward is 0 with the reason recorded.)"""
    overrides = [*TINY, f"store={tmp_path / 'run'}", "train.steps=2", "task.num_train=20"]
    overrides += ["rollout.max_new_tokens=16", "eval.max_new_tokens=16", "eval.num_samples=4"]
    run_uri, _ = pipeline.prepare("configs/default.yaml,configs/code.yaml", overrides)
    pipeline.sft(run_uri)
    store = Store(run_uri)
    assert load_run_config(store).reward.function == "areal_core.reward.code:code_reward"
    run_and_check(store)
    graded = [s for rel in store.find("trajectories/graded", ".arrow") for s in decode_shard(store.read_bytes(rel))]
    assert graded and all(s.reward == 0.0 for s in graded)
    assert all({"passed", "total"} <= set(s.reward_info) and "error" in s.reward_info for s in graded)


class MarkedWorkflow(RolloutWorkflow):
    """A user's own workflow (`rollout.workflow=tests.test_pipeline:MarkedWorkflow`): single-turn
    generation that marks its rows and rewards the even ones itself; the reward workers grade
    the rest."""

    def __init__(self, ctx: WorkflowContext):
        self.inner = SingleTurnWorkflow(ctx)

    async def arun_episode(self, engine, task: dict) -> list:
        rows = await self.inner.arun_episode(engine, task)
        for i, s in enumerate(rows):
            s.meta["workflow"] = "marked"
            if i % 2 == 0:
                s.reward = float(len(s.response_ids()) % 2)
        return rows


@pytest.mark.slow
def test_a_custom_workflow_loaded_by_import_path_produces_shards_that_train(tiny_overrides):
    store = prepared([*tiny_overrides, "rollout.workflow=tests.test_pipeline:MarkedWorkflow"])
    store.write_bytes("labels/latin1.jsonl", b'{"prompt_id": "\xe9", "reward": 1}\n')  # skipped, once, not fatal
    run_and_check(store)
    from areal_core.events import read_events

    skipped = [e for e in read_events(store) if e["kind"] == "labels_skipped"]
    assert len(skipped) == 1 and skipped[0]["path"] == "labels/latin1.jsonl" and "UTF-8" in skipped[0]["reason"]
    graded = [s for rel in store.find("trajectories/graded", ".arrow") for s in decode_shard(store.read_bytes(rel))]
    assert graded and all(s.meta["workflow"] == "marked" for s in graded)
    sources = {s.sample_id.rsplit("-", 1)[1]: s.reward_info["reward_source"] for s in graded}
    assert set(sources.values()) == {"workflow", "reward_worker"}
    assert all((src == "workflow") == (int(k) % 2 == 0) for k, src in sources.items())
    trained = {sid for entry in trained_log(store) for sid, _ in entry["samples"]}
    assert trained <= {s.sample_id for s in graded}


def test_groups_started_together_are_one_engine_call_and_one_shard(tmp_path):
    """Single-turn through the one worker loop: the groups admission lets start at once are
    batched into one generate call and written as one ungraded shard, named by the worker."""
    import asyncio

    from areal_core.config import RunConfig
    from areal_core.models import build_tokenizer
    from areal_core.proxy.examples import ScriptedEngine
    from areal_core.rollout.admission import Admission
    from areal_core.rollout.async_engine import AsyncEngine
    from areal_core.rollout.worker import RolloutLoop

    tasks = [{"prompt_id": f"p{i}", "prompt": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(6)]
    tok = build_tokenizer([t["prompt"] + " #### 12" for t in tasks], 300)
    engine = ScriptedEngine(tok, lambda _: "#### 12")
    cfg = RunConfig.model_validate(
        {"rollout": {"group_size": 3, "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0}}
    )
    workflow = SingleTurnWorkflow(WorkflowContext(cfg, tok))
    store = Store(str(tmp_path / "run"))
    adm = Admission(num_prompts=len(tasks), seed=0, batch_groups=2, eta=0)
    aengine = AsyncEngine(engine)
    try:
        result = asyncio.run(
            RolloutLoop(workflow, aengine, tasks, adm, store, "rollout-0", max_in_flight=4).run(num_groups=2)
        )
    finally:
        aengine.close()
    assert result == {"worker": "rollout-0", "shards": 1, "groups": 2} and engine.calls == [6]
    rows = decode_shard(store.read_bytes("trajectories/ungraded/rollout-0/00000000.arrow"))
    assert [s.sample_id for s in rows] == [f"rollout-0-g000000{g}-{k}" for g in range(2) for k in range(3)]
    assert all(s.reward is None and s.loss_mask[s.prompt_len :] == [1] * len(s.response_ids()) for s in rows)
