"""The SGLang client against a stand-in server that implements SGLang's documented HTTP shapes.

SGLang cannot run here (no CPU kernels), so this is NOT a test against a live SGLang server:
the stand-in below answers `/generate`, `/pause_generation`, `/continue_generation`,
`/update_weights_from_disk`, `/flush_cache`, `/abort_request`, `/update_weight_version`,
`/get_weight_version` and `/health` with the request and response shapes of SGLang's
http_server.py / io_struct.py. Its "model" is a deterministic function of the weight file it
loaded and the token prefix, so the test can tell which weights produced each token.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from pathlib import Path

import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from safetensors.torch import save as st_save

from areal_core.layout import LAYOUT
from areal_core.procs import free_port
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.sglang_engine import SGLangEngine, SGLangEngineError
from areal_core.store import Store
from areal_core.weights import WEIGHTS_FILE, WeightsError
from areal_core.weights.publisher import publish

VOCAB = 50
STEP_S = 0.004  # stand-in decode time per token


def fake_token(weights_key: str, prefix: list[int]) -> tuple[int, float]:
    """The stand-in model: next token and its log-prob from (weights, prefix)."""
    h = hashlib.sha256(f"{weights_key}:{prefix[-3:]}:{len(prefix)}".encode()).digest()
    return h[0] % VOCAB, -(1 + h[1] % 50) / 10.0


class StandIn:
    """A minimal server with SGLang's native API shapes; one decode loop per request."""

    def __init__(self, initial_model: Path):
        self.weights_key = self._key(initial_model)
        self.weight_version = "default"
        self.paused = False
        self.abort_gen = 0
        self.tokens_out = 0
        self.loaded_paths: list[str] = []
        # (tokens, updates): once `tokens` are out, requests wait until the weights are updated past
        # `updates` or they are aborted, so a test's mid-flight action never races their end (issue 46)
        self.hold: tuple[int, int] | None = None
        self.updates = 0
        self.calls: list[str] = []
        app = FastAPI()

        @app.middleware("http")
        async def record(request: Request, call_next):
            self.calls.append(request.url.path)
            return await call_next(request)

        @app.get("/health")
        async def health():
            return Response(status_code=200)

        @app.get("/get_weight_version")
        async def get_weight_version():
            return {"weight_version": self.weight_version}

        @app.post("/update_weight_version")
        async def update_weight_version(body: dict):
            self.weight_version = body["new_version"]
            return {"success": True, "message": "ok", "new_version": body["new_version"]}

        @app.post("/generate")
        async def generate(body: dict):
            ids = list(body["input_ids"])
            sp = body["sampling_params"]
            assert body["return_logprob"] is True
            while self.paused:  # requests that arrive while paused wait for continue_generation
                await asyncio.sleep(0.002)
            gen = self.abort_gen
            out: list[list] = []
            finish = {"type": "length", "length": sp["max_new_tokens"]}
            for _ in range(sp["max_new_tokens"]):
                while self.held(gen):
                    await asyncio.sleep(0.002)
                await asyncio.sleep(STEP_S)
                if gen != self.abort_gen:
                    finish = {"type": "abort", "message": "Abort in running batch."}
                    break
                tok, lp = fake_token(self.weights_key, ids)
                ids.append(tok)
                out.append([lp, tok, None])
                self.tokens_out += 1
                if tok in sp.get("stop_token_ids", []):
                    finish = {"type": "stop", "matched": tok}
                    break
            meta = {
                "id": "rid",
                "finish_reason": finish,
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(out),
                "weight_version": self.weight_version,
                "output_token_logprobs": out,
            }
            return {"text": "", "output_ids": [o[1] for o in out], "meta_info": meta}

        @app.post("/pause_generation")
        async def pause_generation(body: dict):
            assert body.get("mode", "abort") in ("abort", "retract", "in_place")
            if body.get("mode", "abort") == "abort":
                self.abort_gen += 1
            self.paused = True
            await asyncio.sleep(3 * STEP_S)  # aborted requests answer before this returns
            return {"message": "Generation paused successfully.", "status": "ok"}

        @app.post("/continue_generation")
        async def continue_generation(body: dict):
            self.paused = False
            return {"message": "Generation continued successfully.", "status": "ok"}

        @app.post("/abort_request")
        async def abort_request(body: dict):
            assert body.get("abort_all") is True
            self.abort_gen += 1
            return Response(status_code=200)

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache():
            return Response(content="Cache flushed.\n", status_code=200)

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(body: dict):
            path = Path(body["model_path"])
            if not (path / WEIGHTS_FILE).is_file():
                content = {"success": False, "message": f"no weights at {path}", "num_paused_requests": 0}
                return JSONResponse(content, status_code=400)
            self.weights_key = self._key(path)
            self.loaded_paths.append(str(path))
            self.updates += 1
            if body.get("weight_version") is not None:
                self.weight_version = body["weight_version"]
            return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def held(self, gen: int) -> bool:
        """A request of abort generation `gen` waits here (see `hold`)."""
        if self.hold is None or gen != self.abort_gen:
            return False
        tokens, updates = self.hold
        return self.tokens_out >= tokens and self.updates == updates

    @staticmethod
    def _key(model_dir: Path) -> str:
        return hashlib.sha256((Path(model_dir) / WEIGHTS_FILE).read_bytes()).hexdigest()

    def __enter__(self) -> StandIn:
        self.thread.start()
        deadline = time.time() + 120  # the server's start: only a hang reaches this
        while not self.server.started:
            assert time.time() < deadline
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def weights(tag: str) -> bytes:
    """A real (tiny) safetensors file per tag: staging parses the header before a server loads it."""
    return st_save({"tag": torch.tensor(list(tag.encode()), dtype=torch.uint8)})


@pytest.fixture
def setup(tmp_path):
    store = Store(str(tmp_path / "run"))
    side = {"config.json": b"{}"}
    publish(store, 0, weights("A"), side)
    init = tmp_path / "init"
    init.mkdir()
    (init / WEIGHTS_FILE).write_bytes(weights("A"))
    with StandIn(init) as server:
        engine = SGLangEngine(server.url, 0, eos_id=None, store=store)
        yield store, side, server, engine
        engine.close()


def wait_tokens(server: StandIn, n: int) -> None:
    deadline = time.time() + 60
    while server.tokens_out < n:
        assert time.time() < deadline, "stand-in produced no tokens"
        time.sleep(0.01)


def expected(weights_key_by_version: dict[int, str], prompt: list[int], gen) -> list[tuple[int, float]]:
    ids = list(prompt)
    out = []
    for v in gen.versions:
        out.append(fake_token(weights_key_by_version[v], ids))
        ids.append(out[-1][0])
    return out


def test_generate_shapes_tokens_logprobs_versions(setup):
    store, side, server, engine = setup
    assert server.weight_version == "0"  # the engine labels the server's weights with its version
    prompts = [[1, 2, 3], [4, 5]]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    keys = {0: hashlib.sha256(weights("A")).hexdigest()}
    for p, g in zip(prompts, gens):
        assert len(g.token_ids) == 6 and g.finish_reason == "length" and g.versions == [0] * 6
        assert list(zip(g.token_ids, g.logprobs)) == expected(keys, p, g)
    health = engine.health()
    assert health["ok"] and health["server_version"] == "0"


def test_update_midflight_continues_under_new_weights(setup):
    store, side, server, engine = setup
    publish(store, 1, weights("B"), side)
    box: dict = {}
    server.hold = (4 * 5, server.updates)  # the requests wait there for the update: it lands mid-flight
    t = threading.Thread(
        target=lambda: box.update(g=engine.generate([[1, 2, 3]] * 4, SamplingParams(max_new_tokens=60)))
    )
    t.start()
    wait_tokens(server, 4 * 5)
    assert engine.receive(store, 1) is True
    t.join(timeout=120)
    keys = {0: hashlib.sha256(weights("A")).hexdigest(), 1: hashlib.sha256(weights("B")).hexdigest()}
    for g in box["g"]:
        assert len(g.token_ids) == 60 and g.finish_reason == "length"
        assert g.versions == sorted(g.versions) and g.versions[0] == 0 and g.versions[-1] == 1
        assert list(zip(g.token_ids, g.logprobs)) == expected(keys, [1, 2, 3], g)
    # the documented sequence, in order: pause (abort), update from the verified staged copy, flush, continue
    control = [c for c in server.calls if c not in ("/generate", "/health", "/get_weight_version")]
    assert control[-4:] == ["/pause_generation", "/update_weights_from_disk", "/flush_cache", "/continue_generation"]
    assert server.loaded_paths[-1].startswith(str(engine.staging_dir)) and server.weight_version == "1"
    assert engine.version == 1 and engine.swaps == 1


def test_user_abort_returns_partial(setup):
    store, side, server, engine = setup
    box: dict = {}
    server.hold = (3 * 3, server.updates)  # the requests wait there for the abort: never done before it
    t = threading.Thread(target=lambda: box.update(g=engine.generate([[7, 8]] * 3, SamplingParams(max_new_tokens=200))))
    t.start()
    wait_tokens(server, 3 * 3)
    engine.abort()
    t.join(timeout=120)
    for g in box["g"]:
        assert g.finish_reason == "abort" and 0 < len(g.token_ids) < 200


def test_stop_token_and_corrupt_version_refused(setup):
    store, side, server, engine = setup
    free = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=10))[0].token_ids
    g = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=10, stop_token_ids=[free[3]]))[0]
    assert g.finish_reason == "stop" and g.token_ids == free[: free.index(free[3]) + 1]
    publish(store, 2, weights("C"), side)
    store.write_bytes(LAYOUT.weights_file(2, WEIGHTS_FILE), weights("tampered"))
    with pytest.raises(WeightsError, match="sha256"):
        engine.receive(store, 2)
    assert "/pause_generation" not in server.calls  # refused before the server was touched
    assert engine.version == 0 and server.weight_version == "0"


def test_server_errors_are_clear(setup):
    store, side, server, engine = setup
    engine.url = "http://127.0.0.1:1"
    with pytest.raises(SGLangEngineError, match="/generate"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2))
