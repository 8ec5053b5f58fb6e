"""SGLang rollout engine: a client of SGLang's native HTTP API at a given URL.

UNVERIFIED against a live SGLang server: SGLang has no CPU kernels, so it cannot run on
the machines this project is developed and tested on. The client is written to SGLang's
documented request and response shapes (python/sglang/srt/entrypoints/http_server.py and
managers/io_struct.py) and tested against a stand-in server that implements exactly those
shapes (tests/test_sglang_engine.py). See docs/vllm.md, "SGLang".

Calls used:

- `POST /generate` `{"input_ids": [...], "sampling_params": {...}, "return_logprob": true,
  "logprob_start_len": -1, "top_logprobs_num": 0}` →
  `{"text", "output_ids", "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort", ...},
  "output_token_logprobs": [[logprob, token_id, text|null], ...], "weight_version": "N", ...}}`
- `POST /pause_generation` `{"mode": "abort"}` → in-flight requests return now with
  `finish_reason.type == "abort"` and their tokens so far; new requests wait.
- `POST /update_weights_from_disk` `{"model_path": dir, "weight_version": "N", "flush_cache": true}`
  → `{"success": bool, "message": str, "num_paused_requests": int}` (400 on failure).
- `POST /flush_cache` → 200, or 400 while requests still hold cache.
- `POST /continue_generation` `{}`; `POST /abort_request` `{"abort_all": true}`;
  `GET /health`; `GET /get_weight_version` → `{"weight_version": "N"}`.

Versions per segment: SGLang reports one `weight_version` per response, not per token, so the
engine updates weights on the abort path only. A pause aborts every in-flight request; the
engine re-submits each as prompt + tokens so far; the continuation waits for
`/continue_generation` and runs under the new weights. No segment spans an update: an aborted
segment's tokens carry the version the engine held when it was submitted (it was in flight
before the pause), a finished segment's tokens the `weight_version` of its own response.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx

from areal_core.rollout.engine import Generation, SamplingParams
from areal_core.rollout.remote_weights import prune_staged, stage_verified
from areal_core.store import Store

log = logging.getLogger("areal.rollout.sglang")
logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per generate request


class SGLangEngineError(RuntimeError):
    """A request or control call to the SGLang server failed; the message names the call."""


class SGLangEngine:
    """RolloutEngine over an SGLang server; `generate` and `update_from_store` may overlap."""

    def __init__(
        self,
        url: str,
        version: int,
        eos_id: int | None,
        *,
        staging_dir: str | Path | None = None,
        store: Store | None = None,
        request_timeout_s: float = 900.0,
        max_concurrency: int = 256,
        set_version: bool = True,
    ):
        self.url = url.rstrip("/")
        self.version = version
        self.eos_id = eos_id
        self.store = store
        self.request_timeout_s = request_timeout_s
        self.max_concurrency = max_concurrency
        self._own_staging = staging_dir is None
        self.staging_dir = Path(staging_dir or tempfile.mkdtemp(prefix="areal-sglang-weights-"))
        self.swaps = 0
        self.last_update: dict = {}
        self._update_lock = threading.Lock()
        self._abort_epoch = 0
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(request_timeout_s, connect=10.0))
        if set_version:  # the server must be serving `version` already (e.g. started on weights/v{version})
            self._call("POST", "/update_weight_version", json={"new_version": str(version)})

    def close(self) -> None:
        self._http.close()
        if self._own_staging:
            shutil.rmtree(self.staging_dir, ignore_errors=True)

    # -- control calls ------------------------------------------------------------------
    def _call(self, method: str, path: str, ok=(200,), **kw) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise SGLangEngineError(f"SGLang {method} {path} at {self.url} failed: {exc!r}") from exc
        if r.status_code not in ok:
            raise SGLangEngineError(f"SGLang {method} {path} at {self.url}: HTTP {r.status_code} {r.text[:300]}")
        return r

    def pause(self, mode: str = "abort") -> None:
        self._call("POST", "/pause_generation", json={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/continue_generation", json={})

    def abort(self) -> None:
        """End every in-flight request; each returns its tokens so far with finish_reason 'abort'."""
        self._abort_epoch += 1
        self._call("POST", "/abort_request", json={"abort_all": True})

    def flush_cache(self, attempts: int = 20, wait_s: float = 0.1) -> None:
        """Flush the radix cache; SGLang answers 400 while requests still hold cache, so retry a little."""
        for _ in range(attempts):
            if self._call("POST", "/flush_cache", ok=(200, 400)).status_code == 200:
                return
            time.sleep(wait_s)
        raise SGLangEngineError(f"SGLang /flush_cache at {self.url} kept answering 400")

    def server_version(self) -> str:
        return str(self._call("GET", "/get_weight_version").json()["weight_version"])

    def health(self) -> dict:
        out = {"ok": False, "engine": "sglang", "url": self.url, "version": self.version, "swaps": self.swaps}
        try:
            out["ok"] = self._http.get("/health", timeout=30.0).status_code == 200
            out["server_version"] = self.server_version()
            out["ok"] = out["ok"] and out["server_version"] == str(self.version)
        except (httpx.HTTPError, SGLangEngineError) as exc:
            out["error"] = str(exc).splitlines()[0]
        return out

    # -- weights ------------------------------------------------------------------------
    def load_version(self, version: int) -> None:
        if version == self.version:
            return
        if self.store is None:
            raise SGLangEngineError("load_version needs the engine's store; use update_from_store")
        self.update_from_store(self.store, version)

    def update_from_store(self, store: Store, version: int) -> bool:
        """Verified staging, pause (abort), update from disk, flush, continue. False if not newer."""
        if version <= self.version:
            return False
        t0 = time.perf_counter()
        path = stage_verified(store, version, self.staging_dir)
        t_staged = time.perf_counter()
        with self._update_lock:
            if version <= self.version:
                return False
            self.pause("abort")
            t_paused = time.perf_counter()
            try:
                r = self._call(
                    "POST",
                    "/update_weights_from_disk",
                    ok=(200, 400),
                    json={"model_path": str(path), "weight_version": str(version), "flush_cache": True},
                )
                body = r.json()
                if r.status_code != 200 or not body.get("success", False):
                    raise SGLangEngineError(f"SGLang update_weights_from_disk v{version} failed: {body.get('message')}")
                self.flush_cache()
                self.version = version
                self.swaps += 1
            finally:
                self.resume()
            t_done = time.perf_counter()
        prune_staged(self.staging_dir, {version})
        self.last_update = {"version": version, "stage_s": t_staged - t0, "paused_s": t_done - t_paused}
        return True

    # -- generation ---------------------------------------------------------------------
    def _sampling(self, params: SamplingParams, max_new: int) -> dict:
        stops = set(params.stop_token_ids)
        if self.eos_id is not None:
            stops.add(self.eos_id)
        sp: dict = {
            "max_new_tokens": max_new,
            "stop_token_ids": sorted(stops),
            "ignore_eos": self.eos_id is None,
            "skip_special_tokens": False,
        }
        if params.greedy or params.temperature == 0:
            sp["temperature"] = 0.0
        else:
            sp["temperature"] = params.temperature
            sp["top_p"] = params.top_p
            if params.top_k > 0:
                sp["top_k"] = params.top_k
        if params.stop:
            sp["stop"] = list(params.stop)
        return sp

    @staticmethod
    def _segment_version(meta: dict, fallback: int) -> int:
        v = meta.get("weight_version")
        try:
            return int(v) if v is not None else fallback
        except (TypeError, ValueError):
            raise SGLangEngineError(f"weight_version {v!r} is not a policy version") from None

    async def _one(self, client: httpx.AsyncClient, sem: asyncio.Semaphore, prompt: list[int], params: SamplingParams):
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        epoch = self._abort_epoch
        while True:
            body = {
                "input_ids": list(prompt) + tokens,
                "sampling_params": self._sampling(params, params.max_new_tokens - len(tokens)),
                "return_logprob": True,
                "logprob_start_len": -1,  # output tokens only
                "top_logprobs_num": 0,
                "stream": False,
            }
            v_submit = self.version
            async with sem:
                try:
                    r = await client.post("/generate", json=body)
                except httpx.HTTPError as exc:
                    raise SGLangEngineError(f"SGLang /generate at {self.url} failed: {exc!r}") from exc
            if r.status_code != 200:
                raise SGLangEngineError(f"SGLang /generate at {self.url}: HTTP {r.status_code} {r.text[:300]}")
            out = r.json()
            out = out[0] if isinstance(out, list) else out
            meta = out.get("meta_info") or {}
            pairs = meta.get("output_token_logprobs") or []
            new = [int(p[1]) for p in pairs]
            if "output_ids" in out and out["output_ids"] != new:
                raise SGLangEngineError("output_ids and output_token_logprobs disagree")
            finish = ((meta.get("finish_reason") or {}).get("type")) or "length"
            # An aborted segment was in flight when a pause came, so it ran under the weights
            # of its submission; a finished one ran under one version, the one it reports.
            seg_version = v_submit if finish == "abort" else self._segment_version(meta, v_submit)
            tokens += new
            logprobs += [float(p[0]) for p in pairs]
            versions += [seg_version] * len(new)
            interrupted = finish == "abort" and epoch == self._abort_epoch and len(tokens) < params.max_new_tokens
            if not interrupted:
                return Generation(tokens, logprobs, versions, finish)

    async def agenerate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        sem = asyncio.Semaphore(self.max_concurrency)
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        timeout = httpx.Timeout(self.request_timeout_s, connect=10.0)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits) as client:
            return list(await asyncio.gather(*(self._one(client, sem, p, params) for p in prompts)))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.agenerate(prompts, params))
        box: dict = {}

        def run() -> None:
            try:
                box["out"] = asyncio.run(self.agenerate(prompts, params))
            except BaseException as exc:
                box["err"] = exc

        t = threading.Thread(target=run)
        t.start()
        t.join()
        if "err" in box:
            raise box["err"]
        return box["out"]
