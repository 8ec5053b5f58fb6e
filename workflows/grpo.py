"""Asynchronous GRPO.

One machine (`grpo`): prepare -> SFT -> run_async_rl (every role as a local process) -> evaluate.

    pyflyte run workflows/grpo.py grpo
    pyflyte run workflows/grpo.py grpo --overrides "train.steps=100 train.eta=0"

A cluster (`grpo_cluster`, `pyflyte run --remote` only): prepare -> SFT -> start_run ->
[rollout pool (map task) | reward pool (map task) | trainer (kfpytorch Elastic)] -> evaluate ->
register. The three middle nodes have no edges between them: they run concurrently, meet only
in the run root, and each stops when the trainer writes DONE. Images, resources, retries and
replica counts come from the cluster config read at import ($AREAL_CLUSTER_CONFIG, default
configs/cluster.yaml; see areal_core/config/cluster.py and docs/cluster.md).

    AREAL_CLUSTER_CONFIG=configs/cluster.yaml pyflyte --config flyte.yaml run --remote \\
        workflows/grpo.py grpo_cluster --overrides "store=s3://my-bucket/runs/exp1"

SFT is optional through the config: with `sft.enabled=false` the SFT task only materialises
the initial model (the tiny model, or `model.path`) in the run root. `grpo_cluster_weekly` is a
launch plan that retrains on a cron schedule, each run in its own run root.
"""

from __future__ import annotations

import datetime

from flytekit import CronSchedule, LaunchPlan, workflow

from tasks.cluster import (
    CLUSTER,
    DEVICE,
    IMAGE_NAME,
    REWARD_INDICES,
    ROLLOUT_INDICES,
    prepare_cluster,
    reward_pool,
    rollout_pool,
    start_run,
    trainer_elastic,
)
from tasks.pipeline import Accuracy, evaluate, prepare, run_async_rl, sft
from tasks.register import register
from tasks.resources import task_kwargs


@workflow
def grpo(config: str = "configs/default.yaml", overrides: str = "", resume_run: bool = False) -> Accuracy:
    prepared = prepare(config=config, overrides=overrides, resume=resume_run)
    init_model = sft(run_uri=prepared.run_uri, sft_key=prepared.sft_key)
    final_model = run_async_rl(run_uri=prepared.run_uri, init_model=init_model)
    return evaluate(run_uri=prepared.run_uri, final_model=final_model)


# SFT and evaluation run in the cluster's image on one device (the single-machine tasks default to cpu)
_single = task_kwargs(CLUSTER.single, DEVICE)
_SINGLE_OVERRIDES = {
    "container_image": IMAGE_NAME,
    "requests": _single["requests"],
    "limits": _single["limits"] or _single["requests"],
    "retries": _single["retries"],
}
if "accelerator" in _single:
    _SINGLE_OVERRIDES["accelerator"] = _single["accelerator"]
if "pod_template" in _single:
    _SINGLE_OVERRIDES["pod_template"] = _single["pod_template"]


@workflow
def grpo_cluster(
    config: str = "configs/default.yaml",
    overrides: str = "",
    resume_run: bool = False,
    model_name: str = "areal-flyte-policy",
    kickoff_time: datetime.datetime | None = None,
) -> str:
    """Returns the registered final model's models:/ URI ('' when the run has tracking disabled)."""
    prepared = prepare_cluster(config=config, overrides=overrides, resume_run=resume_run, kickoff_time=kickoff_time)
    init_model = sft(run_uri=prepared.run_uri, sft_key=prepared.sft_key).with_overrides(**_SINGLE_OVERRIDES)
    run_uri = start_run(run_uri=prepared.run_uri, init_model=init_model)
    # the three concurrent roles: each depends only on start_run
    rollout_pool(run_uri=run_uri, index=ROLLOUT_INDICES)
    reward_pool(run_uri=run_uri, index=REWARD_INDICES)
    final_model = trainer_elastic(run_uri=run_uri)
    accuracy = evaluate(run_uri=run_uri, final_model=final_model).with_overrides(**_SINGLE_OVERRIDES)
    return register(run_uri=run_uri, model_name=model_name, before=accuracy.before, after=accuracy.after)


# Recurring retraining: every run gets its own run root <store>/<kickoff time> (the kickoff time
# is passed by the scheduler), and registers a new model version. Activate it after registering:
#   flytectl update launchplan -p <project> -d <domain> grpo_cluster_weekly --version <v> --activate
grpo_cluster_weekly = LaunchPlan.get_or_create(
    workflow=grpo_cluster,
    name="grpo_cluster_weekly",
    default_inputs={
        "config": CLUSTER.schedule.config,
        "overrides": CLUSTER.schedule.overrides,
        "resume_run": False,
        "model_name": CLUSTER.schedule.model_name,
    },
    schedule=CronSchedule(schedule=CLUSTER.schedule.cron, kickoff_time_input_arg="kickoff_time"),
)
