"""Verified staging for remote engines, vLLM version spans, the weight watcher, and the config keys."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
from safetensors.torch import save as st_save

from areal_core.config import ConfigError, load_config
from areal_core.layout import LAYOUT
from areal_core.rollout.vllm_engine import VLLMEngineError, expand_spans
from areal_core.rollout.vllm_server import VLLMServerSpec, server_command, server_env
from areal_core.store import Store
from areal_core.weights import WEIGHTS_FILE, WeightsError
from areal_core.weights.publisher import publish
from areal_core.weights.reader import prune_staged, stage_verified
from areal_core.weights.watcher import WeightWatcher


def safetensors_of(tag: int) -> bytes:
    """A real (tiny) safetensors file: staging checks that the weights file parses."""
    return st_save({"w": torch.full((4,), float(tag))})


def test_staging_refuses_a_weights_file_that_is_not_safetensors(tmp_path):
    s = Store(str(tmp_path / "run"))
    publish(s, 0, b"weights-0" * 100, {"config.json": b"{}"})  # its digest matches: only the parse can tell
    with pytest.raises(WeightsError, match="not a valid safetensors file"):
        stage_verified(s, 0, tmp_path / "stage")
    assert not any((tmp_path / "stage").iterdir())


@pytest.fixture
def store(tmp_path) -> Store:
    s = Store(str(tmp_path / "run"))
    publish(s, 0, safetensors_of(0), {"config.json": b'{"a": 1}', "tokenizer.json": b"{}"})
    return s


def test_stage_verified_copies_every_manifest_file(store, tmp_path):
    path = stage_verified(store, 0, tmp_path / "stage")
    assert path.name == "v000000"
    assert (path / WEIGHTS_FILE).read_bytes() == safetensors_of(0)
    assert (path / "config.json").read_bytes() == b'{"a": 1}'
    assert hashlib.sha256((path / "tokenizer.json").read_bytes()).hexdigest() == hashlib.sha256(b"{}").hexdigest()
    assert stage_verified(store, 0, tmp_path / "stage") == path  # staged once


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda s: s.write_bytes(LAYOUT.weights_file(0, WEIGHTS_FILE), b"tampered"), "model.safetensors fails"),
        (lambda s: s.write_bytes(LAYOUT.weights_file(0, "config.json"), b"{}"), "config.json fails"),
        (lambda s: s.delete(LAYOUT.weights_file(0, "tokenizer.json")), "tokenizer.json is missing"),
        (lambda s: s.delete(LAYOUT.manifest(0)), "no MANIFEST.json"),
        (lambda s: s.write_text(LAYOUT.manifest(0), "{oops"), "not JSON"),
        (lambda s: s.write_json(LAYOUT.manifest(0), {"version": 0, "files": {}}), "lists no"),
        (
            lambda s: s.write_json(LAYOUT.manifest(0), {"version": 3, "files": {WEIGHTS_FILE: "x"}}),
            "names version 3",
        ),
        (
            lambda s: s.write_json(LAYOUT.manifest(0), {"version": 0, "files": {WEIGHTS_FILE: "x", "../evil": "y"}}),
            "unsafe",
        ),
    ],
)
def test_stage_verified_refuses_and_leaves_nothing(store, tmp_path, damage, match):
    damage(store)
    with pytest.raises(WeightsError, match=match):
        stage_verified(store, 0, tmp_path / "stage")
    stage = tmp_path / "stage"
    assert not stage.exists() or not any(stage.iterdir())


def test_prune_staged_keeps_only_named_versions(store, tmp_path):
    publish(store, 1, safetensors_of(1), {"config.json": b"{}"})
    stage_verified(store, 0, tmp_path / "st")
    stage_verified(store, 1, tmp_path / "st")
    prune_staged(tmp_path / "st", {1})
    assert sorted(p.name for p in (tmp_path / "st").iterdir()) == ["v000001"]


def test_expand_spans():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert expand_spans(spans, 5) == [3, 3, 4, 4, 4]
    assert expand_spans(None, 0) == []
    with pytest.raises(VLLMEngineError, match="without weight_versions"):
        expand_spans(None, 2)
    with pytest.raises(VLLMEngineError, match="cover 5 tokens"):
        expand_spans(spans, 6)
    with pytest.raises(VLLMEngineError, match="not a policy version"):
        expand_spans([{"version": "default", "start": 0, "end": 1}], 1)


def test_server_command_and_env_carry_the_workarounds():
    spec = VLLMServerSpec(kv_cache_mb=64)
    cmd = server_command(spec, "/m", 1234)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enforce-eager", "--enable-scale-out", "--worker-extension-cls"):
        assert flag in cmd
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(64 * 2**20)
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    env = server_env(spec)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1"


class FakeEngine:
    def __init__(self, fail_on: int | None = None):
        self.version, self.loaded, self.fail_on = 0, [], fail_on

    def receive(self, store, version):
        if version == self.fail_on:
            raise RuntimeError("server died")
        self.loaded.append(version)
        self.version = version


def test_watcher_delivers_new_versions_and_reports_failures(store):
    engine = FakeEngine()
    w = WeightWatcher(store, lambda v: engine.receive(store, v), 0.01, version=engine.version)
    w.start()
    publish(store, 2, b"w2", {})
    deadline = time.time() + 120  # polls every 10 ms: only a hang reaches this
    while engine.version != 2 and time.time() < deadline:
        time.sleep(0.01)
    assert engine.loaded == [2] and w.wait(0) and w.version == 2
    w.stop()
    broken = FakeEngine(fail_on=2)
    w = WeightWatcher(store, lambda v: broken.receive(store, v), 0.01, version=broken.version)
    w.start()
    deadline = time.time() + 120
    while w.alive() and time.time() < deadline:
        time.sleep(0.01)
    assert not w.alive() and "server died" in str(w.error)


def test_watcher_retries_a_version_that_fails_its_checks(store):
    publish(store, 1, b"w1", {})
    seen: list[int] = []

    def on_version(v: int) -> None:  # a version racing its publication: refused twice, then taken
        seen.append(v)
        if len(seen) < 3:
            raise WeightsError(f"weights v{v}: model.safetensors fails its sha256 check")

    w = WeightWatcher(store, on_version, 0.01, version=0).start()
    deadline = time.time() + 120
    while w.version != 1 and time.time() < deadline:
        time.sleep(0.01)
    w.stop()
    assert seen == [1, 1, 1] and w.version == 1 and w.error is None


def test_config_remote_engines():
    cfg = load_config("configs/default.yaml", ["rollout.engine=vllm", "rollout.server.url=http://h:1"])
    assert cfg.rollout.engine == "vllm" and cfg.rollout.server.interrupt == "keep"
    with pytest.raises(ConfigError, match="rollout.server.url' is required when rollout.engine is sglang"):
        load_config("configs/default.yaml", ["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match="no vLLM interpreter at /nope/python"):
        load_config("configs/default.yaml", ["rollout.engine=vllm", "rollout.server.python=/nope/python"])
    with pytest.raises(ConfigError, match="rollout.server.interrupt"):
        load_config("configs/default.yaml", ["rollout.server.interrupt=sometimes"])
