"""Fork task: one call into areal_core.run.fork (a new run root from a run's checkpoint)."""

from __future__ import annotations

from typing import NamedTuple

from flytekit import task

from jobs import steps
from jobs.spec import doc_of
from tasks.deferred import ONE_MACHINE
from tasks.execution import bind_execution
from tasks.resources import SECRETS, SMALL


class Forked(NamedTuple):
    run_uri: str
    sft_checkpoint: str  # the child's initial model (run_async_rl's input)


@task(task_config=ONE_MACHINE, requests=SMALL, secret_requests=SECRETS)
@doc_of(steps.fork)
def fork_run(run: str, step: int, into: str, overrides: str) -> Forked:
    bind_execution()
    return Forked(**steps.fork(run, step, into, overrides))
