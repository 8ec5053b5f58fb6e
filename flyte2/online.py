"""Online retraining with the Flyte 2 SDK: the jobs of workflows/online.py, each step one call into
areal_core.online (as tasks/online.py).

    flyte run --local flyte2/online.py online_retrain --sessions s3://bucket/sessions \\
        --overrides "store=s3://bucket/online model.path=s3://bucket/base"
    flyte run --local flyte2/online.py online_continuous --overrides "store=RUN sft.enabled=false"

`online_retrain` carries the trigger `online_retrain_nightly` (every night at 03:00 UTC, as the
flytekit launch plan): its fire time names the run. `online_continuous` is continuous online RL on
a run root that a serving proxy (`--follow RUN/weights --store RUN`) feeds with sessions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime

import flyte
from flyte import notify
from flyte.models import ActionPhase

from areal_core.config import RunConfig
from areal_core.online import continuous, retrain
from areal_core.run.cluster import UNSCHEDULED, scheduled
from flyte2.envs import CLUSTER, DRIVER, ONE_MACHINE
from flyte2.grpo import check_config
from flyte2.steps import bind_execution, mark_failed, prepare, sft

NIGHTLY_CRON = "0 3 * * *"  # as workflows/online.py
ONLINE_CONFIG = "configs/agent_calculator.yaml"


@dataclasses.dataclass
class OnlineResult:
    rows: int
    registered: bool
    model_uri: str
    current_score: float
    candidate_score: float


@ONE_MACHINE.task(retries=1)
def retrain_on_sessions(
    config: str, overrides: str, sessions: str, model_name: str, kickoff_time: datetime.datetime
) -> str:
    """Train a candidate on the sessions past the cursor and score it against the current model;
    returns the online run root."""
    return retrain.retrain_task(config, overrides, sessions, model_name, scheduled(kickoff_time))


@ONE_MACHINE.task(retries=2)
def register_if_better(run_uri: str, min_gain: float) -> OnlineResult:
    """Register the candidate only when it beats the champion (then promoted), then move the cursor."""
    bind_execution()
    return OnlineResult(**retrain.publish_task(run_uri, min_gain))


@ONE_MACHINE.task(retries=2)
def continuous_rl(run_uri: str, sft_checkpoint: str) -> str:
    """The reward pool and the trainer over the sessions the serving proxy writes into the run root,
    until train.steps; returns the final model's URI. Retried: the trainer resumes from its checkpoint."""
    bind_execution()
    return continuous.continuous_task(run_uri, sft_checkpoint)


def nightly() -> flyte.Trigger:
    """Every night at 03:00 UTC with the online config; the cluster config's `schedule.notify` is
    e-mailed when a run fails, times out or is aborted."""
    failed = (ActionPhase.FAILED, ActionPhase.TIMED_OUT, ActionPhase.ABORTED)
    return flyte.Trigger(
        name="online_retrain_nightly",
        automation=flyte.Cron(NIGHTLY_CRON),
        description="nightly retraining on the sessions the proxy collected since the last run",
        inputs={"kickoff_time": flyte.TriggerTime, "config": ONLINE_CONFIG, "model_name": "areal-online-policy"},
        notifications=notify.Email(on_phase=failed, recipients=tuple(CLUSTER.schedule.notify)),
    )


@DRIVER.task(triggers=nightly())
async def online_retrain(
    sessions: str = "",
    config: str = ONLINE_CONFIG,
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
    :param kickoff_time: set by the trigger: names the run; 1970-01-01 (default): a manual run, named by the time
    """
    check_config(RunConfig(), config, overrides)
    run_uri = await retrain_on_sessions.aio(
        config=config, overrides=overrides, sessions=sessions, model_name=model_name, kickoff_time=kickoff_time
    )
    return await register_if_better.aio(run_uri=run_uri, min_gain=min_gain)


@DRIVER.task
async def online_continuous(
    cfg: RunConfig = RunConfig(),
    config: str = ONLINE_CONFIG,
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
    check_config(cfg, config, overrides)
    run_uri, sft_key = await prepare.aio(cfg=cfg, config=config, overrides=overrides, resume=resume_run)
    try:
        checkpoint = await sft.aio(run_uri=run_uri, sft_key=sft_key)
        return await continuous_rl.aio(run_uri=run_uri, sft_checkpoint=checkpoint)
    except BaseException:
        await asyncio.to_thread(mark_failed, run_uri)
        raise
