"""Asynchronous GRPO.

One machine (`grpo`): prepare -> SFT -> run_async_rl (every role as a local process) -> evaluate.

    pyflyte run workflows/grpo.py grpo
    pyflyte run workflows/grpo.py grpo --cfg '{"train": {"steps": 100, "eta": 0}}'
    pyflyte run workflows/grpo.py grpo --overrides "train.steps=100 train.eta=0" --resume_run

The run config is one typed input, `cfg` (areal_core/config: RunConfig; the console renders it as
a form, and pyflyte rejects an unknown key or a bad value before any task starts), composed with
the YAML files of `config` and the dotted `overrides`. Precedence, lowest first: the model's
defaults < the YAML files < the fields of `cfg` that differ from the model's defaults <
`overrides`. So `cfg` changes what the YAML set, except back to a model default (use an override
for that). Bool inputs are flags: `--resume_run` (never `--resume_run true`).

A cluster (`grpo_cluster`, `pyflyte run --remote` only): prepare -> SFT -> start_run ->
[rollout pool (map task) | reward pool (map task) | trainer (kfpytorch Elastic)] -> evaluate ->
register. The three middle nodes have no edges between them: they run concurrently, meet only
in the run root, and each stops when the trainer writes DONE. Images, resources, retries,
replica counts and the schedule come from the cluster config ($AREAL_CLUSTER_CONFIG, default
configs/cluster.yaml; see areal_core/config/cluster.py and docs/cluster.md), read when the
workflow is serialized for registration, not when this module is imported (tasks/deferred.py).
A failed run's MLflow run is marked FAILED by the failure node (tasks/cluster.py: mark_failed).

    AREAL_CLUSTER_CONFIG=configs/cluster.yaml pyflyte --config flyte.yaml run --remote --copy all \\
        workflows/grpo.py grpo_cluster --overrides "store=s3://my-bucket/runs/exp1"

SFT is optional through the config: with `sft.enabled=false` the SFT task only materialises
the initial model (the tiny model, or `model.path`) in the run root. `grpo_cluster_weekly` is a
launch plan that retrains on a cron schedule, each run in its own run root, and e-mails
`schedule.notify` when a run fails.
"""

from __future__ import annotations

import datetime

from flytekit import CronSchedule, workflow

from areal_core.config import RunConfig
from areal_core.run.cluster import UNSCHEDULED, registered_cluster
from tasks.cluster import (
    failure_notifications,
    mark_failed,
    prepare_cluster,
    reward_pool,
    rollout_pool,
    single_pod,
    start_run,
)
from tasks.deferred import DeferredLaunchPlan
from tasks.pipeline import Accuracy, evaluate, prepare, run_async_rl, sft
from tasks.register import register
from tasks.roles import trainer


@workflow
def grpo(
    cfg: RunConfig = RunConfig(),
    config: str = "configs/default.yaml",
    overrides: str = "",
    resume_run: bool = False,
) -> Accuracy:
    """Asynchronous GRPO on one machine: prepare, SFT (cached), every role as a local process, evaluate.

    :param cfg: the run config as JSON; its fields that differ from the defaults apply over the YAML files (README)
    :param config: YAML config files, comma-separated, applied in order over the defaults
    :param overrides: dotted key=value overrides, whitespace-separated with shell quoting, applied last
    :param resume_run: a flag: continue the run in the run root (same run id and config) instead of starting afresh
    """
    prepared = prepare(cfg=cfg, config=config, overrides=overrides, resume=resume_run)
    checkpoint = sft(run_uri=prepared.run_uri, sft_key=prepared.sft_key)
    models = run_async_rl(run_uri=prepared.run_uri, sft_checkpoint=checkpoint)
    return evaluate(run_uri=prepared.run_uri, init_model=models.init_model, final_model=models.final_model)


@workflow(on_failure=mark_failed)
def grpo_cluster(
    cfg: RunConfig = RunConfig(),
    config: str = "configs/default.yaml",
    overrides: str = "",
    resume_run: bool = False,
    model_name: str = "areal-flyte-policy",
    kickoff_time: datetime.datetime = UNSCHEDULED,
) -> str:
    """Asynchronous GRPO on a Flyte cluster; returns the registered final model's models:/ URI ('': no tracking).

    :param cfg: the run config as JSON; its fields that differ from the defaults apply over the YAML files (README)
    :param config: YAML config files, comma-separated, applied in order over the defaults
    :param overrides: dotted key=value overrides, whitespace-separated with shell quoting, applied last
    :param resume_run: a flag: continue the run in the run root (same run id and config) instead of starting afresh
    :param model_name: the MLflow registered model the final model is registered under
    :param kickoff_time: set by the schedule: the run's own root is <store>/<kickoff time>; 1970-01-01 (default): manual
    """
    prepared = prepare_cluster(
        cfg=cfg, config=config, overrides=overrides, resume_run=resume_run, kickoff_time=kickoff_time
    )
    # SFT and evaluation run in the cluster's image on its `single` pod (the single-machine tasks default to cpu)
    single = single_pod()
    checkpoint = sft(run_uri=prepared.run_uri, sft_key=prepared.sft_key).with_overrides(**single)
    started = start_run(run_uri=prepared.run_uri, sft_checkpoint=checkpoint)
    # the three concurrent roles: each depends only on start_run
    rollout_pool(started.run_uri)
    reward_pool(started.run_uri)
    final_model = trainer(run_uri=started.run_uri)
    evaluated = evaluate(run_uri=started.run_uri, init_model=started.init_model, final_model=final_model)
    accuracy = evaluated.with_overrides(**single)
    return register(run_uri=started.run_uri, model_name=model_name, before=accuracy.before, after=accuracy.after)


# Recurring retraining: every run gets its own run root <store>/<kickoff time> (the kickoff time
# is passed by the scheduler), and registers a new model version. Activate it after registering:
#   flytectl update launchplan -p <project> -d <domain> grpo_cluster_weekly --version <v> --activate
def weekly() -> dict:
    """The weekly launch plan's inputs, schedule and notifications: the cluster config's `schedule`."""
    sched = registered_cluster().schedule
    return {
        "default_inputs": {
            "config": sched.config,
            "overrides": sched.overrides,
            "resume_run": False,
            "model_name": sched.model_name,
        },
        "schedule": CronSchedule(schedule=sched.cron, kickoff_time_input_arg="kickoff_time"),
        "notifications": failure_notifications(),
    }


grpo_cluster_weekly = DeferredLaunchPlan.deferred("grpo_cluster_weekly", grpo_cluster, weekly)
