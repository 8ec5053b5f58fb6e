"""The proxy's backend: the rollout worker's `AsyncEngine` over a RolloutEngine (an in-process
engine runs on one thread, the requests that wait together batched into one `generate` call; a
remote engine is called directly, its server batching)."""

from __future__ import annotations

from areal_core.rollout.async_engine import AsyncEngine
from areal_core.rollout.engine import RolloutEngine


def as_backend(engine: RolloutEngine | AsyncEngine) -> AsyncEngine:
    """`engine` itself when it already is an AsyncEngine (the worker's), else one over it."""
    return engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine, idle_poll_s=0.05)
