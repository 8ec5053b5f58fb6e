"""Simulated-cost mode: the asynchronous pipeline at cluster scale, without a model.

Generation and training times are drawn from configurable distributions (long-tail response
lengths, per-token decode and training costs, grading latency); the staleness rules are the
real ones (`areal_core.staleness` for admission, `areal_core.train.batch.GroupBuffer` for the
hard bound and oldest-first batching). One process, event-driven.

    from areal_core.sim import SimConfig, compare
    print(compare(SimConfig(rollout_workers=64, trainer_workers=16, eta=4)))
"""

from areal_core.sim.cluster import SimConfig, SimResult, capacities, compare, simulate
from areal_core.sim.costs import LengthDistribution

__all__ = ["LengthDistribution", "SimConfig", "SimResult", "capacities", "compare", "simulate"]
