"""The job spec (jobs/catalog.py) in flytekit's terms: a job is a `@workflow` whose signature,
annotations and `:param` docs are generated from the job's inputs (jobs/spec.py: function), its
output a NamedTuple of the job's record, its schedule a launch plan read at registration
(tasks/deferred.py: DeferredLaunchPlan). The body a workflow module gives is only the data flow
between its tasks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flytekit import CronSchedule, Email, WorkflowExecutionPhase, workflow
from flytekit.core.workflow import WorkflowBase

from jobs.spec import Given, Job, Record, function
from tasks.deferred import DeferredLaunchPlan

FAILED = [WorkflowExecutionPhase.FAILED, WorkflowExecutionPhase.TIMED_OUT, WorkflowExecutionPhase.ABORTED]


def output_type(output: Any) -> Any:
    """A record as a NamedTuple (flytekit's named outputs); a plain type as it is."""
    return output.named_tuple() if isinstance(output, Record) else output


def workflow_of(job: Job, body: Callable[[Given], Any], **options: Any) -> WorkflowBase:
    """The job as a flytekit workflow (`options`: `@workflow`'s, e.g. on_failure)."""
    return workflow(function(job, body, output_type(job.output)), **options)


def launch_plan(job: Job, wf: WorkflowBase) -> DeferredLaunchPlan:
    """The job's schedule as a launch plan whose inputs, cron and notifications are read when it is
    registered (the cluster config), never at import."""
    schedule = job.schedule
    assert schedule is not None, f"{job.name} has no schedule"

    def plan() -> dict[str, Any]:
        got = schedule.plan()
        return {
            "default_inputs": got.inputs,
            "schedule": CronSchedule(schedule=got.cron, kickoff_time_input_arg=got.kickoff_input),
            "notifications": [Email(phases=FAILED, recipients_email=list(got.notify))],
        }

    return DeferredLaunchPlan.deferred(schedule.name, wf, plan)
