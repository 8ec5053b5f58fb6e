"""Re-grade task: one call into areal_core.reward.regrade (a new graded layer beside the old one)."""

from __future__ import annotations

from flytekit import task

from jobs import steps
from jobs.catalog import REGRADED
from jobs.spec import doc_of
from tasks.deferred import ONE_MACHINE
from tasks.resources import ROLE, SECRETS

Regraded = REGRADED.named_tuple()


@task(task_config=ONE_MACHINE, requests=ROLE, retries=steps.RETRIES["regrade"], secret_requests=SECRETS)
@doc_of(steps.regrade)
def regrade_run(run: str, layer: str, reward: str, pool_size: int) -> Regraded:
    return Regraded(**steps.regrade(run, layer, reward, pool_size))
