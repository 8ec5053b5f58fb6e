"""The agent workflow: a user-written agent runs against an in-process proxy over the rollout
worker's engine, and each episode becomes trajectory rows.

A user writes

    async def run(task: dict, base_url: str, api_key: str) -> float | dict | None

with any OpenAI-compatible client (a dict is `{"reward": float | None, "info": {...}}`: the info, a
JSON object, is merged into the rows' `reward_info`; an environment's rubric puts each reward
function's own score in `info["rewards"]`, which the trainer logs as `reward/<name>`).
`AgentWorkflow` starts the proxy (uvicorn on 127.0.0.1, a free port) over the engine it is first
given, gives each episode its own API key (so the episode is the key's session without any header)
and runs `group_size` episodes of a task concurrently, each under `episode_timeout_s`. A failed or
timed-out episode is dropped (its rows never reach the trainer) and counted. Rows of an agent that
returned a reward carry it (`reward_info["reward_source"] == "agent"`); rows of agents that returned
None are graded by the reward workers like any other sample. A reward that is not a finite number in
the allowed range (a rubric's NaN) drops the episode's rows, counted apart (`episodes_bad_reward`).
An episode whose own session reached a cap of a key's implicit session
(`ProxyLimits.max_key_session_segments/_tokens`) goes on in a fresh one; the rows of the capped
session stay the episode's, and carry its reward like the others.

The rollout worker (`areal_core.rollout.worker`) runs it when `rollout.agent` is set
(`from_context`); `evaluate_agent` is the held-out success rate of one greedy episode a task.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from areal_core.config.hooks import import_object
from areal_core.protocol import Sample, check_reward
from areal_core.proxy.app import create_app
from areal_core.proxy.backend import as_backend
from areal_core.proxy.guard import ApiKeys, ProxyLimits, context_limit
from areal_core.proxy.runner import ProxyServer
from areal_core.proxy.sessions import Session, key_digest, session_id_for_key
from areal_core.rollout.async_engine import AsyncEngine
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.workflow import RolloutWorkflow, WorkflowContext

log = logging.getLogger("areal.agent")

AgentFn = Callable[[dict[str, Any], str, str], Awaitable[float | dict[str, Any] | None]]


def quiet_http_clients() -> None:
    """No INFO line per request from the agents' HTTP clients (httpx logs every call to the
    in-process proxy: tens of thousands of lines per run); a level set by the user is kept."""
    logger = logging.getLogger("httpx")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


class BadReward(ValueError):
    """The agent returned a reward that cannot be trained on (not a finite number in range, a bad info)."""


def agent_result(value: Any, low: float, high: float) -> tuple[float | None, dict[str, Any]]:
    """(reward, info) of an agent's return value: a number, None, or {"reward": ..., "info": {...}}."""
    info: dict[str, Any] = {}
    if isinstance(value, dict):
        if set(value) - {"reward", "info"}:
            raise BadReward(f"an agent's dict has only 'reward' and 'info', got keys {sorted(map(str, value))[:8]}")
        info = value.get("info") or {}
        try:
            if not isinstance(info, dict) or len(json.dumps(info, allow_nan=False)) > 1 << 20:
                raise ValueError("not a JSON object of at most 1 MiB")
        except (TypeError, ValueError) as exc:
            raise BadReward(
                f"the agent's info must be a JSON object (finite numbers) of at most 1 MiB: {exc}"
            ) from None
        value = value.get("reward")
    if value is None:
        return None, info
    try:
        return check_reward(float(value), low, high), info
    except (TypeError, ValueError) as exc:
        raise BadReward(str(exc)) from None


@dataclass
class EpisodeResult:
    task: dict[str, Any]
    session_id: str
    reward: float | None
    samples: list[Sample]
    error: str | None = None
    wall_s: float = 0.0


@dataclass
class EpisodeStats:
    episodes: int = 0
    episodes_failed: int = 0
    episodes_empty: int = 0  # the agent never called the model
    episodes_bad_reward: int = 0  # a reward that is not a finite number in range (a rubric's NaN): not trained on
    rows: int = 0
    rewards: list[float] = field(default_factory=list)
    t0: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        n = len(self.rewards)
        return {
            "episodes": self.episodes,
            "episodes_failed": self.episodes_failed,
            "episodes_empty": self.episodes_empty,
            "episodes_bad_reward": self.episodes_bad_reward,
            "rows": self.rows,
            "mean_reward": sum(self.rewards) / n if n else None,
            "episodes_per_s": self.episodes / max(time.time() - self.t0, 1e-9),
        }


class AgentWorkflow(RolloutWorkflow):
    """`group_size` concurrent episodes of `agent` per task, through a proxy over the engine.

    sampling: the behaviour policy, enforced on every request so the trainer's assumptions hold.
    """

    def __init__(
        self,
        tokenizer: Any,
        agent: AgentFn | str,
        *,
        group_size: int = 2,
        max_concurrent_episodes: int = 64,
        episode_timeout_s: float = 300.0,
        turn_discount: float = 1.0,
        sampling: SamplingParams | None = None,
        limits: ProxyLimits | None = None,
        tool_prompt: str = "none",
        worker_id: str = "agent-0",
    ):
        self.agent = import_object(agent, key="rollout.agent", coroutine=True) if isinstance(agent, str) else agent
        quiet_http_clients()
        self.tokenizer, self.group_size, self.worker_id = tokenizer, group_size, worker_id
        self.max_concurrent_groups = max(1, max_concurrent_episodes // group_size)
        self.episode_timeout_s = episode_timeout_s
        self.turn_discount, self.tool_prompt, self.limits = turn_discount, tool_prompt, limits
        self.sampling = sampling or SamplingParams(max_new_tokens=64)
        self.keys = ApiKeys()
        self.episode_stats = EpisodeStats()
        self.engine: Any = None
        self.backend: Any = None
        self.server: ProxyServer | None = None
        self.capped: dict[str, list[Session]] = {}  # key digest -> its sessions ended at a cap, until its episode ends

    # -- the proxy -------------------------------------------------------------------------
    def serve(self, engine: Any) -> ProxyServer:
        """The proxy over `engine`, started at first use (again if the engine changes)."""
        if self.server is None or self.engine is not engine:
            self._stop_proxy()  # not close(): a subclass's close may end more (MCP servers) than the proxy
            self.engine, self.backend = engine, as_backend(engine)
            limits = self.limits or ProxyLimits()
            if not limits.max_context_tokens:  # the engine's model, also behind the worker's AsyncEngine
                limits = replace(limits, max_context_tokens=context_limit(engine, None))
            app = create_app(
                self.backend,
                self.tokenizer,
                api_keys=self.keys,
                limits=limits,
                worker_id=self.worker_id,
                turn_discount=self.turn_discount,
                tool_prompt=self.tool_prompt,
                sampling=self.sampling,
                force_sampling=True,
            )
            self.sessions = app.state.proxy.sessions
            self.sessions.on_finish.append(self._hold_capped)
            self.server = ProxyServer(app).start()
        return self.server

    def _hold_capped(self, session: Session, samples: list[Sample]) -> None:
        if session.capped is not None:
            self.capped.setdefault(session.owner, []).append(session)

    def close(self) -> None:
        self._stop_proxy()

    def _stop_proxy(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.backend is not self.engine and isinstance(self.backend, AsyncEngine):
            self.backend.close()
        self.engine = self.backend = None

    # -- episodes --------------------------------------------------------------------------
    async def run_episode(self, engine: Any, task: dict[str, Any], episode: int = 0) -> EpisodeResult:
        """One episode under its own API key; its rows carry the agent's return value as reward."""
        server = self.serve(engine)
        key = self.keys.new_key()
        sid = session_id_for_key(key)
        t0 = time.perf_counter()
        reward: float | None = None
        info: dict[str, Any] = {}
        error = None
        bad_reward = False
        try:
            value = await asyncio.wait_for(self.agent(task, server.base_url, key), self.episode_timeout_s)
            limits = self.limits or ProxyLimits()  # a reward outside the range drops the episode
            reward, info = agent_result(value, limits.reward_min, limits.reward_max)
        except BadReward as exc:
            error, bad_reward = f"bad reward: {exc}", True
        except Exception as exc:  # noqa: BLE001 - an agent's failure drops its episode, not the run
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self.keys.revoke(key)
        owner, prompt_id = key_digest(key), str(task.get("prompt_id", ""))
        meta = {"agent": getattr(self.agent, "__name__", "agent"), "episode": episode, "error": error}
        samples: list[Sample] = await server.acall(
            self.sessions.end_all(owner, reward=reward, prompt_id=prompt_id, meta=meta, write=False)
        )
        capped: list[Sample] = []
        for s in self.capped.pop(owner, []):  # ended at a cap: rebuilt with the episode's reward
            s.final_reward = reward if reward is not None else s.final_reward
            capped += s.to_samples(
                self.worker_id, self.turn_discount, prompt_id=prompt_id, meta={**meta, "capped": s.capped}
            )
        samples = capped + samples
        for s in samples:  # the agent's info, under the proxy's own keys (turn rewards, reward_source)
            s.reward_info = {**info, **(s.reward_info or {})}
        st = self.episode_stats
        st.episodes += 1
        if error is not None:
            if bad_reward:
                st.episodes_bad_reward += 1
            else:
                st.episodes_failed += 1
            log.warning("episode on %s failed: %s", task.get("prompt_id"), error)
            samples = []
        elif not samples:
            st.episodes_empty += 1
        elif reward is not None:
            st.rewards.append(reward)
        st.rows += len(samples)
        return EpisodeResult(task, sid, reward, samples, error, time.perf_counter() - t0)

    async def arun_episode(self, engine: Any, task: dict[str, Any]) -> list[Sample]:
        results = await asyncio.gather(*(self.run_episode(engine, task, k) for k in range(self.group_size)))
        return [s for r in results for s in r.samples]

    def stats(self) -> dict[str, Any]:
        return self.episode_stats.as_dict()


def from_context(ctx: WorkflowContext) -> AgentWorkflow:
    """The run's agent workflow: rollout.{agent, group_size} and the behaviour policy's sampling,
    agent.{max_concurrent_episodes, episode_timeout_s, turn_discount, tool_prompt}; the proxy's
    context limit is the model's (model.max_position_embeddings)."""
    cfg, ac = ctx.cfg, ctx.cfg.agent
    cls, extra = workflow_class(ac)
    return cls(
        ctx.tokenizer,
        cfg.rollout.agent,
        group_size=cfg.rollout.group_size,
        max_concurrent_episodes=ac.max_concurrent_episodes,
        episode_timeout_s=ac.episode_timeout_s,
        turn_discount=ac.turn_discount,
        sampling=ctx.sampling(),
        limits=ProxyLimits(
            max_context_tokens=cfg.model.max_position_embeddings, reward_min=ac.reward_min, reward_max=ac.reward_max
        ),
        tool_prompt=ac.tool_prompt,
        worker_id=ctx.worker_id,
        **extra,
    )


def workflow_class(mcp: Any) -> tuple[type[AgentWorkflow], dict[str, Any]]:
    """AgentWorkflow, or MCPWorkflow (areal_core/agents/, loaded by path) when `mcp` (the run's
    `agent` section) lists MCP servers: its agent then takes the episode's tools (docs/agents.md)."""
    if mcp is None or not getattr(mcp, "mcp_servers", None):
        return AgentWorkflow, {}
    return import_object("areal_core.agents.workflow:MCPWorkflow", key="agent.mcp_servers"), {"mcp": mcp}


async def evaluate_agent(
    engine: Any,
    tokenizer: Any,
    agent: AgentFn | str,
    tasks: Sequence[dict[str, Any]],
    max_concurrent_episodes: int = 32,
    sampling: SamplingParams | None = None,
    tool_prompt: str = "none",
    limits: ProxyLimits | None = None,
    mcp: Any = None,
) -> float:
    """Held-out success rate: mean reward of one greedy episode per task (nothing is written).
    mcp: the run's `agent` section (or an MCPEnvironment) when the agent's tools are MCP servers."""
    cls, extra = workflow_class(mcp)
    workflow = cls(
        tokenizer,
        agent,
        group_size=1,
        sampling=sampling or SamplingParams(max_new_tokens=64, greedy=True, temperature=0.0),
        tool_prompt=tool_prompt,
        limits=limits,
        **extra,
    )
    sem = asyncio.Semaphore(max_concurrent_episodes)

    async def one(task: dict[str, Any]) -> float:
        async with sem:
            return (await workflow.run_episode(engine, task)).reward or 0.0

    try:
        rewards = await asyncio.gather(*(one(t) for t in tasks))
    finally:
        workflow.close()
    return sum(rewards) / max(len(rewards), 1)
