"""Online retraining on live traffic.

The proxy in front of a serving engine writes every finished session to a store
(`python -m areal_core.proxy --model <hf dir> --store s3://bucket/sessions --api-key ...`).
`online_retrain` trains on the sessions collected since the last run (a cursor on that store),
evaluates the candidate against the current model on the task's held-out split, and registers
it in MLflow only when it is better (areal_core/online/retrain.py):

    pyflyte run workflows/online.py online_retrain --sessions s3://bucket/sessions \\
        --config configs/agent_calculator.yaml --overrides "store=s3://bucket/online model.path=s3://bucket/base"

`sessions` defaults to `<store>/sessions`; the first run starts from `model.path`, later runs
from the newest registered version.

`online_retrain_nightly` runs it every night at 03:00 UTC; activate it after registering:
    flytectl update launchplan -p <project> -d <domain> online_retrain_nightly --version <v> --activate

`online_continuous` is continuous online RL (areal_core/online/continuous.py): prepare and SFT make
the run root, then the trainer trains on the sessions a proxy serving that root writes into it,
publishing every version, which the proxy installs as soon as it is verified:

    python -m areal_core.proxy --follow RUN/weights --store RUN --api-key $KEY --engine vllm ...
    pyflyte run workflows/online.py online_continuous --config configs/agent_calculator.yaml \
        --overrides "store=RUN sft.enabled=false model.path=s3://bucket/base"
"""

from __future__ import annotations

from typing import Any

from jobs.catalog import ONLINE_CONTINUOUS, ONLINE_RETRAIN
from jobs.spec import Given
from tasks.online import continuous_rl, register_if_better, retrain_on_sessions
from tasks.pipeline import prepare, sft
from workflows.translate import launch_plan, workflow_of


def _online_retrain(given: Given) -> Any:
    run_uri = retrain_on_sessions(**given.take("config", "overrides", "sessions", "model_name", "kickoff_time"))
    return register_if_better(run_uri=run_uri, min_gain=given.min_gain)


def _online_continuous(given: Given) -> Any:
    prepared = prepare(**given.take("cfg", "config", "overrides", resume="resume_run"))
    checkpoint = sft(run_uri=prepared.run_uri, sft_key=prepared.sft_key)
    return continuous_rl(run_uri=prepared.run_uri, sft_checkpoint=checkpoint)


online_retrain = workflow_of(ONLINE_RETRAIN, _online_retrain)
online_continuous = workflow_of(ONLINE_CONTINUOUS, _online_continuous)
online_retrain_nightly = launch_plan(ONLINE_RETRAIN, online_retrain)
