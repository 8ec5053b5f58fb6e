"""The serving proxy follows a source of versions with no failed request: a run's weights/ as the
trainer publishes them, and an MLflow alias moved forwards and back (rollback), over real HTTP with
the openai SDK while clients keep sending requests."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from areal_core.config import load_config
from areal_core.layout import LAYOUT
from areal_core.models import build_tiny_model, build_tokenizer, save_pretrained
from areal_core.proxy.__main__ import build_app, parse_args
from areal_core.proxy.examples import calculator_corpus
from areal_core.proxy.runner import ProxyServer
from areal_core.proxy.versions import Folder, MlflowAlias, RunWeights, make_source
from areal_core.store import Store
from areal_core.weights.publisher import hf_side_files, publish, state_dict_bytes
from benchmarks.tiny_run import MODEL
from task_data.arithmetic import generate
from tests.conftest import wait_until

KEY = "sk-follow"
PROBE = [{"role": "user", "content": "3 + 4 ="}]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> list[tuple[object, object, str]]:
    """Three tiny models of one tokenizer (different seeds), each also saved as an HF folder."""
    train, _ = generate(1, 200, 10, ops="+-", lo=1, hi=9, max_steps=1)
    tok = build_tokenizer(calculator_corpus(train), 400)
    out = []
    for seed in (2, 3, 4):
        model = build_tiny_model(load_config(None, MODEL).model, len(tok), seed=seed)
        folder = tmp_path_factory.mktemp(f"model{seed}") / "model"
        save_pretrained(model, tok, folder)
        out.append((model, tok, str(folder)))
    return out


class Traffic:
    """`clients` threads, each in its own session, sending chat completions through the openai SDK
    (no retries: every failure counts) until `stop()`; each response's send time and `areal` record.
    Client 0 asks for `long_tokens` tokens, so some requests are in flight across a swap."""

    def __init__(self, base_url: str, clients: int = 3, max_tokens: int = 12, long_tokens: int = 96):
        self.base_url, self.max_tokens, self.long_tokens = base_url, max_tokens, long_tokens
        self.responses: list[dict] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def _run(self, i: int) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=self.base_url, api_key=KEY, max_retries=0, timeout=60)
        n = 0
        while not self._stop.is_set():
            sent = time.time()
            try:
                r = client.chat.completions.create(
                    model="policy",
                    messages=[{"role": "user", "content": f"{n % 9 + 1} + 2 ="}],
                    max_tokens=self.long_tokens if i == 0 else self.max_tokens,
                    extra_headers={"X-Session-Id": f"client-{i}-{n // 50}"},
                )
                self.responses.append({"sent": sent, "client": i, **r.model_extra["areal"]})
            except Exception as exc:  # noqa: BLE001 - counted: the test requires none
                self.failures.append(repr(exc))
            n += 1


def probe(base_url: str) -> dict:
    """The `areal` record of one greedy completion of PROBE (its log-probs tell the weights apart)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=60)
    r = client.chat.completions.create(model="policy", messages=PROBE, max_tokens=8, temperature=0)
    return r.model_extra["areal"]


def wait_serving(url: str, model_version: str, timeout_s: float = 180.0) -> tuple[float, dict]:
    """(the time /health first reports `model_version` as served, that health) ."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        health = httpx.get(f"{url}/health", timeout=10).json()
        if health["serving"]["model_version"] == model_version:
            return time.time(), health
        time.sleep(0.05)
    raise AssertionError(f"/health never reported {model_version}: {health}")


def wait_traffic(traffic: Traffic, version: int) -> None:
    """Until some client's response was served by serving version `version` (every phase must
    serve traffic): polled, never a fixed sleep that a loaded machine can outlast."""
    wait_until(lambda: any(version in r["versions"] for r in list(traffic.responses)), 180, f"traffic on v{version}")


def check_traffic(traffic: Traffic, phases: list[tuple[float, int, str]]) -> None:
    """No failed request; in every response the token versions only grow and are named by their
    serving version; a request sent after /health reported a phase's version is served by it (or a later one)."""
    assert traffic.failures == [], traffic.failures[:3]
    labels = {v: label for _, v, label in phases}
    for r in traffic.responses:
        assert r["versions"] == sorted(r["versions"]) and set(r["versions"]) <= set(labels)
        assert r["model_version"] == labels[r["versions"][-1]]
        for start, v, _ in phases:
            if r["sent"] > start:
                assert min(r["versions"]) >= v, (r, phases)
    for _, v, _ in phases:  # every phase served traffic
        assert any(v in r["versions"] for r in traffic.responses), (v, len(traffic.responses))


def test_make_source_names_each_kind(tmp_path):
    s = make_source("models:/policy@champion", tracking_uri=f"sqlite:///{tmp_path / 'm.db'}", staging=str(tmp_path))
    assert isinstance(s, MlflowAlias) and (s.name, s.alias, s.next) == ("policy", "champion", 0)
    run = make_source(f"{tmp_path}/run/weights/")
    assert isinstance(run, RunWeights) and run.store.uri.rstrip("/").endswith("/run")
    assert run.label(7) == f"{run.store.uri}/weights/v000007"
    assert isinstance(make_source(str(tmp_path / "hf"), version=3), Folder)
    for bad in ("models:/policy", "models:/a/b@champion", "models:/@x"):
        with pytest.raises(ValueError, match="models:/NAME@ALIAS"):
            make_source(bad)


@pytest.mark.parametrize("engine", ["torch", "continuous"])
def test_the_proxy_follows_a_run_s_weights_with_no_failed_request(tmp_path, models, engine):
    """The trainer publishes v0, v1, v2 while clients send requests: the proxy's engine (built by the
    rollout factory) installs each the way a rollout worker does; /health and every token name the
    trainer's version."""
    run = Store(str(tmp_path / "run"))
    model0, tok, folder0 = models[0]
    run.put_dir(folder0, LAYOUT.init_model)
    run.write_json(LAYOUT.committed(LAYOUT.init_model), {})
    side = hf_side_files(model0, tok)
    publish(run, 0, state_dict_bytes(model0), side)
    follow = ("--follow", run.url(LAYOUT.weights_root), "--engine", engine, "--poll-interval-s", "0.1")
    args = parse_args(
        [*follow, "--api-key", KEY, "--set", "rollout.max_batch_groups=1", "--set", "rollout.group_size=4"]
    )
    with ProxyServer(build_app(args)) as server, Traffic(server.base_url) as traffic:
        phases = [(wait_serving(server.url, run.url(LAYOUT.weights_dir(0)))[0], 0, run.url(LAYOUT.weights_dir(0)))]
        first = probe(server.base_url)
        for v in (1, 2):
            wait_traffic(traffic, v - 1)
            publish(run, v, state_dict_bytes(models[v][0]), side)
            label = run.url(LAYOUT.weights_dir(v))
            at, health = wait_serving(server.url, label)
            phases.append((at, v, label))
            assert health["ok"] and health["policy_version"] == v and health["serving"]["following"]
        wait_traffic(traffic, 2)
        last = probe(server.base_url)
    check_traffic(traffic, phases)
    mixed = sum(len(set(r["versions"])) > 1 for r in traffic.responses)  # in flight across a swap: re-prefilled
    print(f"{engine}: {len(traffic.responses)} requests ({mixed} across a swap), {len(traffic.failures)} failed")
    assert first["versions"][0] == 0 and last["versions"][0] == 2
    assert first["logprobs"] != last["logprobs"]  # the weights changed, not only the number


def _register(uri: str, name: str, folder: str, score: float, current: float | None) -> str:
    from areal_core.online import registry

    out = registry.register_if_better(folder, name, uri, score, current, run_name=f"{name}-{score}")
    assert out["registered"]
    return out["model_uri"]


@pytest.mark.slow
def test_rollback_the_alias_moves_v1_v2_v1_and_no_request_fails(tmp_path, mlflow_server, models, monkeypatch):
    """champion: v1, then v2 (registered as better: promoted), then moved back to v1 by hand, while
    clients keep sending requests. No request fails; /health and every response name the version
    that served it; the rollback copies the version held here (no download). The lags are printed,
    not bounded: a registry behind a loaded machine's MLflow server answers when it can."""
    import mlflow

    downloads: list[str] = []
    download = MlflowAlias._download
    monkeypatch.setattr(MlflowAlias, "_download", lambda self, uri: downloads.append(uri) or download(self, uri))

    name = f"follow-{tmp_path.name}"
    poll = 0.25
    v1 = _register(mlflow_server, name, models[0][2], 0.3, None)
    assert v1 == f"models:/{name}/1"
    args = parse_args(
        [
            *("--follow", f"models:/{name}@champion", "--tracking-uri", mlflow_server, "--api-key", KEY),
            *("--poll-interval-s", str(poll), "--version", "1", "--staging", str(tmp_path / "serving")),
        ]
    )
    lags = {}
    with ProxyServer(build_app(args)) as server, Traffic(server.base_url) as traffic:
        at, health = wait_serving(server.url, v1)
        phases = [(at, 1, v1)]
        first = probe(server.base_url)
        wait_traffic(traffic, 1)
        t0 = time.time()
        v2 = _register(mlflow_server, name, models[1][2], 0.6, 0.3)  # register_if_better moves champion
        assert v2 == f"models:/{name}/2"
        at, health = wait_serving(server.url, v2)
        lags["v1->v2 (from registering, downloaded)"] = at - t0
        phases.append((at, 2, v2))
        second = probe(server.base_url)
        wait_traffic(traffic, 2)
        t0 = time.time()
        mlflow.MlflowClient(mlflow_server).set_registered_model_alias(name, "champion", "1")  # rollback
        at, health = wait_serving(server.url, v1)
        lags["v2->v1 (rollback, held here)"] = at - t0
        phases.append((at, 3, v1))
        assert health["ok"] and health["policy_version"] == 3
        assert [d["model_version"] for d in health["serving"]["delivered"]] == [v2, v1]
        wait_traffic(traffic, 3)
        third = probe(server.base_url)
    check_traffic(traffic, phases)
    assert (first["versions"][0], second["versions"][0], third["versions"][0]) == (1, 2, 3)
    assert third["model_version"] == first["model_version"] == v1 and second["model_version"] == v2
    assert third["logprobs"] == first["logprobs"] != second["logprobs"]  # v1's weights again
    assert downloads == [v1, v2], downloads  # each registered version downloaded once: the rollback was held here
    mixed = sum(len(set(r["versions"])) > 1 for r in traffic.responses)  # in flight across a swap
    print(f"{len(traffic.responses)} requests ({mixed} across a swap), {len(traffic.failures)} failed; lags {lags}")


def test_an_unreachable_registry_is_retried_at_the_next_poll(tmp_path, monkeypatch):
    """A registry that cannot be reached is SourceUnavailable (a WeightsError: the watcher logs it
    and polls again, the proxy serving what it has), never an error that stops following."""
    from areal_core.proxy.versions import SourceUnavailable, first_version
    from areal_core.weights import WeightsError
    from tests.conftest import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    source = make_source("models:/policy@champion", tracking_uri=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(SourceUnavailable, match="the registry cannot be read") as err:
        source.latest_version()
    assert isinstance(err.value, WeightsError)
    with pytest.raises(TimeoutError, match="named no version"):
        first_version(source, timeout_s=0.2, poll_s=0.05)
    source.close()
