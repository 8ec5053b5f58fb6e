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

from typing import Any

from jobs.catalog import GRPO, GRPO_CLUSTER
from jobs.spec import Given
from tasks.cluster import mark_failed, prepare_cluster, reward_pool, rollout_pool, single_pod, start_run
from tasks.pipeline import evaluate, prepare, run_async_rl, sft
from tasks.register import register
from tasks.roles import trainer
from workflows.translate import launch_plan, workflow_of


def _grpo(given: Given) -> Any:
    prepared = prepare(**given.take("cfg", "config", "overrides", resume="resume_run"))
    checkpoint = sft(run_uri=prepared.run_uri, sft_key=prepared.sft_key)
    models = run_async_rl(run_uri=prepared.run_uri, sft_checkpoint=checkpoint)
    return evaluate(run_uri=prepared.run_uri, init_model=models.init_model, final_model=models.final_model)


def _grpo_cluster(given: Given) -> Any:
    prepared = prepare_cluster(**given.take("cfg", "config", "overrides", "resume_run", "kickoff_time"))
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
    return register(run_uri=started.run_uri, model_name=given.model_name, before=accuracy.before, after=accuracy.after)


grpo = workflow_of(GRPO, _grpo)
grpo_cluster = workflow_of(GRPO_CLUSTER, _grpo_cluster, on_failure=mark_failed)
# Recurring retraining: every run gets its own run root <store>/<kickoff time> (the kickoff time
# is passed by the scheduler), and registers a new model version. Activate it after registering:
#   flytectl update launchplan -p <project> -d <domain> grpo_cluster_weekly --version <v> --activate
grpo_cluster_weekly = launch_plan(GRPO_CLUSTER, grpo_cluster)
