"""vLLM rollout engine: a client of a vLLM server (started as a subprocess, or at a given URL).

Generation goes through vLLM's token-in/token-out endpoint `POST /inference/v1/generate`
(served with `--enable-scale-out`): the request carries the prompt token ids, the response
the sampled token ids, the log-prob of each (`logprobs: 0`, computed after temperature:
`--logprobs-mode processed_logprobs`) and `weight_versions`, spans `[start, end)` of output
tokens labelled with the server's weight version when they were sampled. The engine sets
that label to the policy version on every update, so each token's version comes from the
server's own step loop rather than from a client-side guess.

Weight update from the store (`update_from_store`), between decode steps and without
losing a token:

1. copy `weights/v{N}/` to a local staging folder, checking every file's sha256 against
   MANIFEST.json (a failing version is refused before the server is touched);
2. `POST /pause?mode=keep`: the scheduler stops; in-flight requests stay queued;
3. `POST /collective_rpc` `{"method": "reload_and_retie", "kwargs": {"weights_path": dir}}`:
   every worker reloads the weights in place (`vllm_worker_ext.ReloadExtension`, which
   also re-packs a tied lm_head on CPU);
4. `POST /reset_prefix_cache?reset_running_requests=true`: the kept requests are preempted,
   their KV cache dropped; on resume they re-prefill prompt + generated tokens under the
   new weights (the prefix cache of old-weight blocks is emptied too);
5. `POST /update_weight_version {"new_version": "N"}`, then `POST /resume`.

`interrupt="abort"` is the other path (for servers without keep): `/pause?mode=abort`
returns in-flight requests early with `finish_reason="abort"`; the engine re-submits each
as prompt + tokens so far, which the server queues until `/resume`, so the continuation
runs under the new weights. A user `abort()` ends requests for good: they come back with
`finish_reason="abort"` and the tokens produced so far.
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
from areal_core.rollout.vllm_server import SERVED_NAME, VLLMServer, VLLMServerSpec
from areal_core.store import Store

log = logging.getLogger("areal.rollout.vllm")
logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per generate request

INTERRUPT_MODES = ("keep", "abort")


class VLLMEngineError(RuntimeError):
    """A request or control call to the vLLM server failed; the message names the call."""


def expand_spans(spans: list[dict] | None, n: int) -> list[int]:
    """Per-token versions from vLLM's `weight_versions` spans `[{version, start, end}]` over n tokens."""
    if n == 0:
        return []
    if not spans:
        raise VLLMEngineError(f"server returned {n} tokens without weight_versions")
    out: list[int] = []
    for span in spans:
        if span["start"] != len(out):
            raise VLLMEngineError(f"weight_versions spans are not contiguous: {spans}")
        try:
            v = int(span["version"])
        except ValueError:
            raise VLLMEngineError(f"weight version label {span['version']!r} is not a policy version") from None
        out.extend([v] * (span["end"] - span["start"]))
    if len(out) != n:
        raise VLLMEngineError(f"weight_versions cover {len(out)} tokens, response has {n}")
    return out


class VLLMEngine:
    """RolloutEngine over a vLLM server; thread-safe: `generate` and `update_from_store` may overlap."""

    def __init__(
        self,
        url: str,
        version: int,
        eos_id: int | None,
        *,
        interrupt: str = "keep",
        staging_dir: str | Path | None = None,
        store: Store | None = None,
        server: VLLMServer | None = None,
        reload_method: str = "reload_and_retie",
        request_timeout_s: float = 900.0,
        max_concurrency: int = 256,
    ):
        if interrupt not in INTERRUPT_MODES:
            raise ValueError(f"interrupt must be one of {INTERRUPT_MODES}, got {interrupt!r}")
        self.url = url.rstrip("/")
        self.version = version
        self.eos_id = eos_id
        self.interrupt = interrupt
        self.store = store
        self.server = server
        self.reload_method = reload_method
        self.request_timeout_s = request_timeout_s
        self.max_concurrency = max_concurrency
        self._own_staging = staging_dir is None
        self.staging_dir = Path(staging_dir or tempfile.mkdtemp(prefix="areal-vllm-weights-"))
        self.swaps = 0
        self.last_update: dict = {}
        self._update_lock = threading.Lock()
        self._abort_epoch = 0
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(request_timeout_s, connect=10.0))
        self._call("POST", "/update_weight_version", json={"new_version": str(version)})

    # -- construction -------------------------------------------------------------------
    @classmethod
    def launch(
        cls,
        store: Store,
        version: int,
        eos_id: int | None,
        spec: VLLMServerSpec | None = None,
        *,
        interrupt: str = "keep",
        log_path: str | Path | None = None,
    ) -> VLLMEngine:
        """Stage the verified weights/v{version}, start a server on them, and connect."""
        staging = Path(tempfile.mkdtemp(prefix="areal-vllm-weights-"))
        model_dir = stage_verified(store, version, staging)
        server = VLLMServer(spec or VLLMServerSpec(), model_dir, log_path)
        try:
            server.start()
            engine = cls(
                server.url, version, eos_id, interrupt=interrupt, staging_dir=staging, store=store, server=server
            )
        except BaseException:
            server.stop()
            shutil.rmtree(staging, ignore_errors=True)
            raise
        engine._own_staging = True
        return engine

    def close(self) -> None:
        self._http.close()
        if self.server is not None:
            self.server.stop()
        if self._own_staging:
            shutil.rmtree(self.staging_dir, ignore_errors=True)

    # -- control calls ------------------------------------------------------------------
    def _error(self, what: str) -> VLLMEngineError:
        tail = f"\nserver log tail:\n{self.server.log_tail()}" if self.server is not None else ""
        dead = " (server process has exited)" if self.server is not None and not self.server.alive() else ""
        return VLLMEngineError(f"vLLM {what} at {self.url} failed{dead}{tail}")

    def _call(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise self._error(f"{method} {path}: {exc!r}") from exc
        if r.status_code != 200:
            raise self._error(f"{method} {path}: HTTP {r.status_code} {r.text[:300]}")
        return r

    def pause(self, mode: str = "keep") -> None:
        """Stop the scheduler. keep: in-flight requests wait; abort: they return now; wait: drain first."""
        self._call("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._call("GET", "/is_paused").json()["is_paused"])

    def abort(self) -> int:
        """End every in-flight request now; each returns its tokens so far with finish_reason 'abort'."""
        self._abort_epoch += 1
        return int(self._call("POST", "/abort_requests", json={}).json().get("aborted", 0))

    def server_counters(self) -> dict[str, float]:
        """A few Prometheus counters of the server: requests running/waiting, tokens generated so far."""
        wanted = {
            "vllm:num_requests_running": "running",
            "vllm:num_requests_waiting": "waiting",
            "vllm:generation_tokens_total": "generated_tokens",
        }
        out: dict[str, float] = {}
        for line in self._call("GET", "/metrics").text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in wanted:
                out[wanted[name]] = out.get(wanted[name], 0.0) + float(line.rsplit(" ", 1)[-1])
        return out

    def server_version(self) -> str:
        return str(self._call("GET", "/weight_info").json()["weight_version"])

    def health(self) -> dict:
        out = {"ok": False, "engine": "vllm", "url": self.url, "version": self.version, "swaps": self.swaps}
        if self.server is not None:
            out["server_alive"] = self.server.alive()
        try:
            out["ok"] = self._http.get("/health", timeout=5.0).status_code == 200
            out["server_version"] = self.server_version()
            out["paused"] = self.is_paused()
            out["ok"] = out["ok"] and out["server_version"] == str(self.version)
        except (httpx.HTTPError, VLLMEngineError) as exc:
            out["error"] = str(exc).splitlines()[0]
        return out

    # -- weights ------------------------------------------------------------------------
    def load_version(self, version: int) -> None:
        """RolloutEngine: bring the server to `version` from the store it was launched with."""
        if version == self.version:
            return
        if self.store is None:
            raise VLLMEngineError("load_version needs the engine's store; use update_from_store")
        self.update_from_store(self.store, version)

    def update_from_store(self, store: Store, version: int, mode: str | None = None) -> bool:
        """Load weights/v{version} into the server mid-flight (see the module doc). False if not newer.

        Raises WeightsError (nothing changed on the server) when the version fails its checks.
        """
        if version <= self.version:
            return False
        t0 = time.perf_counter()
        path = stage_verified(store, version, self.staging_dir)  # before pausing: generation goes on
        t_staged = time.perf_counter()
        mode = mode or self.interrupt
        with self._update_lock:
            if version <= self.version:
                return False
            self.pause(mode)
            t_paused = time.perf_counter()
            try:
                self._call(
                    "POST",
                    "/collective_rpc",
                    json={"method": self.reload_method, "kwargs": {"weights_path": str(path)}},
                )
                reset = self._call("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})
                if not reset.json().get("success", False):
                    raise self._error("POST /reset_prefix_cache: success=false")
                self._call("POST", "/update_weight_version", json={"new_version": str(version)})
                self.version = version
                self.swaps += 1
            finally:
                self.resume()
            t_done = time.perf_counter()
        prune_staged(self.staging_dir, {version})
        self.last_update = {
            "version": version,
            "stage_s": t_staged - t0,
            "paused_s": t_done - t_paused,
            "total_s": t_done - t0,
        }
        log.info("vLLM now at v%d (%s)", version, ", ".join(f"{k}={v:.3f}" for k, v in self.last_update.items()))
        return True

    # -- generation ---------------------------------------------------------------------
    def _sampling(self, params: SamplingParams, max_tokens: int) -> dict:
        stops = set(params.stop_token_ids)
        if self.eos_id is not None:
            stops.add(self.eos_id)
        sp: dict = {
            "max_tokens": max_tokens,
            "logprobs": 0,  # the sampled token's log-prob only
            "stop_token_ids": sorted(stops),
            "ignore_eos": self.eos_id is None,
            "skip_special_tokens": False,
            "detokenize": bool(params.stop),
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
        # A per-request seed is only sent on the abort path: with pause(keep) a seeded
        # request's generator does not survive the preemption (docs/vllm.md).
        if params.seed is not None and self.interrupt == "abort":
            sp["seed"] = params.seed
        return sp

    async def _one(self, client: httpx.AsyncClient, sem: asyncio.Semaphore, prompt: list[int], params: SamplingParams):
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        epoch = self._abort_epoch
        segment = 0
        while True:
            remaining = params.max_new_tokens - len(tokens)
            body = {
                "model": SERVED_NAME,
                "token_ids": list(prompt) + tokens,
                "sampling_params": self._sampling(params, remaining),
            }
            if segment and "seed" in body["sampling_params"]:
                body["sampling_params"]["seed"] += 7919 * segment
            async with sem:
                try:
                    r = await client.post("/inference/v1/generate", json=body)
                except httpx.HTTPError as exc:
                    raise self._error(f"generate: {exc!r}") from exc
            if r.status_code != 200:
                raise self._error(f"generate: HTTP {r.status_code} {r.text[:300]}")
            choice = r.json()["choices"][0]
            new = choice.get("token_ids") or []
            content = (choice.get("logprobs") or {}).get("content") or []
            if len(content) != len(new):
                raise VLLMEngineError(f"server returned {len(new)} tokens but {len(content)} log-probs")
            tokens += new
            logprobs += [float(c["logprob"]) for c in content]
            versions += expand_spans(choice.get("weight_versions"), len(new))
            finish = choice.get("finish_reason") or "length"
            interrupted = finish == "abort" and epoch == self._abort_epoch and len(tokens) < params.max_new_tokens
            if not interrupted:
                return Generation(tokens, logprobs, versions, finish)
            segment += 1  # aborted by a weight update: continue under the new weights

    async def agenerate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        sem = asyncio.Semaphore(self.max_concurrency)
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        timeout = httpx.Timeout(self.request_timeout_s, connect=10.0)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits) as client:
            return list(await asyncio.gather(*(self._one(client, sem, p, params) for p in prompts)))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One request per prompt, all in flight at once (the server batches them continuously)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.agenerate(prompts, params))
        box: dict = {}  # called from inside an event loop: run ours on a helper thread

        def run() -> None:
            try:
                box["out"] = asyncio.run(self.agenerate(prompts, params))
            except BaseException as exc:  # re-raised in the caller
                box["err"] = exc

        t = threading.Thread(target=run)
        t.start()
        t.join()
        if "err" in box:
            raise box["err"]
        return box["out"]
