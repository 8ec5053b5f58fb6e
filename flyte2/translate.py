"""The job spec (jobs/catalog.py) in Flyte 2's terms: a job is an async task of the driver
environment whose signature, annotations and `:param` docs are generated from the job's inputs
(jobs/spec.py: function), its output a dataclass of the job's record, its schedule a trigger. The
body a module gives is only the order in which it awaits its tasks."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import flyte
from flyte import notify
from flyte.models import ActionPhase

from jobs.spec import Given, Job, Record, function

FAILED = (ActionPhase.FAILED, ActionPhase.TIMED_OUT, ActionPhase.ABORTED)


def output_type(output: Any) -> Any:
    """A record as a dataclass (Flyte 2's structured output); a plain type as it is."""
    return output.dataclass() if isinstance(output, Record) else output


def job_task(env: flyte.TaskEnvironment, job: Job, body: Callable[[Given], Awaitable[Any]], **options: Any) -> Any:
    """The job as an async task of `env` (`options`: `@env.task`'s, e.g. report), with its trigger."""
    triggers = {"triggers": trigger(job)} if job.schedule else {}
    return env.task(**options, **triggers)(function(job, body, output_type(job.output)))


def trigger(job: Job) -> flyte.Trigger:
    """The job's schedule: its fire time bound to the kickoff input, its inputs, who is e-mailed when
    a run fails, times out or is aborted."""
    assert job.schedule is not None, f"{job.name} has no schedule"
    plan = job.schedule.plan()
    return flyte.Trigger(
        name=job.schedule.name,
        automation=flyte.Cron(plan.cron),
        description=job.schedule.description,
        inputs={plan.kickoff_input: flyte.TriggerTime, **plan.inputs},
        notifications=notify.Email(on_phase=FAILED, recipients=plan.notify),
    )
