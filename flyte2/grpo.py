"""Asynchronous GRPO with the Flyte 2 SDK: the jobs `grpo` and `grpo_cluster` of the job spec
(jobs/catalog.py: their inputs, defaults, docs and schedule; flyte2/translate.py), each a Flyte 2
task that awaits the steps (flyte2/steps.py) and the three roles at once (flyte2/roles.py: run_roles).

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
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import flyte

from areal_core.config import ConfigError, RunConfig, load_config
from areal_core.context import load_run_config
from areal_core.layout import LAYOUT
from areal_core.run import cluster, pipeline
from areal_core.run.live import LiveReport
from areal_core.run.tracking import Tracker
from areal_core.store import Store
from flyte2.envs import CLUSTER, DRIVER
from flyte2.roles import run_roles
from flyte2.steps import evaluate, mark_failed, prepare, prepare_cluster, register, sft, start_run
from flyte2.translate import job_task
from jobs.catalog import ACCURACY, GRPO, GRPO_CLUSTER
from jobs.spec import Given

Accuracy = ACCURACY.dataclass()


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


@contextlib.asynccontextmanager
async def failed_on_error(run_uri: str) -> AsyncIterator[None]:
    """The run's MLflow run marked FAILED (flyte2/steps.py: mark_failed) when the body raises anything,
    cancellation too; the error propagates."""
    try:
        yield
    except BaseException:
        await asyncio.to_thread(mark_failed, run_uri)
        raise


async def roles_and_evaluate(
    run_uri: str, checkpoint: str, workers: tuple[int, int] | None, local: bool
) -> tuple[float, float]:
    """start_run -> the roles at once (`train`) -> evaluate: the held-out accuracy (before, after).
    `workers`: the rollout and reward workers; None: the run config's (read once the run has started)."""
    await start_run.aio(run_uri=run_uri, sft_checkpoint=checkpoint)
    if workers is None:
        cfg = load_run_config(Store(run_uri))
        workers = (cfg.rollout.num_workers, cfg.reward.num_workers)
    await train(run_uri, *workers, local=local)
    return await evaluate.aio(run_uri=run_uri)


async def _grpo(given: Given) -> Any:
    run_cfg = check_config(given.cfg, given.config, given.overrides)
    run_uri, sft_key = await prepare.aio(**given.take("cfg", "config", "overrides", resume="resume_run"))
    async with failed_on_error(run_uri):
        checkpoint = await sft.aio(run_uri=run_uri, sft_key=sft_key)
        workers = (run_cfg.rollout.num_workers, run_cfg.reward.num_workers)
        return Accuracy(*await roles_and_evaluate(run_uri, checkpoint, workers, local=True))


async def _grpo_cluster(given: Given) -> Any:
    check_config(given.cfg, given.config, given.overrides, for_cluster=True)
    inputs = given.take("cfg", "config", "overrides", "resume_run", "kickoff_time")
    run_uri, sft_key = await prepare_cluster.aio(**inputs)
    async with failed_on_error(run_uri):
        checkpoint = await sft.aio(run_uri=run_uri, sft_key=sft_key)
        workers = (CLUSTER.rollout.replicas, CLUSTER.reward.replicas)
        local = flyte.ctx().mode == "local"
        before, after = await roles_and_evaluate(run_uri, checkpoint, workers, local=local)
        return await register.aio(run_uri=run_uri, model_name=given.model_name, before=before, after=after)


grpo = job_task(DRIVER, GRPO, _grpo, report=True)
# `grpo_cluster_weekly`, its trigger: each triggered run gets its own run root <store>/<kickoff time>
grpo_cluster = job_task(DRIVER, GRPO_CLUSTER, _grpo_cluster, report=True)
