"""Agent workflows: run user-written agents against an in-process proxy and turn their
episodes into trajectory shards.

A user writes

    async def run(task: dict, base_url: str, api_key: str) -> float | None

with any OpenAI-compatible client. `AgentRunner` starts the proxy (uvicorn on 127.0.0.1, a
free port) over a rollout engine, gives each episode its own API key (so the episode is
the key's session without any header), runs `group_size` episodes per task concurrently,
and starts a new group only while AReaL's admission rule allows it (checked per group, at
its start, against the engine's current policy version). Each finished group becomes one
shard: rows whose reward the agent returned go to trajectories/graded/, rows of agents that
returned None go to trajectories/ungraded/ for the reward workers. A failed or timed-out
episode is dropped (its row never reaches the trainer) and counted.

`run_agent_rollout_worker` is the rollout role for agents: like
`areal_core.rollout.worker.run_rollout_worker`, it follows weights/LATEST and runs until DONE.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from areal_core.config.hooks import import_object
from areal_core.protocol import Sample, decode_shard
from areal_core.proxy.app import create_app
from areal_core.proxy.backend import BatchingBackend, as_backend
from areal_core.proxy.guard import ApiKeys, ProxyLimits
from areal_core.proxy.runner import ProxyServer
from areal_core.proxy.sessions import ShardWriter, key_digest, session_id_for_key
from areal_core.rollout.engine import SamplingParams
from areal_core.staleness import groups_admissible
from areal_core.store import Store

log = logging.getLogger("areal.agent")

AgentFn = Callable[[dict[str, Any], str, str], Awaitable[float | None]]


def quiet_http_clients() -> None:
    """No INFO line per request from the agents' HTTP clients (httpx logs every call to the
    in-process proxy: tens of thousands of lines per run); a level set by the user is kept."""
    logger = logging.getLogger("httpx")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


@dataclass
class EpisodeResult:
    task: dict[str, Any]
    session_id: str
    reward: float | None
    samples: list[Sample]
    error: str | None = None
    wall_s: float = 0.0


@dataclass
class RunnerStats:
    groups_started: int = 0
    groups_written: int = 0
    episodes: int = 0
    episodes_failed: int = 0
    episodes_empty: int = 0  # the agent never called the model
    rows: int = 0
    shards: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    admission_waits: int = 0

    def as_dict(self) -> dict[str, Any]:
        n = len(self.rewards)
        return {
            "groups_started": self.groups_started,
            "groups_written": self.groups_written,
            "episodes": self.episodes,
            "episodes_failed": self.episodes_failed,
            "episodes_empty": self.episodes_empty,
            "rows": self.rows,
            "shards": len(self.shards),
            "mean_reward": sum(self.rewards) / n if n else None,
            "admission_waits": self.admission_waits,
        }


def recover_groups(store: Store, worker_id: str) -> int:
    """Groups this worker already wrote (graded or ungraded), for restart-safe admission."""
    groups: set[str] = set()
    for stage in ("graded", "ungraded"):
        for name in store.find(f"trajectories/{stage}/{worker_id}", ".arrow"):
            try:
                groups.update(s.group_id for s in decode_shard(store.read_bytes(name)))
            except Exception:  # noqa: BLE001 - a torn shard is rewritten by its group's rerun
                continue
    return len(groups)


class AgentRunner:
    """An in-process proxy over `engine` and a pool of concurrent agent episodes.

    Config values it needs (the caller passes them from RunConfig): group_size, batch_groups
    (B) and eta (η) for admission, the worker's index and count, and sampling (the behaviour
    policy, enforced on every request so the trainer's assumptions hold).
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        agent: AgentFn | str,
        *,
        store: Store | None = None,
        worker_id: str = "agent-0",
        worker_index: int = 0,
        num_workers: int = 1,
        group_size: int = 2,
        batch_groups: int = 1,
        eta: int = 0,
        admission: bool = True,
        max_concurrent_episodes: int = 64,
        episode_timeout_s: float = 300.0,
        turn_discount: float = 1.0,
        sampling: SamplingParams | None = None,
        limits: ProxyLimits | None = None,
        tool_prompt: str = "none",
        poll_interval_s: float = 0.02,
    ):
        self.agent = import_object(agent, key="rollout.agent", coroutine=True) if isinstance(agent, str) else agent
        quiet_http_clients()
        self.store = store
        self.worker_id = worker_id
        self.worker_index, self.num_workers = worker_index, num_workers
        self.group_size, self.batch_groups, self.eta = group_size, batch_groups, eta
        self.admission = admission
        self._discarded = 0  # groups the trainer discarded untrained (admission given back)
        self._discarded_read_at = 0.0
        self.max_concurrent_episodes = max(max_concurrent_episodes, group_size)
        self.episode_timeout_s = episode_timeout_s
        self.poll_interval_s = poll_interval_s
        self.keys = ApiKeys()
        self.backend = as_backend(engine)
        self._owns_backend = self.backend is not engine
        self.app = create_app(
            self.backend,
            tokenizer,
            api_keys=self.keys,
            limits=limits,
            worker_id=worker_id,
            turn_discount=turn_discount,
            tool_prompt=tool_prompt,
            sampling=sampling or SamplingParams(max_new_tokens=64),
            force_sampling=True,
        )
        self.sessions = self.app.state.sessions
        self.server = ProxyServer(self.app)
        self.writer = ShardWriter(store, worker_id) if store is not None else None
        self.started = recover_groups(store, worker_id) if store is not None else 0
        self.stats = RunnerStats()

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def version(self) -> int:
        return self.backend.version

    def start(self) -> AgentRunner:
        self.server.start()
        return self

    def close(self) -> None:
        self.server.stop()
        if self._owns_backend and isinstance(self.backend, BatchingBackend):
            self.backend.close()

    def __enter__(self) -> AgentRunner:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- episodes --------------------------------------------------------------------------
    async def run_episode(
        self, task: dict[str, Any], group_id: str | None = None, sample_prefix: str | None = None
    ) -> EpisodeResult:
        """One episode under its own API key; its rows carry the agent's return value as reward."""
        key = self.keys.new_key()
        sid = session_id_for_key(key)
        t0 = time.perf_counter()
        reward: float | None = None
        error = None
        try:
            value = await asyncio.wait_for(self.agent(task, self.base_url, key), self.episode_timeout_s)
            reward = None if value is None else float(value)
        except Exception as exc:  # noqa: BLE001 - an agent's failure drops its episode, not the run
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self.keys.revoke(key)
        samples: list[Sample] = await self.server.acall(
            self.sessions.end_all(
                key_digest(key),
                reward=reward,
                group_id=group_id,
                prompt_id=str(task.get("prompt_id", "")),
                meta={"agent": getattr(self.agent, "__name__", "agent"), "error": error},
                sample_prefix=sample_prefix,
                write=False,
            )
        )
        self.stats.episodes += 1
        if error is not None:
            self.stats.episodes_failed += 1
            log.warning("episode on %s failed: %s", task.get("prompt_id"), error)
            samples = []
        elif not samples:
            self.stats.episodes_empty += 1
        elif reward is not None:
            self.stats.rewards.append(reward)
        return EpisodeResult(task, sid, reward, samples, error, time.perf_counter() - t0)

    async def run_group(self, task: dict[str, Any], group_index: int) -> list[Sample]:
        gid = f"{self.worker_id}-g{group_index:07d}"
        results = await asyncio.gather(*(self.run_episode(task, gid, f"{gid}-{k}") for k in range(self.group_size)))
        return [s for r in results for s in r.samples]

    def write_group(self, samples: list[Sample]) -> list[str]:
        if self.writer is None or not samples:
            return []
        names = self.writer.write(samples)
        self.stats.shards.extend(names)
        self.stats.rows += len(samples)
        self.stats.groups_written += 1
        return names

    def room(self) -> int:
        if not self.admission:
            return 1 << 30
        args = (self.started, self.version, self.eta, self.batch_groups, self.worker_index, self.num_workers)
        blocked = groups_admissible(*args, self._discarded) == 0
        # blocked: the trainer may have given admission back; one small read per 5 polls, as the rollout worker
        if (
            blocked
            and self.store is not None
            and time.monotonic() - self._discarded_read_at >= 5 * self.poll_interval_s
        ):
            self._discarded = self.store.discarded_groups()
            self._discarded_read_at = time.monotonic()
        return groups_admissible(*args, self._discarded)

    async def run(
        self,
        tasks: Sequence[dict[str, Any]],
        num_groups: int | None = None,
        stop: Callable[[], bool] | None = None,
        on_group: Callable[[list[Sample]], None] | None = None,
        seed: int = 0,
    ) -> dict[str, Any]:
        """Start groups while admission allows, until `num_groups` groups ran or `stop()`.

        Task of group g: a fixed shuffle of `tasks`, interleaved across workers, so a restarted
        worker continues with the same tasks.
        """
        order = list(range(len(tasks)))
        random.Random(seed * 1000 + 7).shuffle(order)
        slots = asyncio.Semaphore(max(1, self.max_concurrent_episodes // self.group_size))
        pending: set[asyncio.Task] = set()
        first = self.started

        async def one(g: int) -> None:
            try:
                task = tasks[order[(g * self.num_workers + self.worker_index) % len(order)]]
                samples = await self.run_group(task, g)
                if self.writer is not None:
                    await asyncio.to_thread(self.write_group, samples)
                if on_group is not None:
                    on_group(samples)
            finally:
                slots.release()

        while True:
            if stop is not None and stop():
                break
            if num_groups is not None and self.started - first >= num_groups:
                break
            if self.room() <= 0:
                self.stats.admission_waits += 1
                await asyncio.sleep(self.poll_interval_s)
                continue
            await slots.acquire()
            g = self.started
            self.started += 1
            self.stats.groups_started += 1
            t = asyncio.create_task(one(g))
            pending.add(t)
            t.add_done_callback(pending.discard)
        if pending:
            await asyncio.gather(*pending)
        return self.stats.as_dict()


async def evaluate_agent(
    engine: Any,
    tokenizer: Any,
    agent: AgentFn | str,
    tasks: Sequence[dict[str, Any]],
    max_concurrent_episodes: int = 32,
    sampling: SamplingParams | None = None,
    tool_prompt: str = "none",
    limits: ProxyLimits | None = None,
) -> float:
    """Held-out success rate: mean reward of one greedy episode per task (nothing is written)."""
    runner = AgentRunner(
        engine,
        tokenizer,
        agent,
        group_size=1,
        admission=False,
        max_concurrent_episodes=max_concurrent_episodes,
        sampling=sampling or SamplingParams(max_new_tokens=64, greedy=True, temperature=0.0),
        tool_prompt=tool_prompt,
        limits=limits,
    )
    with runner:
        sem = asyncio.Semaphore(max_concurrent_episodes)

        async def one(task: dict[str, Any]) -> float:
            async with sem:
                r = await runner.run_episode(task)
                return r.reward or 0.0

        rewards = await asyncio.gather(*(one(t) for t in tasks))
    return sum(rewards) / max(len(rewards), 1)


def run_agent_rollout_worker(
    run_uri: str,
    index: int = 0,
    agent: str | None = None,
    max_concurrent_episodes: int | None = None,
    episode_timeout_s: float | None = None,
    turn_discount: float | None = None,
    tool_prompt: str | None = None,
) -> dict[str, Any]:
    """The rollout role for agent workflows: follows weights/LATEST, stops at DONE.

    Reads rollout.{agent, num_workers, group_size, max_new_tokens, temperature, top_p, top_k,
    poll_interval_s, admission}, agent.{max_concurrent_episodes, episode_timeout_s,
    turn_discount, tool_prompt}, train.{eta, batch_groups}, seed and device from the run's
    config; arguments given here override them (`python -m areal_core.run.roles rollout` runs this
    when rollout.agent is set).
    """
    from areal_core.models import load_pretrained
    from areal_core.prompts import load_prompts
    from areal_core.rollout.torch_engine import TorchEngine
    from areal_core.run.context import load_run_config, set_threads, wait_for_version
    from areal_core.store import INIT_MODEL
    from areal_core.weights.reader import load_state_dict
    from areal_core.weights.watcher import WeightWatcher

    store = Store(run_uri)
    cfg = load_run_config(store)
    set_threads(cfg.threads_per_role)
    ac = cfg.agent
    agent = agent or cfg.rollout.agent or "areal_core.proxy.examples:calculator_agent"
    max_concurrent_episodes = max_concurrent_episodes or ac.max_concurrent_episodes
    episode_timeout_s = episode_timeout_s or ac.episode_timeout_s
    turn_discount = ac.turn_discount if turn_discount is None else turn_discount
    tool_prompt = tool_prompt or ac.tool_prompt
    worker_id = f"agent-{index}"
    tasks = load_prompts(store, "train")
    version = wait_for_version(store)
    model, tokenizer = load_pretrained(store.url(INIT_MODEL), cfg.device)
    model.load_state_dict(load_state_dict(store, version), strict=False)
    engine = TorchEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, version, seed=cfg.seed * 7919 + index)
    watcher = WeightWatcher(store, lambda v: engine.receive(store, v), cfg.rollout.poll_interval_s, version=version)
    watcher.start()
    ro = cfg.rollout
    sampling = SamplingParams(
        max_new_tokens=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k
    )
    runner = AgentRunner(
        engine,
        tokenizer,
        agent,
        store=store,
        worker_id=worker_id,
        worker_index=index,
        num_workers=ro.num_workers,
        group_size=ro.group_size,
        batch_groups=cfg.train.batch_groups,
        eta=cfg.train.eta,
        admission=ro.admission,
        max_concurrent_episodes=max_concurrent_episodes,
        episode_timeout_s=episode_timeout_s,
        turn_discount=turn_discount,
        sampling=sampling,
        tool_prompt=tool_prompt,
        poll_interval_s=ro.poll_interval_s,
    )
    t0 = time.time()

    def heartbeat(_: list[Sample]) -> None:
        s = runner.stats
        store.heartbeat(
            "rollout",
            worker_id,
            groups_started=runner.started,
            version=runner.version,
            episodes=s.episodes,
            episodes_failed=s.episodes_failed,
            rows=s.rows,
            mean_reward=s.as_dict()["mean_reward"],
            episodes_per_s=s.episodes / max(time.time() - t0, 1e-9),
        )

    with runner:
        stats = asyncio.run(runner.run(tasks, stop=store.done, on_group=heartbeat, seed=cfg.seed))
    watcher.stop()
    log.info("%s done: %s", worker_id, stats)
    return {"worker": worker_id, "groups": runner.started, **stats}
