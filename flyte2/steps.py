"""The steps around the roles, as Flyte 2 tasks: each calls its step of jobs/steps.py (one call into
areal_core), the same function the flytekit task of that step calls (tasks/pipeline.py,
tasks/cluster.py, tasks/register.py), and shows its text (jobs/spec.py: doc_of). The SFT cache is
the job spec's (jobs/catalog.py: SFT_CACHE), as flytekit's is.

A task returns plain values (URIs as strings, tuples): a model stays in its run root, where every
role and step finds it. The steps are plain (sync) functions: Flyte 2 runs each in a thread of its
own, so its blocking work never holds the event loop that awaits the other tasks.
"""

from __future__ import annotations

import datetime
import os

import flyte

from areal_core.config import RunConfig
from areal_core.run import cluster, pipeline
from areal_core.run.tracking import Execution
from flyte2.envs import CLUSTER, PREPARE, SINGLE, SMALL, task_settings
from jobs import steps
from jobs.catalog import SFT_CACHE
from jobs.spec import doc_of

# the job spec's SFT cache (jobs/catalog.py); the salt carries its version
CACHE = flyte.Cache(behavior="auto", salt=f"sft-{SFT_CACHE.version}", ignored_inputs=SFT_CACHE.ignored)


def bind_execution() -> Execution:
    """The Flyte 2 run this task belongs to, in this process's environment for areal_core (which
    names the MLflow run after it and tags it: areal_core/run/tracking.py). A local run binds
    nothing (its MLflow runs get generated names, as under flytekit's local executor)."""
    tctx = flyte.ctx()
    action = tctx.action if tctx else None
    if not action or tctx.mode == "local" or not action.run_name:
        return Execution()
    execution = Execution(action.run_name, action.project or "", action.domain or "")
    os.environ.update(execution.env())
    return execution


def image_name() -> str:
    """The image this task runs in (MLflow tags): in a pod its registered name ($AREAL_IMAGE)."""
    from flyte2.images import image_for

    return os.environ.get(cluster.IMAGE_ENV) or image_for(CLUSTER.device).uri


@PREPARE.task(**task_settings(CLUSTER.prepare))
@doc_of(steps.prepare)
def prepare(cfg: RunConfig, config: str, overrides: str, resume: bool) -> tuple[str, str]:
    return steps.prepare(cfg, config, overrides, resume)


@PREPARE.task(**task_settings(CLUSTER.prepare))
@doc_of(steps.prepare_cluster)
def prepare_cluster(
    cfg: RunConfig, config: str, overrides: str, resume_run: bool, kickoff_time: datetime.datetime
) -> tuple[str, str]:
    return steps.prepare_cluster(cfg, config, overrides, resume_run, kickoff_time)


@SINGLE.task(cache=CACHE, **task_settings(CLUSTER.single))
@doc_of(steps.sft)
def sft(run_uri: str, sft_key: str) -> str:
    return steps.sft(run_uri)


@SMALL.task(**task_settings(CLUSTER.small))
@doc_of(steps.start_run)
def start_run(run_uri: str, sft_checkpoint: str) -> str:
    bind_execution()
    return steps.start_run(run_uri, sft_checkpoint, image_name)


@SINGLE.task(report=True, **task_settings(CLUSTER.single))
@doc_of(steps.evaluate)
def evaluate(run_uri: str) -> tuple[float, float]:
    bind_execution()
    result = steps.evaluate(run_uri)
    if result["report"]:
        flyte.report.replace(result["report"], do_flush=True)
    return float(result["before"]), float(result["after"])


@SMALL.task(**task_settings(CLUSTER.small))
@doc_of(steps.register)
def register(run_uri: str, model_name: str, before: float, after: float) -> str:
    return steps.register(run_uri, model_name, before, after, image_name)


def mark_failed(run_uri: str) -> None:
    """A failed job's MLflow run (if one was opened) is marked FAILED; never hides the job's error."""
    try:
        pipeline.mark_failed(run_uri)
    except Exception as exc:  # noqa: BLE001 - the job's own error is what propagates
        print(f"the MLflow run of {run_uri} was not marked FAILED: {type(exc).__name__}: {exc}")
