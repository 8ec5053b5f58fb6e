"""rollout.server.lora=auto asks the vLLM server at rollout.server.url for its device (the worker
extension's `device_type`, over a real HTTP connection to a local stand-in that answers
`/collective_rpc` as vLLM does): a CPU run driving a GPU server serves its LoRA versions natively,
a CPU server gets them merged, and a server that cannot say (an error status, garbage, an oversized
body) gets them merged with a warning naming the url; one that does not answer is an error naming it."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from areal_core.config import load_config
from areal_core.rollout.factory import build_remote_engine, server_device_for_lora, vllm_native_lora
from areal_core.rollout.vllm_engine import DEVICE_ANSWER_MAX_BYTES, VLLMEngineError, ask_server_device
from areal_core.store import Store


class StandIn(ThreadingHTTPServer):
    """A vLLM server's HTTP surface: `/collective_rpc` answers `device_type` with `answer` (status,
    body bytes); every other POST answers 200 {}. `calls` records (path, JSON body)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.answer: tuple[int, bytes] = (200, b'{"results": ["cuda"]}')
        self.calls: list[tuple[str, object]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: StandIn

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.calls.append((path, json.loads(raw) if raw else None))
        status, body = self.server.answer if path == "/collective_rpc" else (200, b"{}")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[StandIn]:
    srv = StandIn()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join()


def lora_cfg(url: str, *more: str):
    return load_config(None, ["rollout.engine=vllm", f"rollout.server.url={url}", "train.lora_rank=8", *more])


def test_a_cpu_run_driving_a_gpu_server_serves_lora_natively(server):
    cfg = lora_cfg(server.url)
    assert cfg.device == "cpu"
    assert vllm_native_lora(cfg) is False  # what the run's own device alone would choose
    assert server_device_for_lora(cfg) == "cuda"
    assert vllm_native_lora(cfg, None, server_device_for_lora(cfg)) is True
    assert server.calls == [("/collective_rpc", {"method": "device_type"})] * 2


def test_a_cpu_server_gets_merged_checkpoints_and_a_gpu_run_asks_too(server):
    server.answer = (200, b'{"results": ["cpu", "cpu"]}')
    cfg = lora_cfg(server.url, "device=cuda")
    assert vllm_native_lora(cfg, None, server_device_for_lora(cfg)) is False


@pytest.mark.parametrize(
    "mode,asked",
    [("native", False), ("merged", False), ("auto", True)],
)
def test_only_auto_asks(server, mode, asked):
    cfg = lora_cfg(server.url, f"rollout.server.lora={mode}")
    assert (server_device_for_lora(cfg) is not None) is asked
    assert bool(server.calls) is asked
    full = load_config(None, ["rollout.engine=vllm", f"rollout.server.url={server.url}"])  # full fine-tuning
    assert server_device_for_lora(full) is None


@pytest.mark.parametrize(
    "status,body,why",
    [
        (500, b"Internal Server Error: no method device_type", "HTTP 500"),  # no worker extension
        (404, b'{"detail": "Not Found"}', "HTTP 404"),  # an old vLLM without /collective_rpc
        (200, b"{not json", "no device type"),
        (200, b'{"results": []}', "no device type"),
        (200, b'{"results": [{"type": "cuda"}]}', "no device type"),
        (200, b'{"results": ["cuda; rm -rf /"]}', "no device type"),
        (200, b'{"results": ["' + b"c" * (DEVICE_ANSWER_MAX_BYTES + 10) + b'"]}', "over 65536 bytes"),
    ],
)
def test_a_server_that_cannot_say_gets_merged_with_a_warning(server, caplog, status, body, why):
    server.answer = (status, body)
    cfg = lora_cfg(server.url)
    assert ask_server_device(server.url)[1].startswith("an answer" if "over" in why else why)
    with caplog.at_level(logging.WARNING, logger="areal.rollout"):
        device = server_device_for_lora(cfg)
    assert device == "unknown"
    assert vllm_native_lora(cfg.model_copy(update={"device": "cuda"}), None, device) is False
    (record,) = [r for r in caplog.records if "did not say its device" in r.getMessage()]
    assert server.url in record.getMessage() and "merged" in record.getMessage()


def test_a_server_that_does_not_answer_is_an_error_naming_the_url():
    with socket.socket() as s:  # a port nothing listens on: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(VLLMEngineError, match=rf"{url}.*rollout.server.url"):
        server_device_for_lora(lora_cfg(url))


def test_the_engine_built_for_a_gpu_server_loads_the_adapter_by_name(server, tmp_path):
    """build_remote_engine end to end: a published adapter version, a CPU run, a server on cuda:
    the engine is native (the adapter is loaded as `v0`); on a CPU server it is merged (no adapter
    call, the engine reloads whole checkpoints)."""
    from areal_core.train.lora import adapter_files, apply_lora
    from areal_core.weights.publisher import WeightPublisher
    from benchmarks import tiny_checkpoints as tc

    store = Store(str(tmp_path / "run"))
    WeightPublisher(store, {"config.json": b"{}"}).publish_adapter(0, adapter_files(apply_lora(tc.model("llama"), 4)))
    engine = build_remote_engine(lora_cfg(server.url), store, 0, eos_id=2)
    try:
        assert engine.lora is True
        loads = [body for path, body in server.calls if path == "/v1/load_lora_adapter"]
        assert [b["lora_name"] for b in loads] == ["v0"]
    finally:
        engine.close()
    server.answer, server.calls = (200, b'{"results": ["cpu"]}'), []
    engine = build_remote_engine(lora_cfg(server.url), store, 0, eos_id=2)
    try:
        assert engine.lora is False
        assert [p for p, _ in server.calls] == ["/collective_rpc", "/update_weight_version"]
    finally:
        engine.close()
