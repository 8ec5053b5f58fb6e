"""The proxy serving a vision-language model, driven with the real `openai` SDK: OpenAI `image_url`
parts holding data URIs reach the torch engine as the prompt's vision placeholders and pixel
values; every bad image (truncated, corrupt, bad base64, an http URL, another media type, too
many, too large, sent to a text model) is a 400 in the error shape and the proxy keeps serving;
and an ended session's row names its images by id, stored byte for byte under the run root, so
the trainer rebuilds the pixels the engine saw (its log-probs equal the behaviour log-probs)."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
import torch
from PIL import Image

from areal_core.config import RunConfig
from areal_core.models import build_tokenizer
from areal_core.protocol import read_shard_or_quarantine
from areal_core.proxy.app import create_app
from areal_core.proxy.examples import ScriptedEngine
from areal_core.proxy.guard import ProxyLimits
from areal_core.proxy.runner import ProxyServer
from areal_core.rollout.torch_engine import TorchEngine
from areal_core.store import Store
from areal_core.train.batch import collate
from areal_core.train.step import policy_logprobs
from areal_core.vlm.images import ImageCache, encode_png, image_id, read_image_bytes
from areal_core.vlm.inputs import MultimodalRows, PlaceholderCheck, pad_runs
from areal_core.vlm.model import VISION_START
from tests.test_vlm_model import picture, tiny

KEY = "sk-test-images"
QUESTION = "how many red shapes?"
PADS = 16  # a 64² image, 8-pixel patches merged 2×2


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class RecordingEngine(TorchEngine):
    """The torch engine, keeping the `mm` of each generate call (what the engine really received)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.received: list = []

    def generate(self, prompts, params, mm=None):
        self.received.append(mm)
        return super().generate(prompts, params, mm=mm)


@pytest.fixture(scope="module")
def vlm():
    return tiny()


@pytest.fixture(scope="module")
def server(vlm, tmp_path_factory):
    model, processor = vlm
    engine = RecordingEngine(model, processor.pad_token_id, processor.eos_token_id, version=2, seed=0)
    store = Store(str(tmp_path_factory.mktemp("run")))
    app = create_app(engine, processor, store=store, api_keys=[KEY], limits=ProxyLimits(max_images=2))
    with ProxyServer(app) as srv:
        srv.engine, srv.store, srv.processor = engine, store, processor
        yield srv


def sdk(server: ProxyServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


def png(colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    return encode_png(picture(colour=colour))


def jpeg(colour: tuple[int, int, int] = (30, 30, 200)) -> bytes:
    buf = io.BytesIO()
    picture(colour=colour).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_message(*urls: str, text: str = QUESTION) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def ask(server: ProxyServer, messages: list[dict], sid: str, max_tokens: int = 4):
    return sdk(server).chat.completions.create(
        model="m", messages=messages, max_tokens=max_tokens, temperature=0, extra_headers={"X-Session-Id": sid}
    )


def test_an_image_request_is_served_with_its_pixels(server):
    processor = server.processor
    image = png()
    r = ask(server, [image_message(data_uri(image))], "img-a")
    assert r.choices[0].finish_reason in ("stop", "length") and r.areal["token_ids"]
    prompt = r.areal["prompt_token_ids"]
    # the prompt the single-turn workflow feeds for the same question and picture (processor.encode)
    want, want_mm = processor.encode(QUESTION, [Image.open(io.BytesIO(image))])
    assert prompt == want
    assert pad_runs(prompt, processor.image_token_id) == [PADS]
    assert prompt.count(processor.tokenizer.convert_tokens_to_ids(VISION_START)) == 1
    got = server.engine.received[-1]
    assert got is not None and len(got) == 1
    assert torch.equal(got[0].pixel_values, want_mm.pixel_values)
    assert got[0].image_grid_thw.tolist() == [[1, 8, 8]]

    text_only = ask(server, [{"role": "user", "content": QUESTION}], "img-b")
    assert processor.image_token_id not in text_only.areal["prompt_token_ids"]
    assert server.engine.received[-1] is None  # a text turn calls the engine without images
    # another picture with the same text: the engine saw the pixels, so the behaviour log-probs move
    other = ask(server, [image_message(data_uri(png((20, 200, 20))))], "img-c")
    assert other.areal["prompt_token_ids"] == prompt
    assert abs(other.areal["logprobs"][0] - r.areal["logprobs"][0]) > 1e-4 or (
        other.areal["token_ids"][0] != r.areal["token_ids"][0]
    )


def _gif() -> bytes:
    buf = io.BytesIO()
    picture().save(buf, format="GIF")
    return buf.getvalue()


def _too_many_pixels() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (4097, 4097)).save(buf, format="PNG")  # a few KB, but 4097² pixels
    return buf.getvalue()


def _elongated() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4096, 16)).save(buf, format="PNG")  # valid, but Qwen's smart_resize refuses 256:1
    return buf.getvalue()


def _over_the_proxy_limit() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (1025, 1024)).save(buf, format="PNG")  # storable (under 4096²), but over --max-image-pixels
    return buf.getvalue()


BAD = {
    "over_max_image_pixels": ([image_message(data_uri(_over_the_proxy_limit()))], "invalid_image", "1048576 pixels"),
    "elongated": ([image_message(data_uri(_elongated()))], "invalid_image", "more elongated than 200:1"),
    "truncated": ([image_message(data_uri(png()[: len(png()) // 2]))], "invalid_image", "undecodable PNG"),
    "corrupt": ([image_message(data_uri(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64))], "invalid_image", "undecodable"),
    "not_an_image": ([image_message(data_uri(b"hello, world"))], "invalid_image", "not a PNG or JPEG"),
    "bad_base64": ([image_message("data:image/png;base64,iVBOR$$w0KGgo=")], "invalid_image", "base64"),
    "http_url": ([image_message("https://example.com/cat.png")], "invalid_image_url", "not fetched"),
    "not_a_data_uri": ([image_message("cat.png")], "invalid_image_url", "not a data URI"),
    "gif": ([image_message(data_uri(_gif(), "image/gif"))], "invalid_image", "image/gif"),
    "too_many": ([image_message(*[data_uri(png())] * 3)], "too_many_images", "3 images in the request exceed"),
    "too_many_pixels": ([image_message(data_uri(_too_many_pixels()))], "invalid_image", "4097×4097 image has more"),
    "assistant_image": (
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": data_uri(png())}}]},
            {"role": "user", "content": "again"},
        ],
        "invalid_image",
        "only user messages",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_image_is_a_400_in_the_error_shape_and_the_proxy_keeps_serving(server, case):
    messages, code, phrase = BAD[case]
    created = server.app.state.sessions.counters["created"]
    with pytest.raises(openai.BadRequestError) as exc:
        ask(server, messages, f"bad-{case}")
    assert exc.value.status_code == 400
    body = exc.value.body
    assert body["type"] == "invalid_request_error" and body["code"] == code, body
    assert phrase in body["message"], body["message"]
    assert server.app.state.sessions.counters["created"] == created  # refused before any session opened
    r = ask(server, [image_message(data_uri(png()))], f"after-{case}")
    assert r.areal["token_ids"] and pad_runs(r.areal["prompt_token_ids"], server.processor.image_token_id) == [PADS]


def test_an_image_to_a_text_model_is_a_400():
    tok = build_tokenizer(["how many red shapes? 3"], 300)
    app = create_app(ScriptedEngine(tok, lambda _: "3"), tok, api_keys=[KEY])
    with ProxyServer(app) as srv:
        with pytest.raises(openai.BadRequestError) as exc:
            ask(srv, [image_message(data_uri(png()))], "text-1")
        assert exc.value.body["code"] == "images_unsupported" and "vision-language" in exc.value.body["message"]
        assert ask(srv, [{"role": "user", "content": QUESTION}], "text-2").choices[0].message.content == "3"


def test_vision_tokens_in_a_text_prompt_are_a_400(server):
    with pytest.raises(openai.BadRequestError) as exc:
        sdk(server).completions.create(model="m", prompt=[server.processor.image_token_id] * 3, max_tokens=2)
    assert exc.value.body["code"] == "invalid_token_id" and "stand for no image" in exc.value.body["message"]
    typed = ask(server, [{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>?"}], "typed")
    assert server.processor.image_token_id not in typed.areal["prompt_token_ids"]  # typed: encoded as text


def test_the_recorded_row_names_its_images_stored_byte_for_byte(server):
    processor, store = server.processor, server.store
    first, second = png(), jpeg()
    history = [image_message(data_uri(first))]
    r1 = ask(server, history, "rec-1", max_tokens=3)
    history += [{"role": "assistant", "content": r1.choices[0].message.content}]
    history += [image_message(data_uri(second, "image/jpeg"), text="and now?")]
    r2 = ask(server, history, "rec-1", max_tokens=3)
    assert r2.areal["segment"] == r1.areal["segment"] == 0  # the turn continued the conversation's row
    assert r2.areal["prompt_token_ids"][: len(r1.areal["prompt_token_ids"])] == r1.areal["prompt_token_ids"]
    assert pad_runs(r2.areal["prompt_token_ids"], processor.image_token_id) == [PADS, PADS]
    assert len(server.engine.received[-1][0].image_grid_thw) == 2  # the whole prompt's images, re-prefilled

    ended = httpx.post(
        f"{server.base_url}/sessions/rec-1/end",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"reward": 1.0, "return_trajectory": True},
    ).json()
    assert ended["trajectories"][0]["image_ids"] == [image_id(first), image_id(second)]
    (shard,) = ended["shards"]
    (row,) = read_shard_or_quarantine(store, shard)  # not quarantined: its images are there and decode
    assert row.image_ids == [image_id(first), image_id(second)]
    assert read_image_bytes(store, row.image_ids[0]) == first
    assert read_image_bytes(store, row.image_ids[1]) == second
    assert row.input_ids == r2.areal["prompt_token_ids"] + r2.areal["token_ids"]
    images = ImageCache([store])
    assert PlaceholderCheck(processor, images)(row) is None  # one pad run per image, as long as its patches
    # the trainer rebuilds the pixels from the ids: its log-probs equal the engine's behaviour log-probs
    batch = collate([row], processor.pad_token_id)
    rows = MultimodalRows.from_samples([row], processor, images)
    model = server.engine.model
    with torch.no_grad():
        logp = policy_logprobs(model, batch, None, RunConfig(), processor.pad_token_id, mm=rows)
    mask = batch.loss_mask.bool()
    assert int(mask.sum()) == len(r1.areal["token_ids"]) + len(r2.areal["token_ids"])
    torch.testing.assert_close(logp[mask], batch.behav_logprobs[mask], atol=2e-4, rtol=1e-4)
