"""The steps around the roles, as Flyte 2 tasks: each one call into areal_core, the same call the
flytekit task of that step makes (tasks/pipeline.py, tasks/cluster.py, tasks/register.py).

    prepare          pipeline.prepare             (tasks/pipeline.py: prepare)
    prepare_cluster  cluster.prepare_task         (tasks/cluster.py: prepare_cluster)
    sft              pipeline.sft, cached on sft_key alone (tasks/pipeline.py: sft)
    start_run        pipeline.start_run           (tasks/cluster.py: start_run)
    evaluate         pipeline.evaluate_run, the run's report as this task's Flyte 2 report
    register         registry.register_final_model (tasks/register.py: register)

A task returns plain values (URIs as strings, tuples): a model stays in its run root, where every
role and step finds it. The steps are plain (sync) functions: Flyte 2 runs each in a thread of its
own, so its blocking work never holds the event loop that awaits the other tasks.
"""

from __future__ import annotations

import datetime
import os

import flyte

from areal_core.config import ConfigError, RunConfig
from areal_core.run import cluster, pipeline
from areal_core.run.tracking import Execution
from flyte2.envs import CLUSTER, SINGLE, SMALL, task_settings

# The SFT result depends only on sft_key (seed, task, model and SFT settings), not on the run root,
# so another run (a scheduled one, a new store) hits it. `salt`: bump when SFT changes what it
# produces for the same key. A hit is copied into the run root by start_run, and a hit whose
# folder is gone is trained again there (pipeline.ensure_init_model).
SFT_CACHE = flyte.Cache(behavior="auto", salt="sft-2", ignored_inputs=("run_uri",))


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


@SMALL.task(**task_settings(CLUSTER.small))
def prepare(cfg: RunConfig, config: str, overrides: str, resume: bool) -> tuple[str, str]:
    """Validate the config (YAML files < the typed config's changes < overrides), then write
    config.yaml and the prompt set to the run root; returns (run URI, SFT key)."""
    try:
        return pipeline.prepare(config, overrides, resume, typed=cfg)
    except ConfigError as exc:  # the message is the finding: one frame, not the stack
        raise ConfigError(str(exc)) from None


@SMALL.task(**task_settings(CLUSTER.small))
def prepare_cluster(
    cfg: RunConfig, config: str, overrides: str, resume: bool, kickoff_time: datetime.datetime
) -> tuple[str, str]:
    """Validate the config with the cluster's worker counts, device and backend, then write the run
    root; a scheduled run gets its own root <store>/<kickoff time>."""
    try:
        return cluster.prepare_task(cfg, config, overrides, resume, kickoff_time)
    except ConfigError as exc:
        raise ConfigError(str(exc)) from None


@SINGLE.task(cache=SFT_CACHE, **task_settings(CLUSTER.single))
def sft(run_uri: str, sft_key: str) -> str:
    """SFT warm start, cached on `sft_key` alone; returns the checkpoint's URI."""
    return pipeline.sft(run_uri)


@SMALL.task(**task_settings(CLUSTER.small))
def start_run(run_uri: str, sft_checkpoint: str) -> str:
    """Put the SFT checkpoint in the run root (a cache hit is copied, a vanished one recomputed)
    and open the run's MLflow run, tagged with the device and image."""
    bind_execution()
    return pipeline.start_run(run_uri, sft_checkpoint, cluster.pod_identity(image_name))


@SINGLE.task(report=True, **task_settings(CLUSTER.single))
def evaluate(run_uri: str) -> tuple[float, float]:
    """Held-out greedy accuracy before and after RL, logged to MLflow (with the final model), and
    the run's report (the doctor's verdict, curves, held-out answers) as this task's report."""
    bind_execution()
    result = pipeline.evaluate_run(run_uri)
    if result["report"]:
        flyte.report.replace(result["report"], do_flush=True)
    return float(result["before"]), float(result["after"])


@SMALL.task(**task_settings(CLUSTER.small))
def register(run_uri: str, model_name: str, before: float, after: float) -> str:
    """Register the final model and the newest checkpoint in the MLflow registry; returns the final
    model's models:/ URI ('' when the run has tracking disabled)."""
    from areal_core.online.registry import register_final_model

    return register_final_model(run_uri, model_name, before, after, *cluster.pod_identity(image_name).values())


def mark_failed(run_uri: str) -> None:
    """A failed job's MLflow run (if one was opened) is marked FAILED; never hides the job's error."""
    try:
        pipeline.mark_failed(run_uri)
    except Exception as exc:  # noqa: BLE001 - the job's own error is what propagates
        print(f"the MLflow run of {run_uri} was not marked FAILED: {type(exc).__name__}: {exc}")
