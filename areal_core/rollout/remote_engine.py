"""The HTTP plumbing the remote engines (vLLM, SGLang) share.

A remote engine is a client of an inference server. What the two servers have in common lives
here: the constructor (URL, current version, staging folder, connection limits), control calls
with one error format, abort, health, the weight update from the store and the generate loop.

Weight update (`receive`), between the server's decode steps and without losing a token:
the version is staged on local disk with every file's sha256 checked (`weights.reader.
stage_verified`, before the server is touched: a failing version changes nothing), then
under a lock: pause the server, have it load the staged folder (`_reload`, server specific),
resume. Generation and updates may overlap.

Generate loop: one request per prompt, all in flight at once. A request that comes back with
`finish_reason == "abort"` because a weight update paused the server is re-submitted as
prompt + tokens so far, so the continuation runs under the new weights; a user `abort()` ends
requests for good (they come back with `finish_reason="abort"` and the tokens so far).
Subclasses give the request body (`_request_body`) and parse the response (`_parse_response`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from areal_core.rollout.engine import Generation, SamplingParams
from areal_core.store import Store
from areal_core.weights.reader import prune_staged, stage_verified

logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per generate request


def request_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th request's sampling parameters: a shared seed s becomes s + i, as the built-in
    engines derive it, so that the requests of one group (the same prompt G times) sample
    independently rather than G identical answers."""
    return params if params.seed is None else dataclasses.replace(params, seed=params.seed + index)


def segment_problem(new: Any, logprobs: Any, versions: Any, budget: int) -> str | None:
    """Why one generate response's segment cannot be a sample's tokens, else None: at most `budget`
    token ids, each an int >= 0, with one finite log-prob and one int version each (a server's
    answer is network input: the shard protocol checks the ids against the vocabulary later)."""
    if not isinstance(new, list) or len(new) > budget:
        return f"{len(new) if isinstance(new, list) else type(new).__name__} tokens for a budget of {budget}"
    if any(type(t) is not int or t < 0 for t in new):
        return "a token id that is not a non-negative integer"
    if len(logprobs) != len(new) or any(not math.isfinite(lp) for lp in logprobs):
        return f"{len(logprobs)} log-probs for {len(new)} tokens, or one that is not finite"
    if len(versions) != len(new) or any(type(v) is not int for v in versions):
        return f"{len(versions)} versions for {len(new)} tokens, or one that is not an integer"
    return None


class RemoteEngineError(RuntimeError):
    """A request or control call to the inference server failed; the message names the call."""


class RemoteEngine:
    """RolloutEngine over an inference server at `url`; `generate` and `receive` may overlap.

    Subclasses set `name` (for messages), `engine` (health's engine name), `error_cls`,
    `generate_path`, and implement pause/resume/_abort_server/server_version/_reload and
    the request/response shape of generation.
    """

    name = "remote"
    engine = "remote"
    error_cls: type[RemoteEngineError] = RemoteEngineError
    generate_path = "/generate"
    health_timeout_s = 5.0
    interrupt = "abort"  # the pause mode of a weight update

    def __init__(
        self,
        url: str,
        version: int,
        eos_id: int | None,
        *,
        staging_dir: str | Path | None = None,
        store: Store | None = None,
        server: Any = None,
        request_timeout_s: float = 900.0,
        max_concurrency: int = 256,
        set_version: bool = True,
    ):
        self.url = url.rstrip("/")
        self.version = version
        self.eos_id = eos_id
        self.store = store
        self.server = server  # a server process this engine started (alive(), stop(), log_tail())
        self.request_timeout_s = request_timeout_s
        self.max_concurrency = max_concurrency
        self._own_staging = staging_dir is None
        self.staging_dir = Path(staging_dir or tempfile.mkdtemp(prefix=f"areal-{self.engine}-weights-"))
        self.swaps = 0
        self.last_update: dict = {}
        self.log = logging.getLogger(f"areal.rollout.{self.engine}")
        self._update_lock = threading.Lock()
        self._abort_epoch = 0
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(request_timeout_s, connect=10.0))
        if set_version:  # the server must be serving `version` already (e.g. started on weights/v{version})
            self._call("POST", "/update_weight_version", json={"new_version": str(version)})

    def close(self) -> None:
        self._http.close()
        if self.server is not None:
            self.server.stop()
        if self._own_staging:
            shutil.rmtree(self.staging_dir, ignore_errors=True)

    # -- control calls ------------------------------------------------------------------
    def _error(self, what: str) -> RemoteEngineError:
        tail = f"\nserver log tail:\n{self.server.log_tail()}" if self.server is not None else ""
        dead = " (server process has exited)" if self.server is not None and not self.server.alive() else ""
        return self.error_cls(f"{self.name} {what} at {self.url} failed{dead}{tail}")

    def _call(self, method: str, path: str, ok: tuple[int, ...] = (200,), **kw) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise self._error(f"{method} {path}: {exc!r}") from exc
        if r.status_code not in ok:
            raise self._error(f"{method} {path}: HTTP {r.status_code} {r.text[:300]}")
        return r

    def pause(self, mode: str) -> None:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def _abort_server(self) -> Any:
        raise NotImplementedError

    def abort(self) -> Any:
        """End every in-flight request now; each returns its tokens so far with finish_reason 'abort'."""
        self._abort_epoch += 1
        return self._abort_server()

    def server_version(self) -> str:
        raise NotImplementedError

    def _server_state(self) -> dict:
        """Extra health fields read from the server (inside health's error handling)."""
        return {}

    def health(self) -> dict:
        out = {"ok": False, "engine": self.engine, "url": self.url, "version": self.version, "swaps": self.swaps}
        if self.server is not None:
            out["server_alive"] = self.server.alive()
        try:
            up = self._http.get("/health", timeout=self.health_timeout_s).status_code == 200
            out["ok"] = up
            out["server_version"] = self.server_version()
            out.update(self._server_state())
            out["ok"] = up and out["server_version"] == str(self.version)
        except (httpx.HTTPError, RemoteEngineError) as exc:
            out["error"] = str(exc).splitlines()[0]
        return out

    # -- weights ------------------------------------------------------------------------
    def _stage(self, store: Store, version: int) -> Path:
        """The verified local copy of weights/v{version} the server loads (a whole HF folder here)."""
        return stage_verified(store, version, self.staging_dir)

    def _reload(self, path: Path, version: int) -> None:
        """Have the paused server load the staged HF folder `path` and label itself `version`."""
        raise NotImplementedError

    def _swapped(self, old: int, version: int) -> None:
        """Still paused, `self.version` now `version`: anything the server needs before it resumes."""

    def _retire(self, old: int, version: int) -> None:
        """Resumed on `version`: release what `old` held on the server."""

    def _keep_staged(self, old: int, version: int) -> set[int]:
        """The staged versions kept after an update."""
        return {version}

    def clear_weight_cache(self) -> None:
        """Drop every staged version but the one the server holds: a reader restarting its loader
        (weights/faults.py) stages the next from the store again."""
        prune_staged(self.staging_dir, {self.version})

    def load_version(self, version: int) -> None:
        """RolloutEngine: bring the server to `version` from the store the engine was given."""
        if version == self.version:
            return
        if self.store is None:
            raise self.error_cls("load_version needs the engine's store; use receive(store, version)")
        self.receive(self.store, version)

    def receive(self, store: Store, version: int, mode: str | None = None) -> bool:
        """Load weights/v{version} into the server mid-flight (see the module doc). False if not newer.

        Raises WeightsError (nothing changed on the server) when the version fails its checks.
        """
        if version <= self.version:
            return False
        t0 = time.perf_counter()
        path = self._stage(store, version)  # before pausing: generation goes on
        t_staged = time.perf_counter()
        with self._update_lock:
            if version <= self.version:
                return False
            old = self.version
            self.pause(mode or self.interrupt)
            t_paused = time.perf_counter()
            try:
                self._reload(path, version)
                self.version = version
                self.swaps += 1
                self._swapped(old, version)
            finally:
                self.resume()
            t_done = time.perf_counter()
            self._retire(old, version)
        prune_staged(self.staging_dir, self._keep_staged(old, version))
        self.last_update = {
            "version": version,
            "stage_s": t_staged - t0,
            "paused_s": t_done - t_paused,
            "total_s": t_done - t0,
        }
        self.log.debug(  # every version, every worker: the rollout's `load` events hold it
            "%s now at v%d (%s)", self.name, version, ", ".join(f"{k}={v:.3f}" for k, v in self.last_update.items())
        )
        return True

    # -- generation ---------------------------------------------------------------------
    def _sampling(self, params: SamplingParams) -> dict:
        """The sampling fields both servers spell the same way."""
        stops = set(params.stop_token_ids)
        if self.eos_id is not None:
            stops.add(self.eos_id)
        sp: dict = {
            "stop_token_ids": sorted(stops),
            "ignore_eos": self.eos_id is None,
            "skip_special_tokens": False,
        }
        if params.is_greedy:
            sp["temperature"] = 0.0
        else:
            sp["temperature"] = params.temperature
            sp["top_p"] = params.top_p
            if params.top_k > 0:
                sp["top_k"] = params.top_k
        if params.stop:
            sp["stop"] = list(params.stop)
        return sp

    def _request_body(self, ids: list[int], params: SamplingParams, max_new: int, segment: int) -> dict:
        """The generate request for `ids` (prompt + tokens so far), segment 0, 1, ... of a request."""
        raise NotImplementedError

    def _request_body_at(self, ids: list[int], params: SamplingParams, max_new: int, segment: int, v: int) -> dict:
        """`_request_body` for a segment submitted at the engine's version `v`."""
        return self._request_body(ids, params, max_new, segment)

    def _stale(self, r: httpx.Response, v_submit: int) -> bool:
        """Whether a failed generate response only means that `v_submit` is gone (re-submit it)."""
        return False

    def _parse_response(self, data: Any, v_submit: int) -> tuple[list[int], list[float], list[int], str]:
        """(new tokens, their log-probs, their versions, finish reason) of one generate response;
        `v_submit` is the engine's version when the segment was submitted."""
        raise NotImplementedError

    async def _one(self, client: httpx.AsyncClient, sem: asyncio.Semaphore, prompt: list[int], params: SamplingParams):
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        epoch = self._abort_epoch
        segment = 0
        while True:
            v_submit = self.version
            body = self._request_body_at(
                list(prompt) + tokens, params, params.max_new_tokens - len(tokens), segment, v_submit
            )
            async with sem:
                try:
                    r = await client.post(self.generate_path, json=body)
                except httpx.HTTPError as exc:
                    raise self._error(f"POST {self.generate_path}: {exc!r}") from exc
            if r.status_code != 200 and self._stale(r, v_submit):
                segment += 1
                continue
            if r.status_code != 200:
                raise self._error(f"POST {self.generate_path}: HTTP {r.status_code} {r.text[:300]}")
            budget = params.max_new_tokens - len(tokens)
            try:
                new, lps, vers, finish = self._parse_response(r.json(), v_submit)
            except (KeyError, IndexError, TypeError, ValueError) as exc:  # not the response's shape
                raise self.error_cls(f"{self.name} at {self.url}: malformed response ({exc!r:.200})") from None
            if problem := segment_problem(new, lps, vers, budget):
                raise self.error_cls(f"{self.name} at {self.url}: malformed response ({problem})")
            tokens += new
            logprobs += lps
            versions += vers
            interrupted = finish == "abort" and epoch == self._abort_epoch and len(tokens) < params.max_new_tokens
            if not interrupted:
                return Generation(tokens, logprobs, versions, finish)
            segment += 1  # aborted by a weight update: continue under the new weights

    async def agenerate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        sem = asyncio.Semaphore(self.max_concurrency)
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        timeout = httpx.Timeout(self.request_timeout_s, connect=10.0)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits) as client:
            requests = (self._one(client, sem, p, request_params(params, i)) for i, p in enumerate(prompts))
            return list(await asyncio.gather(*requests))

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
