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

    def __init__(self, abort_first: bool):
        self.bodies: list[dict] = []
        self.abort_first = abort_first

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
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
        real = httpx.AsyncClient

        def client(*args, **kw):
            kw["transport"] = httpx.MockTransport(handler)
            return real(*args, **kw)

        monkeypatch.setattr(remote_engine.httpx, "AsyncClient", client)

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


def test_an_unseeded_request_is_left_unseeded():
    params = SamplingParams(seed=None)
    assert request_params(params, 5) is params
    assert request_params(SamplingParams(seed=3), 5).seed == 8
