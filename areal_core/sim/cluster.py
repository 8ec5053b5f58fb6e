"""Event-driven simulation of the asynchronous pipeline: R rollout workers (continuous-batching
engines with `slots` concurrent sequences), K reward workers, a data-parallel trainer of T
workers, meeting through queues with the real staleness rules:

* admission: before starting a group, rollout worker w asks
  `staleness.groups_admissible(started_w, v_w, η, B, w, R)` with v_w its loaded version;
* hard bound and batch choice: graded groups wait in the trainer's real `GroupBuffer`; before
  each step `drop_stale(v, η)` drops (and counts) samples older than v − η, `take(B)` picks the
  B groups with the oldest tokens.

Interruptible generation: a published version pauses every rollout worker for the weight load
plus a re-prefill of its in-flight tokens; in-flight sequences then continue (their oldest token
keeps the version they started under). η = 0 is synchronous RL through the same code: one
batch per version, generation idle while the trainer trains and vice versa.

Decoding is modelled as a fluid: between two events a worker with n active sequences advances
every one of them by (elapsed / step_s(n)) tokens.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from areal_core.sim.costs import DecodeCost, LengthDistribution, RewardCost, TrainCost
from areal_core.staleness import admission_capacity, groups_admissible

EPS = 1e-9


@dataclass
class SimConfig:
    rollout_workers: int = 64
    slots: int = 64  # concurrent sequences per rollout worker
    reward_workers: int = 64  # CPU graders: sized not to bind
    trainer_workers: int = 16
    batch_groups: int = 64  # B
    group_size: int = 16  # G
    eta: int = 4
    steps: int = 60
    warmup_steps: int = 10  # excluded from the throughput measurement
    admission: bool = True
    prompt_tokens: int = 256
    lengths: LengthDistribution = field(default_factory=LengthDistribution)
    decode: DecodeCost = field(default_factory=DecodeCost)
    train: TrainCost = field(default_factory=TrainCost)
    reward: RewardCost = field(default_factory=RewardCost)
    weight_sync_s: float = 1.0  # a rollout worker's pause to load a new version (plus re-prefill)
    seed: int = 0

    def replace(self, **changes: Any) -> SimConfig:
        return dataclasses.replace(self, **changes)


@dataclass
class SimResult:
    config: SimConfig
    steps: int
    sim_time_s: float
    throughput: float  # trained samples per second, after warm-up
    token_throughput: float  # trained response tokens per second, after warm-up
    capacity: dict[str, float]  # samples/s: generation, training, reward, ideal = min(generation, training)
    efficiency: float  # throughput / ideal
    rollout_utilization: float  # time-averaged busy slots / slots
    trainer_utilization: float  # busy (training + publishing) time / time
    dropped_samples: int
    staleness_histogram: dict[int, int]  # trained samples by (trainer version − oldest token version)
    admission_violations: int
    step_end_s: list[float] = field(repr=False, default_factory=list)

    def summary(self) -> dict[str, Any]:
        trained = sum(self.staleness_histogram.values())
        mean_stale = sum(k * v for k, v in self.staleness_histogram.items()) / max(trained, 1)
        return {
            "eta": self.config.eta,
            "throughput": round(self.throughput, 3),
            "ideal": round(self.capacity["ideal"], 3),
            "efficiency": round(self.efficiency, 4),
            "rollout_utilization": round(self.rollout_utilization, 3),
            "trainer_utilization": round(self.trainer_utilization, 3),
            "dropped_samples": self.dropped_samples,
            "staleness_mean": round(mean_stale, 3),
            "staleness_max": max(self.staleness_histogram, default=0),
        }


class _Sample:
    """What GroupBuffer needs of a sample: group_id and min_version(); identity equality."""

    __slots__ = ("group_id", "version", "length", "worker", "finish_k")

    def __init__(self, group_id: str, version: int, length: int, worker: int):
        self.group_id, self.version, self.length, self.worker = group_id, version, length, worker
        self.finish_k = 0.0

    def min_version(self) -> int:
        return self.version


class _Worker:
    def __init__(self, index: int):
        self.index = index
        self.k = 0.0  # decode steps done (fluid)
        self.last_t = 0.0
        self.paused_until = 0.0
        self.version = 0
        self.pending_version: int | None = None
        self.started = 0  # groups started
        self.active: list[tuple[float, int, _Sample]] = []  # heap by finish_k
        self.queue: deque[_Sample] = deque()  # admitted, waiting for a free slot
        self.epoch = 0
        self.busy_slot_s = 0.0


def capacities(cfg: SimConfig) -> dict[str, float]:
    """Steady-state capacities in samples/s when nothing waits on anything else."""
    mean_len = cfg.lengths.mean()
    s = cfg.slots
    gen = cfg.rollout_workers * s / (mean_len * cfg.decode.step_s(s))
    batch = cfg.batch_groups * cfg.group_size
    step = cfg.train.step_s(int(batch * (mean_len + cfg.prompt_tokens)), cfg.trainer_workers) + cfg.train.publish_s
    train = batch / step
    reward = cfg.reward_workers / cfg.reward.mean()
    return {
        "generation": gen,
        "training": train,
        "reward": reward,
        "ideal": min(gen, train),
        "mean_response_tokens": mean_len,
    }


def simulate(cfg: SimConfig) -> SimResult:
    """The cluster run `cfg` describes, event by event, until `cfg.steps` trainer steps."""
    return _Simulation(cfg).run()


class _Simulation:
    """One simulated run: rollout workers, a reward pool and a trainer meeting in an event queue
    (time, sequence, kind, payload). Kinds: "worker" (a worker's next finished sample or end of
    pause), "graded" (a sample's reward), "trained" (a step done)."""

    def __init__(self, cfg: SimConfig):
        from areal_core.train.batch import GroupBuffer

        self.cfg = cfg
        self.rng_len = random.Random(cfg.seed * 1_000_003 + 1)
        self.rng_reward = random.Random(cfg.seed * 1_000_003 + 2)
        self.workers = [_Worker(i) for i in range(cfg.rollout_workers)]
        self.events: list[tuple[float, int, str, Any]] = []
        self.counter = 0
        # trainer state
        self.buffer = GroupBuffer()
        self.trainer_version = 0
        self.trainer_busy = False
        self.trainer_busy_s = 0.0
        self.step = 0
        self.step_end: list[float] = []
        self.trained_tokens_after_warmup = 0
        self.dropped = 0
        self.hist: Counter[int] = Counter()
        self.violations = 0
        self.total_started = 0
        # reward state
        self.reward_free = cfg.reward_workers
        self.reward_queue: deque[_Sample] = deque()
        self.graded_in_group: Counter[str] = Counter()
        self.group_samples: dict[str, list[_Sample]] = {}

    def push(self, t: float, kind: str, payload: Any) -> None:
        self.counter += 1
        heapq.heappush(self.events, (t, self.counter, kind, payload))

    def step_s(self, n: int) -> float:
        return self.cfg.decode.step_s(n)

    def advance(self, w: _Worker, t: float) -> None:
        start = max(w.last_t, w.paused_until)
        if t > start and w.active:
            w.k += (t - start) / self.step_s(len(w.active))
            w.busy_slot_s += (t - start) * len(w.active)
        w.last_t = t

    def reschedule(self, w: _Worker, t: float) -> None:
        w.epoch += 1
        if w.paused_until > t + EPS:
            self.push(w.paused_until, "worker", (w.index, w.epoch))
        elif w.active:
            nxt = t + max(0.0, w.active[0][0] - w.k) * self.step_s(len(w.active))
            self.push(nxt, "worker", (w.index, w.epoch))

    def admit(self, w: _Worker, t: float) -> None:
        """Start groups while a slot is free and admission allows; their samples fill free slots."""
        cfg, B, R = self.cfg, self.cfg.batch_groups, self.cfg.rollout_workers
        while len(w.active) + len(w.queue) < cfg.slots:
            if cfg.admission and groups_admissible(w.started, w.version, cfg.eta, B, w.index, R) <= 0:
                break
            gid = f"w{w.index}-g{w.started}"
            w.started += 1
            self.total_started += 1
            if cfg.admission and self.total_started > admission_capacity(
                max(x.version for x in self.workers), cfg.eta, B
            ):
                self.violations += 1
            group = [_Sample(gid, w.version, cfg.lengths.sample(self.rng_len), w.index) for _ in range(cfg.group_size)]
            self.group_samples[gid] = group
            w.queue.extend(group)
            # prefill of the group's prompts stalls this engine's decoding
            prefill_s = cfg.group_size * cfg.prompt_tokens / cfg.decode.prefill_tokens_per_s
            w.paused_until = max(w.paused_until, t) + prefill_s
        while w.queue and len(w.active) < cfg.slots:
            s = w.queue.popleft()
            s.finish_k = w.k + s.length
            heapq.heappush(w.active, (s.finish_k, id(s), s))

    def start_grading(self, t: float) -> None:
        while self.reward_free and self.reward_queue:
            s = self.reward_queue.popleft()
            self.reward_free -= 1
            self.push(t + self.cfg.reward.sample(self.rng_reward), "graded", s)

    def try_train(self, t: float) -> None:
        cfg = self.cfg
        if self.trainer_busy or self.step >= cfg.steps or len(self.buffer) < cfg.batch_groups:
            return
        self.dropped += len(self.buffer.drop_stale(self.trainer_version, cfg.eta))
        samples = self.buffer.take(cfg.batch_groups)
        if samples is None:
            return
        self.trainer_busy = True
        tokens = sum(s.length + cfg.prompt_tokens for s in samples)
        duration = cfg.train.step_s(tokens, cfg.trainer_workers) + cfg.train.publish_s
        self.push(t + duration, "trained", (samples, duration))

    def publish(self, t: float, version: int) -> None:
        cfg = self.cfg
        for w in self.workers:
            self.advance(w, t)
            in_flight = sum(cfg.prompt_tokens + max(0.0, w.k - (f - s.length)) for f, _, s in w.active)
            w.paused_until = max(w.paused_until, t) + cfg.weight_sync_s + in_flight / cfg.decode.prefill_tokens_per_s
            w.pending_version = version
            self.reschedule(w, t)

    def on_worker(self, t: float, payload: tuple[int, int]) -> None:
        index, epoch = payload
        w = self.workers[index]
        if epoch != w.epoch:
            return
        self.advance(w, t)
        if w.pending_version is not None and t + EPS >= w.paused_until:
            w.version, w.pending_version = w.pending_version, None
        while w.active and w.active[0][0] <= w.k + 1e-6:
            _, _, s = heapq.heappop(w.active)
            self.reward_queue.append(s)
        self.start_grading(t)
        if t + EPS >= w.paused_until:
            self.admit(w, t)
        self.reschedule(w, t)

    def on_graded(self, t: float, s: _Sample) -> None:
        self.reward_free += 1
        self.graded_in_group[s.group_id] += 1
        if self.graded_in_group[s.group_id] == self.cfg.group_size:
            self.buffer.add(self.group_samples.pop(s.group_id))
            del self.graded_in_group[s.group_id]
        self.start_grading(t)
        self.try_train(t)

    def on_trained(self, t: float, payload: tuple[list[_Sample], float]) -> None:
        samples, duration = payload
        self.trainer_busy_s += duration
        for s in samples:
            self.hist[self.trainer_version - s.version] += 1
        if self.step >= self.cfg.warmup_steps:
            self.trained_tokens_after_warmup += sum(s.length for s in samples)
        self.step += 1
        self.trainer_version += 1
        self.step_end.append(t)
        self.trainer_busy = False
        self.publish(t, self.trainer_version)
        for w in self.workers:  # a worker idle at its admission limit wakes up after the pause
            if not w.active:
                w.epoch += 1
                self.push(w.paused_until, "worker", (w.index, w.epoch))
        self.try_train(t)

    def run(self) -> SimResult:
        for w in self.workers:
            self.admit(w, 0.0)
            self.reschedule(w, 0.0)
        handlers = {"worker": self.on_worker, "graded": self.on_graded, "trained": self.on_trained}
        t = 0.0
        while self.events and self.step < self.cfg.steps:
            t, _, kind, payload = heapq.heappop(self.events)
            handlers[kind](t, payload)
        if self.step < self.cfg.steps:
            raise RuntimeError(f"simulation stalled at step {self.step}/{self.cfg.steps} (t={t:.1f}s)")
        return self.result()

    def result(self) -> SimResult:
        cfg, step_end = self.cfg, self.step_end
        t0 = step_end[cfg.warmup_steps - 1] if cfg.warmup_steps else 0.0
        span = step_end[-1] - t0
        measured = cfg.steps - cfg.warmup_steps
        throughput = measured * cfg.batch_groups * cfg.group_size / span
        cap = capacities(cfg)
        end = step_end[-1]
        busy = sum(w.busy_slot_s for w in self.workers)
        return SimResult(
            config=cfg,
            steps=self.step,
            sim_time_s=end,
            throughput=throughput,
            token_throughput=self.trained_tokens_after_warmup / span,
            capacity=cap,
            efficiency=throughput / cap["ideal"],
            rollout_utilization=busy / (end * cfg.rollout_workers * cfg.slots),
            trainer_utilization=self.trainer_busy_s / end,
            dropped_samples=self.dropped,
            staleness_histogram=dict(sorted(self.hist.items())),
            admission_violations=self.violations,
            step_end_s=step_end,
        )


def compare(cfg: SimConfig) -> dict[str, Any]:
    """Asynchronous (cfg.eta) against synchronous (η = 0) on the same cluster and costs."""
    asyn = simulate(cfg)
    sync = simulate(cfg.replace(eta=0))
    return {
        "async": asyn.summary(),
        "sync": sync.summary(),
        "speedup": asyn.throughput / sync.throughput,
        "capacity": {k: round(v, 3) for k, v in asyn.capacity.items()},
    }
