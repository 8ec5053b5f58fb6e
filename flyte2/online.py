"""Online retraining with the Flyte 2 SDK: the jobs `online_retrain` and `online_continuous` of the
job spec (jobs/catalog.py; flyte2/translate.py), each step one call of jobs/steps.py (as tasks/online.py).

    flyte run --local flyte2/online.py online_retrain --sessions s3://bucket/sessions \\
        --overrides "store=s3://bucket/online model.path=s3://bucket/base"
    flyte run --local flyte2/online.py online_continuous --overrides "store=RUN sft.enabled=false"

`online_retrain` carries the trigger `online_retrain_nightly` (every night at 03:00 UTC, as the
flytekit launch plan): its fire time names the run. `online_continuous` is continuous online RL on
a run root that a serving proxy (`--follow RUN/weights --store RUN`) feeds with sessions.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

from areal_core.config import RunConfig
from flyte2.envs import DRIVER, ONE_MACHINE
from flyte2.grpo import check_config
from flyte2.steps import bind_execution, mark_failed, prepare, sft
from flyte2.translate import job_task
from jobs import steps
from jobs.catalog import ONLINE_CONTINUOUS, ONLINE_RESULT, ONLINE_RETRAIN
from jobs.spec import Given, doc_of

OnlineResult = ONLINE_RESULT.dataclass()


@ONE_MACHINE.task(retries=steps.RETRIES["retrain"])
@doc_of(steps.retrain)
def retrain_on_sessions(
    config: str, overrides: str, sessions: str, model_name: str, kickoff_time: datetime.datetime
) -> str:
    return steps.retrain(config, overrides, sessions, model_name, kickoff_time)


@ONE_MACHINE.task(retries=steps.RETRIES["publish"])
@doc_of(steps.publish)
def register_if_better(run_uri: str, min_gain: float) -> OnlineResult:
    bind_execution()
    return OnlineResult(**steps.publish(run_uri, min_gain))


@ONE_MACHINE.task(retries=steps.RETRIES["continuous"])
@doc_of(steps.continuous)
def continuous_rl(run_uri: str, sft_checkpoint: str) -> str:
    bind_execution()
    return steps.continuous(run_uri, sft_checkpoint)


async def _online_retrain(given: Given) -> Any:
    check_config(RunConfig(), given.config, given.overrides)
    inputs = given.take("config", "overrides", "sessions", "model_name", "kickoff_time")
    run_uri = await retrain_on_sessions.aio(**inputs)
    return await register_if_better.aio(run_uri=run_uri, min_gain=given.min_gain)


async def _online_continuous(given: Given) -> Any:
    check_config(given.cfg, given.config, given.overrides)
    run_uri, sft_key = await prepare.aio(**given.take("cfg", "config", "overrides", resume="resume_run"))
    try:
        checkpoint = await sft.aio(run_uri=run_uri, sft_key=sft_key)
        return await continuous_rl.aio(run_uri=run_uri, sft_checkpoint=checkpoint)
    except BaseException:
        await asyncio.to_thread(mark_failed, run_uri)
        raise


online_retrain = job_task(DRIVER, ONLINE_RETRAIN, _online_retrain)  # with its trigger online_retrain_nightly
online_continuous = job_task(DRIVER, ONLINE_CONTINUOUS, _online_continuous)
