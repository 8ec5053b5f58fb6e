"""Fork task: one call into areal_core.run.fork (a new run root from a run's checkpoint)."""

from __future__ import annotations

from typing import NamedTuple

from flytekit import task

from areal_core.run import fork as fork_lib
from tasks.deferred import ONE_MACHINE
from tasks.execution import bind_execution
from tasks.resources import SECRETS, SMALL


class Forked(NamedTuple):
    run_uri: str
    sft_checkpoint: str  # the child's initial model (run_async_rl's input)


@task(task_config=ONE_MACHINE, requests=SMALL, secret_requests=SECRETS)
def fork_run(run: str, step: int, into: str, overrides: str) -> Forked:
    """Make the child root `into` from `run`'s checkpoint at `step` under `overrides`."""
    bind_execution()
    return Forked(**fork_lib.fork_task(run, step, into, overrides))
