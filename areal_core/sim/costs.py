"""Cost distributions of the simulated roles: response lengths, decode, training and grading times."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass
class LengthDistribution:
    """Response lengths in tokens: lognormal (long tail) or constant, clipped to [min, max].

    The lognormal with median m and shape σ has mean m·exp(σ²/2); σ = 1 gives a tail where the
    longest of 1000 responses is ~20× the median (before the clip at `max_tokens`).
    """

    kind: str = "lognormal"  # lognormal | constant
    median_tokens: float = 1500.0
    sigma: float = 1.0
    min_tokens: int = 16
    max_tokens: int = 16384

    def sample(self, rng: random.Random) -> int:
        if self.kind == "constant":
            n = self.median_tokens
        elif self.kind == "lognormal":
            n = rng.lognormvariate(math.log(self.median_tokens), self.sigma)
        else:
            raise ValueError(f"unknown length distribution {self.kind!r}; expected lognormal or constant")
        return int(min(self.max_tokens, max(self.min_tokens, round(n))))

    def mean(self, n: int = 200_000, seed: int = 12345) -> float:
        """Mean of the clipped distribution (Monte Carlo; exact for constant)."""
        if self.kind == "constant":
            return float(self.sample(random.Random(0)))
        rng = random.Random(seed)
        return sum(self.sample(rng) for _ in range(n)) / n


@dataclass
class DecodeCost:
    """One decode step of a continuous-batching engine: base + per_seq·(active sequences) seconds.

    Decoding is memory bound: the base (reading the weights) dominates at small batches, so a
    worker's token rate grows with its number of active sequences up to `slots`."""

    base_s: float = 0.025
    per_seq_s: float = 0.00025
    prefill_tokens_per_s: float = 20000.0  # prompt prefill and re-prefill after a weight update

    def step_s(self, active: int) -> float:
        return self.base_s + self.per_seq_s * active


@dataclass
class TrainCost:
    """A training step: overhead + tokens / (workers · tokens_per_s_per_worker), then publication."""

    tokens_per_s_per_worker: float = 8000.0
    step_overhead_s: float = 2.0
    publish_s: float = 5.0  # weights to the store + LATEST (the trainer waits for it)

    def step_s(self, tokens: int, workers: int) -> float:
        return self.step_overhead_s + tokens / (workers * self.tokens_per_s_per_worker)


@dataclass
class RewardCost:
    """Grading latency per sample: lognormal around `median_s` (a verifier or a sandbox run)."""

    median_s: float = 0.3
    sigma: float = 1.0

    def sample(self, rng: random.Random) -> float:
        return rng.lognormvariate(math.log(self.median_s), self.sigma) if self.sigma > 0 else self.median_s

    def mean(self) -> float:
        return self.median_s * math.exp(self.sigma**2 / 2)
