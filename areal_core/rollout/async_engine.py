"""The engine as workflows see it: awaitable generation from any event loop.

A remote engine (vLLM, SGLang) already has `async agenerate` and is called directly (the
server batches continuously). An in-process engine (torch, continuous) is synchronous and not
thread-safe, so one thread runs it: the calls made in one step of an event loop (the groups
a worker starts together) and those waiting while the engine is busy, with the same sampling
settings apart from max_new_tokens, go into one `generate` call run to the largest
max_new_tokens and cut back per call; every caller of that batch is woken in the same loop
step. While idle, the thread installs staged weight versions, at once when `wake()` says one was staged;
`on_new_version(fn)` callbacks hear of each version installed (a rollout loop waiting on admission
rechecks then, not at its next poll). A vision-language prompt brings
its images as one MMInputs (`mm`, None for a text prompt), passed through to the torch engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from areal_core.rollout.engine import Generation, RolloutEngine, SamplingParams
from areal_core.rollout.remote_engine import RemoteEngine
from areal_core.routes import cut_routes

log = logging.getLogger("areal.rollout")
_WAKE = object()  # queued by wake(): install what is staged now


@dataclass
class TimedGeneration(Generation):
    queue_s: float = 0.0  # waiting for the engine thread
    engine_s: float = 0.0  # the generate() call this request was batched into
    batch_size: int = 1  # prompts in that call


@dataclass
class _Call:
    prompts: list[list[int]]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    queued_at: float
    mm: list[Any] | None = None  # one MMInputs (or None) per prompt


def _key(p: SamplingParams) -> tuple:
    return (p.temperature, p.top_p, p.top_k, p.greedy, tuple(sorted(p.stop_token_ids)), tuple(p.stop), p.seed)


def _settle(outcomes: list[tuple[asyncio.Future, Any]]) -> None:
    for fut, value in outcomes:
        if fut.done():
            continue
        if isinstance(value, BaseException):
            fut.set_exception(value)
        else:
            fut.set_result(value)


class AsyncEngine:
    """`await agenerate(prompts, params)` / `await generate(prompt_ids, params)` over `engine`."""

    def __init__(self, engine: RolloutEngine, max_batch_prompts: int = 256, idle_poll_s: float = 0.02):
        self.engine = engine
        self.max_batch_prompts = max_batch_prompts
        self.idle_poll_s = idle_poll_s
        self.stats = {"calls": 0, "requests": 0, "max_batch": 0, "engine_s": 0.0}  # requests: prompts
        self.remote = isinstance(engine, RemoteEngine)  # batches on its server: called directly
        self._q: queue.Queue = queue.Queue()  # lists of calls, None to stop
        self._pending: dict[asyncio.AbstractEventLoop, list[_Call]] = {}
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        if not self.remote:
            self._thread = threading.Thread(target=self._loop, name="areal-engine", daemon=True)
            self._thread.start()

    @property
    def version(self) -> int:
        return self.engine.version

    def health(self) -> dict:
        return {**self.engine.health(), "batching": dict(self.stats)}

    async def agenerate(
        self, prompts: list[list[int]], params: SamplingParams, mm: list[Any] | None = None
    ) -> list[Generation]:
        """`mm`: one MMInputs (or None) per prompt: a vision-language model's images."""
        if mm is not None and len(mm) != len(prompts):
            raise ValueError(f"{len(mm)} image inputs for {len(prompts)} prompts")
        if mm is not None and all(m is None for m in mm):
            mm = None
        if self.remote:
            if mm is not None:
                raise ValueError(f"{type(self.engine).__name__} takes no images (docs/vlm.md)")
            return list(await self.engine.agenerate(prompts, params))
        if self._thread is None:
            raise RuntimeError("the engine is closed")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:  # calls made in one step of a loop reach the engine thread together
            calls = self._pending.setdefault(loop, [])
            calls.append(_Call([list(p) for p in prompts], params, loop, fut, time.perf_counter(), mm))
            if len(calls) == 1:
                loop.call_soon(self._flush, loop)
        return await fut

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            calls = self._pending.pop(loop, [])
        if calls:
            self._q.put(calls)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, mm: Any = None) -> Generation:
        """One prompt (the proxy's backend interface); `mm`: its MMInputs (a VLM's images) or None."""
        return (await self.agenerate([prompt_ids], params, mm=None if mm is None else [mm]))[0]

    def on_new_version(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call `fn()` (from the engine's or the weight watcher's thread) after each version is installed;
        returns the function that stops it."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def wake(self) -> None:
        """A version was just staged (the weight watcher's thread): an idle engine thread installs it now. A
        remote engine has already installed it on its server: the listeners hear of it here."""
        if self.remote:
            self._tell()
        elif self._thread is not None:
            self._q.put(_WAKE)

    def _tell(self) -> None:
        for fn in list(self._listeners):
            try:
                fn()
            except Exception:  # noqa: BLE001 - a listener (a closed loop) must not stop the engine thread
                log.debug("a new-version listener failed", exc_info=True)

    def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._q.put(None)
            thread.join(timeout=30)

    # -- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            try:
                first = self._q.get(timeout=self.idle_poll_s)
            except queue.Empty:
                self._install_staged()
                continue
            if first is None:
                return
            if first is _WAKE:
                self._install_staged()
                continue
            calls, woken = list(first), False
            while sum(len(c.prompts) for c in calls) < self.max_batch_prompts:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)  # stop after this batch
                    break
                if nxt is _WAKE:  # busy: installed after this batch (or by the engine at its next step)
                    woken = True
                else:
                    calls += nxt
            version = self.engine.version
            batches: dict[tuple, list[_Call]] = {}
            for c in calls:
                batches.setdefault(_key(c.params), []).append(c)
            for batch in batches.values():
                try:
                    self._run(batch)
                except Exception as exc:  # noqa: BLE001 - the engine thread must outlive any bug
                    log.exception("engine thread failed a batch")
                    for c in batch:
                        c.loop.call_soon_threadsafe(_settle, [(c.future, exc)])
            if woken:  # a version staged while busy: the engine is idle now (swap_mid_generation off waits for this)
                self._install_staged(since=version)
            elif self.engine.version != version:  # the engine installed one between two steps
                self._tell()

    def _install_staged(self, since: int | None = None) -> None:
        """Install what is staged; the listeners hear of it if the version differs from `since` (default: the
        version before this install)."""
        version = self.engine.version if since is None else since
        try:
            self.engine.load_version(self.engine.version)  # an in-process engine installs what is staged
        except Exception:  # noqa: BLE001 - a bad staged version must not stop the engine thread
            log.exception("installing staged weights failed")
        if self.engine.version != version:
            self._tell()

    def _run(self, batch: list[_Call]) -> None:
        params = replace(batch[0].params, max_new_tokens=max(c.params.max_new_tokens for c in batch))
        flat = [p for c in batch for p in c.prompts]
        images = any(c.mm is not None for c in batch)
        t0 = time.perf_counter()
        try:
            if images:  # only the torch engine takes `mm` (config: a VLM runs on it)
                mm = [m for c in batch for m in (c.mm or [None] * len(c.prompts))]
                gens = self.engine.generate(flat, params, mm=mm)
            else:
                gens = self.engine.generate(flat, params)
        except Exception as exc:  # noqa: BLE001 - handed to the caller whose request fails alone
            if len(batch) > 1:  # one bad request must not fail the others batched with it: each again, alone
                for c in batch:
                    self._run([c])
                return
            outcomes: list[tuple[asyncio.Future, Any]] = [(c.future, exc) for c in batch]
        else:
            dt = time.perf_counter() - t0
            self.stats["calls"] += 1
            self.stats["requests"] += len(flat)
            self.stats["max_batch"] = max(self.stats["max_batch"], len(flat))
            self.stats["engine_s"] += dt
            outcomes, i = [], 0
            for c in batch:
                out = []
                for prompt, g in zip(c.prompts, gens[i : i + len(c.prompts)]):
                    n = c.params.max_new_tokens
                    toks, lps, vers, reason, routes = g.token_ids, g.logprobs, g.versions, g.finish_reason, g.routes
                    if len(toks) > n:
                        toks, lps, vers, reason = toks[:n], lps[:n], vers[:n], "length"
                        routes = cut_routes(routes, len(prompt) + n)
                    timed = TimedGeneration(toks, lps, vers, reason, t0 - c.queued_at, dt, len(flat), routes=routes)
                    out.append(timed)
                outcomes.append((c.future, out))
                i += len(c.prompts)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for c, outcome in zip(batch, outcomes):
            by_loop.setdefault(c.loop, []).append(outcome)
        for loop, items in by_loop.items():  # one callback per loop: the whole batch wakes together
            try:
                loop.call_soon_threadsafe(_settle, items)
            except RuntimeError:  # that loop is closed: nobody waits any more
                pass
