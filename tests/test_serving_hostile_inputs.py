"""What one client or one publisher can do to everyone else's serving: an empty prompt is a 400
before any engine sees it; a request the engine fails on fails alone, not the requests batched with
it; an image too large is refused from its header, before its pixels are decoded; and a published
version that does not fit the model (wrong shapes, missing tensors, unknown names) is refused
before staging, so the served weights are never a mix of two versions."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
import torch
from PIL import Image, ImageFile

from areal_core.proxy.images import ImageRefused, decode_part
from areal_core.rollout.async_engine import AsyncEngine
from areal_core.rollout.engine import Generation, SamplingParams
from areal_core.rollout.local_engine import check_fits
from areal_core.weights import WeightsError
from tests.test_proxy_hostile import KEY_A, http, server, tok  # noqa: F401 - pytest fixtures

BAD = 999  # a token the engine below refuses


class Picky:
    """An in-process engine that fails a whole generate call when any prompt holds BAD."""

    version = 0

    def __init__(self):
        self.calls: list[int] = []

    def generate(self, prompts, params, mm=None):
        self.calls.append(len(prompts))
        if any(BAD in p for p in prompts):
            raise ValueError("a prompt this engine cannot run")
        return [Generation([7], [-0.1], [0], "stop") for _ in prompts]

    def load_version(self, version):
        pass


def test_a_request_the_engine_fails_on_fails_alone():
    engine = Picky()
    aengine = AsyncEngine(engine)
    params = SamplingParams(max_new_tokens=1)

    async def all_at_once():
        prompts = [[1, 2], [3, BAD], [4], [5, 6]]
        return await asyncio.gather(*(aengine.agenerate([p], params) for p in prompts), return_exceptions=True)

    try:
        out = asyncio.run(all_at_once())
    finally:
        aengine.close()
    assert engine.calls[0] == 4  # they were batched together, and that batch failed
    assert [type(o).__name__ for o in out] == ["list", "ValueError", "list", "list"]
    assert all(o[0].token_ids == [7] for o in out if isinstance(o, list))


@pytest.mark.parametrize(
    "prompt, status, code",
    [("", 422, "validation_error"), ([""], 400, "empty_prompt"), ([[]], 422, "validation_error")],
)
def test_an_empty_completion_prompt_is_a_4xx_in_the_error_shape(server, prompt, status, code):  # noqa: F811
    r = http(server, KEY_A).post("/completions", json={"model": "areal-policy", "prompt": prompt, "max_tokens": 2})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error" and "prompt" in error["message"]


def png_part(width: int, height: int) -> dict:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, format="PNG")
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()},
    }


def test_an_image_over_the_pixel_limit_is_refused_before_it_is_decoded(monkeypatch):
    big = png_part(2048, 2048)  # a few kB of PNG, 4 M pixels: 12 MB once decoded
    assert len(big["image_url"]["url"]) < 100_000

    def no_decoding(self):
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    with pytest.raises(ImageRefused, match="more than 1048576 pixels"):
        decode_part(big, "messages[0].content[0]", max_pixels=1 << 20)
    monkeypatch.undo()
    assert decode_part(png_part(64, 64), "m", max_pixels=1 << 20).image.size == (64, 64)


def test_a_version_that_does_not_fit_the_model_is_refused_before_staging():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as an LM head: a checkpoint holds it once
    full = {"0.weight": torch.zeros(10, 4)}
    check_fits(model, full, complete=True, version=3)  # the tied alias need not be given
    with pytest.raises(WeightsError, match="another shape: 0.weight"):
        check_fits(model, {"0.weight": torch.zeros(11, 4)}, complete=True, version=3)
    with pytest.raises(WeightsError, match="has not: extra"):
        check_fits(model, {**full, "extra": torch.zeros(1)}, complete=True, version=3)
    untied = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    with pytest.raises(WeightsError, match="lacks 1 of the model's tensors: 1.weight"):
        check_fits(untied, full, complete=True, version=3)
    check_fits(untied, full, complete=False, version=3)  # a LoRA version's adapted weights alone
    before = untied[0].weight.detach().clone()
    with pytest.raises(RuntimeError):  # what staging it anyway would do: copy what fits, then fail
        untied.load_state_dict({"1.weight": torch.ones(10, 4), "0.weight": torch.zeros(3, 4)}, strict=False)
    assert torch.equal(untied[0].weight, before) and untied[1].weight.eq(1).all()  # a mix of two versions


def test_the_proxy_answers_after_refusing(server):  # noqa: F811 - the fixture
    r = http(server, KEY_A).post("/completions", json={"model": "areal-policy", "prompt": "Ann has", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


def test_an_engine_failure_is_a_500_that_keeps_the_engines_text_in_the_server_log(tok, caplog):  # noqa: F811
    from areal_core.proxy.app import create_app
    from areal_core.proxy.examples import ScriptedEngine
    from areal_core.proxy.runner import ProxyServer

    def reply(prompt: str) -> str:
        if "gets" in prompt:
            raise RuntimeError("cannot open /srv/secret/weights.bin")
        return "ok"

    with ProxyServer(create_app(ScriptedEngine(tok, reply), tok, api_keys=[KEY_A])) as srv:
        client = http(srv, KEY_A)
        r = client.post("/completions", json={"model": "areal-policy", "prompt": "Ann gets", "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        message = r.json()["error"]["message"]
        assert "secret" not in message and "RuntimeError" not in message
        ref = message.split("(error ", 1)[1].split(";", 1)[0]
        assert any(ref in rec.getMessage() for rec in caplog.records)  # the reference finds the log line
        ok = client.post("/completions", json={"model": "areal-policy", "prompt": "Ann has", "max_tokens": 2})
        assert ok.status_code == 200
