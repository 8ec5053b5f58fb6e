"""Engine backends for the proxy: `BatchingBackend` runs a synchronous engine on one thread
and batches the requests that wait together into one `generate` call."""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from areal_core.rollout.engine import Generation, SamplingParams

log = logging.getLogger("areal.proxy")


@dataclass
class TimedGeneration(Generation):
    queue_s: float = 0.0  # waiting for the engine thread
    engine_s: float = 0.0  # the generate() call this request was batched into
    batch_size: int = 1


class BatchingBackend:
    """Runs a synchronous, non-thread-safe engine (TorchEngine, RolloutEngine) on one thread.

    Requests that wait while the engine is busy are taken together: those with the same
    sampling settings (apart from max_new_tokens) go into one `generate` call, run to the
    largest max_new_tokens and cut back per request. When idle, staged weights are installed.
    """

    def __init__(self, engine: Any, max_batch_size: int = 256, idle_poll_s: float = 0.05):
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.idle_poll_s = idle_poll_s
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.stats = {"calls": 0, "requests": 0, "max_batch": 0, "engine_s": 0.0}
        self._thread = threading.Thread(target=self._loop, name="areal-proxy-engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return int(getattr(self.engine, "version", 0))

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Future:
        fut: Future = Future()
        self._q.put((list(prompt_ids), params, fut, time.perf_counter()))
        return fut

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        return await asyncio.wrap_future(self.submit(prompt_ids, params))

    def close(self) -> None:
        self._stop.set()
        self._q.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._q.get(timeout=self.idle_poll_s)
            except queue.Empty:
                self._install_staged()
                continue
            if first is None:
                break
            items = [first]
            while len(items) < self.max_batch_size:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._stop.set()
                    break
                items.append(nxt)
            groups: dict[tuple, list] = {}
            for it in items:
                p: SamplingParams = it[1]
                key = (p.temperature, p.top_p, p.top_k, p.greedy, tuple(sorted(p.stop_token_ids)))
                groups.setdefault(key, []).append(it)
            for group in groups.values():
                try:
                    self._run(group)
                except Exception as exc:  # noqa: BLE001 - the engine thread must outlive any bug
                    log.exception("engine thread failed a batch")
                    for it in group:
                        if not it[2].done():
                            it[2].set_exception(exc)

    def _install_staged(self) -> None:
        if hasattr(self.engine, "stage_weights"):
            try:
                self.engine.load_version(self.engine.version)
            except Exception:  # noqa: BLE001 - a bad staged version must not kill the server
                log.exception("installing staged weights failed")

    def _run(self, group: list) -> None:
        live = [it for it in group if it[2].set_running_or_notify_cancel()]
        if not live:
            return
        n_max = max(it[1].max_new_tokens for it in live)
        params = replace(live[0][1], max_new_tokens=n_max)
        t0 = time.perf_counter()
        try:
            gens = self.engine.generate([it[0] for it in live], params)
        except Exception as exc:  # noqa: BLE001 - reported to each waiting request
            for it in live:
                it[2].set_exception(exc)
            return
        dt = time.perf_counter() - t0
        self.stats["calls"] += 1
        self.stats["requests"] += len(live)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(live))
        self.stats["engine_s"] += dt
        for it, g in zip(live, gens):
            n = it[1].max_new_tokens
            toks, lps, vers, reason = g.token_ids, g.logprobs, g.versions, g.finish_reason
            if len(toks) > n:
                toks, lps, vers, reason = toks[:n], lps[:n], vers[:n], "length"
            it[2].set_result(
                TimedGeneration(toks, lps, vers, reason, queue_s=t0 - it[3], engine_s=dt, batch_size=len(live))
            )


class AsyncBackendAdapter:
    """Wraps an object with `async def generate(prompt_ids, params) -> Generation` (remote engines)."""

    def __init__(self, backend: Any):
        self.backend = backend

    @property
    def version(self) -> int:
        return int(getattr(self.backend, "version", 0))

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        return await self.backend.generate(prompt_ids, params)

    def close(self) -> None:
        if hasattr(self.backend, "close"):
            self.backend.close()


def as_backend(engine_backend: Any) -> Any:
    if isinstance(engine_backend, (BatchingBackend, AsyncBackendAdapter)):
        return engine_backend
    if inspect.iscoroutinefunction(getattr(engine_backend, "generate", None)):
        return AsyncBackendAdapter(engine_backend)
    return BatchingBackend(engine_backend)
