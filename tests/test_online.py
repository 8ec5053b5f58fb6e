"""Online retraining: sessions the proxy served in online mode land in a store; a run retrains on
the sessions past the cursor, and registers the candidate only when it beats the current model."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from areal_core.config import load_config
from areal_core.layout import LAYOUT
from areal_core.models import build_tiny_model, build_tokenizer, load_pretrained, save_pretrained
from areal_core.online import registry, retrain
from areal_core.proxy.app import create_app
from areal_core.proxy.examples import calculator_agent, calculator_corpus
from areal_core.proxy.guard import ApiKeys
from areal_core.proxy.runner import ProxyServer
from areal_core.proxy.sessions import session_id_for_key
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.torch_engine import TorchEngine
from areal_core.store import Store
from benchmarks.tiny_run import MODEL
from task_data.arithmetic import generate
from tests.test_flyte import serialize


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> str:
    """A tiny untrained model whose tokenizer knows the calculator format, saved as an HF folder."""
    train, _ = generate(1, 200, 10, ops="+-", lo=1, hi=9, max_steps=1)
    tok = build_tokenizer(calculator_corpus(train), 400)
    model = build_tiny_model(load_config(None, MODEL).model, len(tok), seed=2)
    out = tmp_path_factory.mktemp("base") / "model"
    save_pretrained(model, tok, out)
    return str(out)


def serve_sessions(model_dir: str, sessions: Store, tasks: list[dict], seed: int) -> int:
    """Online mode: the proxy over the model writes every ended session to `sessions`; each task is
    one calculator episode under its own key, ended with the agent's reward. Returns rows written."""
    model, tok = load_pretrained(model_dir)
    engine = TorchEngine(model, tok.pad_token_id, tok.eos_token_id, seed=seed)
    keys = ApiKeys()
    app = create_app(
        engine, tok, store=sessions, api_keys=keys, tool_prompt="none", sampling=SamplingParams(max_new_tokens=20)
    )

    async def episode(server: ProxyServer, task: dict) -> None:
        key = keys.new_key()
        reward = await calculator_agent(task, server.base_url, key, max_turns=2)
        auth = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=120) as http:
            r = await http.post(
                f"/v1/sessions/{session_id_for_key(key)}/end", json={"reward": reward, "prompt_id": task["prompt_id"]}
            )
            assert r.status_code == 200, r.text

    with ProxyServer(app) as server:

        async def all_episodes() -> None:
            await asyncio.gather(*(episode(server, t) for t in tasks))

        asyncio.run(all_episodes())
    return sum(1 for rel in sessions.find("trajectories/graded", ".arrow"))


def overrides(tmp_path, base: str) -> list[str]:
    return [
        *MODEL,
        f"store={tmp_path / 'online'}",
        f"model.path={base}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "rollout.agent=areal_core.proxy.examples:calculator_agent",
        "rollout.group_size=2",
        "train.batch_groups=2",
        "train.steps=3",
        "train.eval_every=0",
        "eval.num_samples=6",
        "eval.max_new_tokens=20",
        "task.num_train=50",
        "task.num_eval=6",
        "task.min_value=1",
        "task.max_value=9",
    ]


@pytest.mark.slow
def test_cursor_advances_and_the_next_run_sees_only_new_sessions(tmp_path, base_model):
    sessions = Store(str(tmp_path / "sessions"))
    train, _ = generate(5, 12, 1, ops="+-", lo=1, hi=9, max_steps=1)
    first = serve_sessions(base_model, sessions, train[:5], seed=1)
    assert first == 5 and retrain.read_cursor(sessions) == {}
    ov = overrides(tmp_path, base_model)

    run1 = retrain.retrain_candidate("", ov, sessions.uri, "policy", "r1")
    plan1 = Store(run1).read_json(LAYOUT.online_plan)
    assert plan1["rows"] == 5 and plan1["trained"] and plan1["updates"] == 1  # ⌊5 / (2·2)⌋ updates
    assert retrain.read_cursor(sessions) == {}  # moved only when the run completes
    out1 = retrain.publish_candidate(run1)
    assert out1["rows"] == 5
    assert retrain.read_cursor(sessions) == {"proxy-0": 4}

    run2 = retrain.online_retrain("", ov, sessions.uri, "policy", "r2")
    assert run2["rows"] == 0 and run2["shards"] == 0 and not run2["registered"]
    assert retrain.read_cursor(sessions) == {"proxy-0": 4}

    assert serve_sessions(base_model, sessions, train[5:8], seed=2) == 8
    run3 = retrain.retrain_candidate("", ov, sessions.uri, "policy", "r3")
    plan3 = Store(run3).read_json(LAYOUT.online_plan)
    assert plan3["rows"] == 3
    assert [rel.rsplit("/", 1)[-1] for rel in plan3["shards"]] == ["00000005.arrow", "00000006.arrow", "00000007.arrow"]
    rows = [s for rel in plan3["shards"] for s in retrain.read_shard_or_quarantine(sessions, rel)]
    assert sorted(s.prompt_id for s in rows) == sorted(t["prompt_id"] for t in train[5:8])
    retrain.publish_candidate(run3)
    assert retrain.read_cursor(sessions) == {"proxy-0": 7}
    assert sessions.read_json(LAYOUT.online_cursor)["runs"] == ["r1", "r3"]


def test_regroup_pools_singletons_and_groups_repeated_prompts():
    from areal_core.online.session_batches import regroup
    from areal_core.protocol import Sample

    def row(i: int, prompt: str) -> Sample:
        return Sample(f"s{i}", f"sess-{i}", prompt, "proxy-0", [1, 2, 3], 1, [0, 1, 1], [0, -0.1, -0.1], [-1, 0, 0])

    out = regroup([row(0, "a"), row(1, "b"), row(2, "a"), row(3, "")], "pool")
    assert [s.group_id for s in out] == ["pool-a", "pool", "pool-a", "pool"]


def _register_checks(tmp_path, uri: str, model_dir: str) -> None:
    import mlflow

    name = f"online-{tmp_path.name}"  # the MLflow server is shared by the whole session

    first = registry.register_if_better(model_dir, name, uri, 0.30, None, run_name="r1")
    assert first["registered"] and first["model_uri"] == f"models:/{name}/1"
    client = mlflow.MlflowClient(uri)
    assert str(registry.aliased(client, name).version) == "1"
    worse = registry.register_if_better(model_dir, name, uri, 0.25, 0.30, run_name="r2")
    assert not worse["registered"] and worse["model_uri"] == f"models:/{name}/1"
    tie = registry.register_if_better(model_dir, name, uri, 0.32, 0.30, min_gain=0.05, run_name="r3")
    assert not tie["registered"]
    better = registry.register_if_better(model_dir, name, uri, 0.40, 0.30, run_name="r4")
    assert better["registered"] and better["model_uri"] == f"models:/{name}/2"
    versions = client.search_model_versions(f"name = '{name}'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    assert client.get_model_version(name, "2").tags["heldout_score"] == "0.4000"
    assert client.get_run(worse["run_id"]).data.tags["registered"] == "false"
    metrics = client.get_run(worse["run_id"]).data.metrics  # the champion's recorded score, read at the move
    assert metrics == {"candidate_score": 0.25, "current_score": 0.30, "champion_score": 0.30}
    # the candidate was promoted: champion moved to it, no version waits as candidate
    assert str(client.get_model_version_by_alias(name, "champion").version) == "2"
    assert registry.aliased(client, name, "candidate") is None
    # the champion is an MLflow transformers model: it serves as it is
    served = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    out = served.predict(["3 + 4 ="], params={"max_new_tokens": 4})
    assert isinstance(out[0], str) and out[0].startswith("3 + 4 =")
    # run names: the Flyte execution's inside Flyte, else generated from the fallback
    assert client.get_run(first["run_id"]).info.run_name.startswith("r1-")


@pytest.mark.slow
def test_register_if_better_registers_only_when_better(tmp_path, base_model):
    _register_checks(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}", base_model)


@pytest.mark.slow
def test_register_if_better_against_an_mlflow_server(tmp_path, mlflow_server, base_model):
    _register_checks(tmp_path, mlflow_server, base_model)


def test_runs_are_named_and_tagged_after_their_flyte_execution(monkeypatch):
    from types import SimpleNamespace

    from areal_core.run.tracking import Execution, new_run

    class Client:  # records what MlflowClient.create_run is given
        def get_experiment_by_name(self, name):
            return SimpleNamespace(experiment_id="7")

        def create_run(self, exp_id, run_name, tags):
            self.created = (exp_id, run_name, tags)
            return SimpleNamespace(info=SimpleNamespace(run_id="run-1"))

    client = Client()
    assert new_run(client, "exp", "online-r1") == "run-1"  # outside Flyte: a generated name
    assert client.created[1].startswith("online-r1-") and client.created[2] == {}
    ex = Execution("a1b2c3", "areal", "development", "https://flyte.example.com/console")
    for key, value in ex.env().items():
        monkeypatch.setenv(key, value)
    assert Execution.from_env() == ex
    new_run(client, "exp", "online-r1", {"k": "v"})
    assert client.created == (
        "7",
        "a1b2c3",
        {
            "k": "v",
            "flyte.execution_id": "a1b2c3",
            "flyte.project": "areal",
            "flyte.domain": "development",
            "flyte.console_url": "https://flyte.example.com/console/projects/areal/domains/development/executions/a1b2c3",
        },
    )


@pytest.mark.slow
def test_online_run_starts_from_the_registered_version_and_compares_against_it(tmp_path, base_model, monkeypatch):
    """Scores are stubbed: the first candidate beats the base model and is registered; the second
    run starts from that version and, scoring lower than it, registers nothing."""
    import mlflow

    sessions = Store(str(tmp_path / "sessions"))
    train, _ = generate(6, 8, 1, ops="+-", lo=1, hi=9, max_steps=1)
    serve_sessions(base_model, sessions, train[:4], seed=3)
    scores = iter([0.2, 0.5, 0.5, 0.4])  # (current, candidate) of run 1, then of run 2
    monkeypatch.setattr("areal_core.evaluate.heldout_score", lambda *a, **k: next(scores))
    ov = overrides(tmp_path, base_model)
    out1 = retrain.online_retrain("", ov, sessions.uri, "policy", "r1")
    assert out1["registered"] and out1["model_uri"] == "models:/policy/1"
    serve_sessions(base_model, sessions, train[4:8], seed=4)
    out2 = retrain.online_retrain("", ov, sessions.uri, "policy", "r2")
    assert (out2["current_score"], out2["candidate_score"]) == (0.5, 0.4)
    assert not out2["registered"] and out2["model_uri"] == "models:/policy/1"
    plan2 = Store(out2["run_uri"]).read_json(LAYOUT.online_plan)
    assert plan2["start_model"] == "models:/policy/1" and plan2["rows"] == 4
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert [int(v.version) for v in client.search_model_versions("name = 'policy'")] == [1]


def test_online_launch_plan_serializes_with_its_cron_schedule():
    from jobs.catalog import NIGHTLY_CRON
    from workflows.online import online_retrain, online_retrain_nightly

    wf = serialize(online_retrain)
    assert [n.id for n in wf.template.nodes] == ["n0", "n1"]
    assert set(wf.template.interface.inputs) == {
        "sessions",
        "config",
        "overrides",
        "model_name",
        "min_gain",
        "kickoff_time",
    }
    lp = serialize(online_retrain_nightly)
    sched = lp.spec.entity_metadata.schedule
    assert sched.cron_schedule.schedule == NIGHTLY_CRON == "0 3 * * *"
    assert sched.kickoff_time_input_arg == "kickoff_time"
    assert lp.spec.workflow_id.name == "workflows.online.online_retrain"
    defaults = lp.spec.default_inputs.parameters
    assert defaults["config"].default.scalar.primitive.string_value == "configs/agent_calculator.yaml"


def _candidate_root(tmp_path, base_model: str, uri: str) -> Store:
    """An online run root as `retrain_candidate` leaves it: a committed final_model/ that beat the
    current model (0.5 against 0.2), and no sessions shards to move the cursor past."""
    run = Store(str(tmp_path / "online-run"))
    run.put_dir(base_model, LAYOUT.final_model)
    run.write_json(LAYOUT.committed(LAYOUT.final_model), {"updates": 1})
    plan = {
        "run_id": "r1",
        "rows": 4,
        "shards": [],
        "trained": True,
        "tracking_uri": uri,
        "model_name": "policy",
        "experiment": "areal-flyte-online",
        "candidate_score": 0.5,
        "current_score": 0.2,
        "start_model": base_model,
        "sessions": str(tmp_path / "sessions"),
    }
    run.write_json(LAYOUT.online_plan, plan)
    return run


def _versions_and_runs(uri: str) -> tuple[list[int], int]:
    import mlflow

    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("areal-flyte-online")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return sorted(int(v.version) for v in client.search_model_versions("name = 'policy'")), len(runs)


@pytest.mark.slow
def test_a_retried_publish_returns_the_version_it_registered(tmp_path, base_model):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = _candidate_root(tmp_path, base_model, uri)
    first = retrain.publish_candidate(run.uri)
    assert first["registered"] and first["model_uri"] == "models:/policy/1"
    again = retrain.publish_candidate(run.uri)
    assert again == first
    assert _versions_and_runs(uri) == ([1], 1)  # one version, one MLflow run


@pytest.mark.slow
def test_a_publish_that_died_after_registering_is_finished_by_its_retry(tmp_path, base_model, monkeypatch):
    """Attempt 1 dies after creating the version but before promoting it; attempt 2 after
    promoting but before writing online_result.json; attempt 3 completes. One version, champion."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = _candidate_root(tmp_path, base_model, uri)
    promote = registry.promote

    def dies(*args):
        raise RuntimeError("killed before promoting")

    monkeypatch.setattr(registry, "promote", dies)
    with pytest.raises(RuntimeError, match="before promoting"):
        retrain.publish_candidate(run.uri)
    client = mlflow.MlflowClient(uri)
    assert _versions_and_runs(uri) == ([1], 1) and registry.aliased(client, "policy") is None

    monkeypatch.setattr(registry, "promote", promote)
    write_json = Store.write_json

    def dies_on_the_result(self, rel, value):
        if rel == LAYOUT.online_result:
            raise RuntimeError("killed before the result")
        return write_json(self, rel, value)

    monkeypatch.setattr(Store, "write_json", dies_on_the_result)
    with pytest.raises(RuntimeError, match="before the result"):
        retrain.publish_candidate(run.uri)
    assert str(registry.aliased(client, "policy").version) == "1"

    monkeypatch.setattr(Store, "write_json", write_json)
    out = retrain.publish_candidate(run.uri)
    assert out["registered"] and out["model_uri"] == "models:/policy/1"
    assert run.read_json(LAYOUT.online_result) == out
    assert _versions_and_runs(uri) == ([1], 1)
    assert str(registry.aliased(client, "policy").version) == "1"
