"""Engine backends for the proxy: a synchronous engine runs behind the rollout worker's
`AsyncEngine` (one thread; the requests that wait together are batched into one `generate`
call); an object with an async `generate(prompt_ids, params)` is used as it is."""

from __future__ import annotations

import inspect
from typing import Any

from areal_core.rollout.async_engine import AsyncEngine
from areal_core.rollout.engine import Generation, SamplingParams


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
    if isinstance(engine_backend, (AsyncEngine, AsyncBackendAdapter)):
        return engine_backend
    if inspect.iscoroutinefunction(getattr(engine_backend, "generate", None)):
        return AsyncBackendAdapter(engine_backend)
    return AsyncEngine(engine_backend, idle_poll_s=0.05)
