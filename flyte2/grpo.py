"""Asynchronous GRPO with the Flyte 2 SDK: the jobs of workflows/grpo.py, each a Flyte 2 task that
awaits the steps (flyte2/steps.py) and the three roles at once (flyte2/roles.py: run_roles).

    grpo           prepare -> SFT (cached) -> start_run -> [rollout pool | reward pool | trainer] -> evaluate
    grpo_cluster   prepare_cluster -> SFT -> start_run -> [pools | Elastic trainer] -> evaluate -> register

Locally (`flyte run --local`, or `python -m flyte2 grpo`, which checks the config first) every task
runs in this process and the roles run at once, each in its own process; on a cluster
(`flyte run flyte2/grpo.py grpo_cluster`, `flyte deploy flyte2/grpo.py`) each task is a pod of its
environment (flyte2/envs.py). Same config layers as the flytekit jobs: the YAML files of `config`,
the typed `cfg`, then the dotted `overrides` (docs/flyte2.md):

    flyte run --local flyte2/grpo.py grpo --overrides "train.steps=100 train.eta=0"
    flyte run --local flyte2/grpo.py grpo --cfg '{"train": {"eta": 0}}' --resume_run

`grpo_cluster` carries the trigger `grpo_cluster_weekly` (the cluster config's `schedule`): each
triggered run gets its own run root <store>/<kickoff time> and registers a new model version.
"""

from __future__ import annotations

import asyncio
import datetime
import time

import flyte
from flyte import notify
from flyte.models import ActionPhase

from areal_core.config import ConfigError, RunConfig, load_config
from areal_core.context import load_run_config
from areal_core.layout import LAYOUT
from areal_core.run import cluster, pipeline
from areal_core.run.cluster import UNSCHEDULED
from areal_core.run.live import LiveReport
from areal_core.run.tracking import Tracker
from areal_core.store import Store
from flyte2.envs import CLUSTER, DRIVER
from flyte2.roles import run_roles
from flyte2.steps import evaluate, mark_failed, prepare, prepare_cluster, register, sft, start_run

DEFAULT_CONFIG = "configs/default.yaml"


def check_config(cfg: RunConfig, config: str, overrides: str, for_cluster: bool = False) -> RunConfig:
    """The run config these inputs give, or the one-line ConfigError naming the key: before any
    step of the job runs (and before the run root is touched)."""
    try:
        if for_cluster:
            run_cfg, _ = cluster.cluster_config(config, overrides, CLUSTER, typed=cfg)
            cluster.check_backend(run_cfg, CLUSTER)
            return run_cfg
        return load_config(config or None, pipeline.parse_overrides(overrides), cfg)
    except ConfigError as exc:  # the message is the finding: one frame, not the stack
        raise ConfigError(str(exc)) from None


def publish(html: str) -> None:
    """The run's report as the job's Flyte 2 report (LiveReport calls this from its thread)."""
    flyte.report.replace(html, do_flush=True)


async def train(run_uri: str, num_rollout: int, num_reward: int, local: bool) -> str:
    """The roles at once, with the run's report refreshed as this task's report while they run;
    then (as the single-machine launcher does) the wall time and the doctor's verdict. `local`: the
    launcher's timeout and progress line of the run config apply (a cluster's pods have their own)."""
    store = Store(run_uri)
    cfg = load_run_config(store)
    live = LiveReport(store.uri, publish, cfg.launcher.report_every_s)
    live.__enter__()
    t0 = time.time()
    try:
        timeout = cfg.launcher.timeout_s if local else 0
        final = await run_roles(run_uri, num_rollout, num_reward, timeout, local and cfg.launcher.progress)
    finally:
        await asyncio.to_thread(live.__exit__, None, None, None)  # its last publish needs this loop
    wall_s = time.time() - t0
    tracker = Tracker.attach(store)
    tracker.log_metrics({"wall_s": wall_s}, int(store.read_json(LAYOUT.done).get("step", 0)))
    print(f"async RL finished in {wall_s:.1f}s")
    html = await asyncio.to_thread(pipeline.log_report, store, tracker)
    if html:
        await flyte.report.replace.aio(html, do_flush=True)
    return final


@DRIVER.task(report=True)
async def grpo(
    cfg: RunConfig = RunConfig(),
    config: str = DEFAULT_CONFIG,
    overrides: str = "",
    resume_run: bool = False,
) -> tuple[float, float]:
    """Asynchronous GRPO: prepare, SFT (cached), the rollout pool, reward pool and trainer at once
    as Flyte tasks, evaluate; returns held-out accuracy (before RL, after RL).

    :param cfg: the run config as JSON; its fields that differ from the defaults apply over the YAML files (README)
    :param config: YAML config files, comma-separated, applied in order over the defaults
    :param overrides: dotted key=value overrides, whitespace-separated with shell quoting, applied last
    :param resume_run: a flag: continue the run in the run root (same run id and config) instead of starting afresh
    """
    run_cfg = check_config(cfg, config, overrides)
    run_uri, sft_key = await prepare.aio(cfg=cfg, config=config, overrides=overrides, resume=resume_run)
    try:
        checkpoint = await sft.aio(run_uri=run_uri, sft_key=sft_key)
        await start_run.aio(run_uri=run_uri, sft_checkpoint=checkpoint)
        await train(run_uri, run_cfg.rollout.num_workers, run_cfg.reward.num_workers, local=True)
        before, after = await evaluate.aio(run_uri=run_uri)
    except BaseException:
        await asyncio.to_thread(mark_failed, run_uri)
        raise
    return before, after


def weekly() -> flyte.Trigger:
    """Recurring retraining: the cluster config's `schedule` (cron, inputs, who is e-mailed when a
    run fails, times out or is aborted). The trigger binds its fire time to `kickoff_time`, which
    gives each run its own run root."""
    sched = CLUSTER.schedule
    failed = (ActionPhase.FAILED, ActionPhase.TIMED_OUT, ActionPhase.ABORTED)
    return flyte.Trigger(
        name="grpo_cluster_weekly",
        automation=flyte.Cron(sched.cron),
        description="weekly retraining, each run in its own run root <store>/<kickoff time>",
        inputs={
            "kickoff_time": flyte.TriggerTime,
            "config": sched.config,
            "overrides": sched.overrides,
            "resume_run": False,
            "model_name": sched.model_name,
        },
        notifications=notify.Email(on_phase=failed, recipients=tuple(sched.notify)),
    )


@DRIVER.task(report=True, triggers=weekly())
async def grpo_cluster(
    cfg: RunConfig = RunConfig(),
    config: str = DEFAULT_CONFIG,
    overrides: str = "",
    resume_run: bool = False,
    model_name: str = "areal-flyte-policy",
    kickoff_time: datetime.datetime = UNSCHEDULED,
) -> str:
    """Asynchronous GRPO on a cluster, each role its own pods; returns the registered final model's
    models:/ URI ('': no tracking).

    :param cfg: the run config as JSON; its fields that differ from the defaults apply over the YAML files (README)
    :param config: YAML config files, comma-separated, applied in order over the defaults
    :param overrides: dotted key=value overrides, whitespace-separated with shell quoting, applied last
    :param resume_run: a flag: continue the run in the run root (same run id and config) instead of starting afresh
    :param model_name: the MLflow registered model the final model is registered under
    :param kickoff_time: set by the trigger: the run's own root is <store>/<kickoff time>; 1970-01-01: a manual run
    """
    check_config(cfg, config, overrides, for_cluster=True)
    run_uri, sft_key = await prepare_cluster.aio(
        cfg=cfg, config=config, overrides=overrides, resume=resume_run, kickoff_time=kickoff_time
    )
    try:
        checkpoint = await sft.aio(run_uri=run_uri, sft_key=sft_key)
        await start_run.aio(run_uri=run_uri, sft_checkpoint=checkpoint)
        await train(run_uri, CLUSTER.rollout.replicas, CLUSTER.reward.replicas, local=flyte.ctx().mode == "local")
        before, after = await evaluate.aio(run_uri=run_uri)
        return await register.aio(run_uri=run_uri, model_name=model_name, before=before, after=after)
    except BaseException:
        await asyncio.to_thread(mark_failed, run_uri)
        raise
