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

import datetime

from flytekit import CronSchedule, workflow

from areal_core.config import RunConfig
from areal_core.run.cluster import UNSCHEDULED
from tasks.cluster import failure_notifications
from tasks.deferred import DeferredLaunchPlan
from tasks.online import OnlineResult, continuous_rl, register_if_better, retrain_on_sessions
from tasks.pipeline import prepare, sft

NIGHTLY_CRON = "0 3 * * *"


@workflow
def online_retrain(
    sessions: str = "",
    config: str = "configs/agent_calculator.yaml",
    overrides: str = "",
    model_name: str = "areal-online-policy",
    min_gain: float = 0.0,
    kickoff_time: datetime.datetime = UNSCHEDULED,
) -> OnlineResult:
    """Retrain on the sessions the proxy collected since the last run; register the candidate only when it is better.

    :param sessions: the proxy's session store; empty: <store>/sessions
    :param config: YAML config files, comma-separated, applied in order over the defaults
    :param overrides: dotted key=value overrides, whitespace-separated with shell quoting, applied last
    :param model_name: the MLflow registered model to compare with and register under
    :param min_gain: how much better (held-out score) the candidate must be to be registered
    :param kickoff_time: set by the schedule: names the run; 1970-01-01 (default): a manual run, named by the time
    """
    run_uri = retrain_on_sessions(
        config=config, overrides=overrides, sessions=sessions, model_name=model_name, kickoff_time=kickoff_time
    )
    return register_if_better(run_uri=run_uri, min_gain=min_gain)


@workflow
def online_continuous(
    cfg: RunConfig = RunConfig(),
    config: str = "configs/agent_calculator.yaml",
    overrides: str = "",
    resume_run: bool = False,
) -> str:
    """Continuous online RL: the trainer and the reward pool on a run root that a serving proxy
    (`--follow RUN/weights --store RUN`) feeds with sessions; returns the final model's URI.

    :param cfg: the run config as JSON; its fields that differ from the defaults apply over the YAML files
    :param config: YAML config files, comma-separated, applied in order over the defaults
    :param overrides: dotted key=value overrides, whitespace-separated with shell quoting, applied last
    :param resume_run: a flag: continue the run in the run root (same run id and config)
    """
    prepared = prepare(cfg=cfg, config=config, overrides=overrides, resume=resume_run)
    checkpoint = sft(run_uri=prepared.run_uri, sft_key=prepared.sft_key)
    return continuous_rl(run_uri=prepared.run_uri, sft_checkpoint=checkpoint)


def nightly() -> dict:
    return {
        "default_inputs": {"config": "configs/agent_calculator.yaml", "model_name": "areal-online-policy"},
        "schedule": CronSchedule(schedule=NIGHTLY_CRON, kickoff_time_input_arg="kickoff_time"),
        "notifications": failure_notifications(),  # the cluster config's schedule.notify
    }


online_retrain_nightly = DeferredLaunchPlan.deferred("online_retrain_nightly", online_retrain, nightly)
