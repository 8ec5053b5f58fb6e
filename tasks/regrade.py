"""Re-grade task: one call into areal_core.reward.regrade (a new graded layer beside the old one)."""

from __future__ import annotations

from typing import NamedTuple

from flytekit import task

from areal_core.reward.regrade import regrade
from tasks.deferred import ONE_MACHINE
from tasks.resources import ROLE, SECRETS


class Regraded(NamedTuple):
    layer: str
    samples: int
    changed: int
    samples_per_s: float


@task(task_config=ONE_MACHINE, requests=ROLE, retries=2, secret_requests=SECRETS)
def regrade_run(run: str, layer: str, reward: str, pool_size: int) -> Regraded:
    """Re-grade `run`'s graded samples with `reward` ('' = the run's own) into the layer `layer`
    (a retry continues the same request; a committed layer is never written again)."""
    summary = regrade(run, reward or None, layer, pool_size=pool_size).summary()
    return Regraded(layer, summary["samples"], summary["changed"], summary["samples_per_s"])
