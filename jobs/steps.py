"""The steps of the jobs (jobs/catalog.py), each one call into areal_core, with the text both front
ends' tasks show (jobs/spec.py: doc_of) and the retries of the single-machine ones. A flytekit task
(tasks/) and a Flyte 2 task (flyte2/) of a step call the same function here.

The roles themselves (rollout, reward, trainer) are `areal_core.run.roles`' task entry points; a job's
`train` step runs them all at once, as each front end can (flytekit on one machine: one task running
the launcher; flytekit on a cluster: map tasks and an Elastic task; Flyte 2: concurrent tasks).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator
from typing import Any

from areal_core.config import ConfigError, RunConfig

# How often a front end retries a single-machine step (the cluster's steps take their pod's retries).
RETRIES = {"train": 2, "retrain": 1, "publish": 2, "continuous": 2, "regrade": 2}


@contextlib.contextmanager
def one_frame() -> Iterator[None]:
    """A ConfigError raised again from here: its message is the finding, its traceback one frame."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(str(exc)) from None


def prepare(cfg: RunConfig, config: str, overrides: str, resume: bool) -> tuple[str, str]:
    """Validate the config (YAML files < the typed config's changes < overrides), then write
    config.yaml and the prompt set to the run root; returns (run URI, SFT key)."""
    from areal_core.run import pipeline

    with one_frame():
        return pipeline.prepare(config, overrides, resume, typed=cfg)


def prepare_cluster(
    cfg: RunConfig, config: str, overrides: str, resume: bool, kickoff_time: datetime.datetime
) -> tuple[str, str]:
    """Validate the config with the cluster's worker counts, device and backend, then write the run
    root; a scheduled run gets its own root <store>/<kickoff time>. Returns (run URI, SFT key)."""
    from areal_core.run import cluster

    with one_frame():
        return cluster.prepare_task(cfg, config, overrides, resume, kickoff_time)


def sft(run_uri: str) -> str:
    """SFT warm start, cached on `sft_key` alone; returns the checkpoint's URI."""
    from areal_core.run import pipeline

    return pipeline.sft(run_uri)


def start_run(run_uri: str, sft_checkpoint: str, image: Callable[[], str]) -> str:
    """Put the SFT checkpoint in the run root (a cache hit is copied, a vanished one recomputed)
    and open the run's MLflow run, tagged with the device and image."""
    from areal_core.run import cluster, pipeline

    return pipeline.start_run(run_uri, sft_checkpoint, cluster.pod_identity(image))


def evaluate(run_uri: str) -> dict[str, Any]:
    """Held-out greedy accuracy before and after RL, logged to MLflow, with the run's final report
    (the doctor's verdict, curves, held-out answers) as the task's report."""
    from areal_core.run import pipeline

    return pipeline.evaluate_run(run_uri)


def register(run_uri: str, model_name: str, before: float, after: float, image: Callable[[], str]) -> str:
    """Register the final model and the newest checkpoint in the MLflow registry; returns the final
    model's models:/ URI ('' when the run has tracking disabled)."""
    from areal_core.online.registry import register_final_model
    from areal_core.run import cluster

    return register_final_model(run_uri, model_name, before, after, *cluster.pod_identity(image).values())


def retrain(config: str, overrides: str, sessions: str, model_name: str, kickoff_time: datetime.datetime) -> str:
    """Train a candidate on the sessions past the cursor and score it against the current model;
    returns the online run root."""
    from areal_core.online import retrain as retrain_lib
    from areal_core.run.cluster import scheduled

    return retrain_lib.retrain_task(config, overrides, sessions, model_name, scheduled(kickoff_time))


def publish(run_uri: str, min_gain: float) -> dict[str, Any]:
    """Register the candidate only when it beats the champion (then promoted), then move the cursor."""
    from areal_core.online import retrain as retrain_lib

    return retrain_lib.publish_task(run_uri, min_gain)


def continuous(run_uri: str, sft_checkpoint: str) -> str:
    """The reward pool and the trainer over the sessions the serving proxy writes into the run root,
    until train.steps; returns the final model's URI. Retried: the trainer resumes from its checkpoint."""
    from areal_core.online import continuous as continuous_lib

    return continuous_lib.continuous_task(run_uri, sft_checkpoint)


def replay(run: str, into: str, overrides: str, layer: str) -> dict[str, Any]:
    """Train on `run`'s samples (rewards from `layer`) in their recorded order into the new root `into`;
    {run_uri, steps, the largest relative loss / grad-norm difference from the run's steps (-1: not recorded)}."""
    from areal_core.run import replay as replay_lib

    return replay_lib.replay_task(run, into, overrides, layer)


def fork(run: str, step: int, into: str, overrides: str) -> dict[str, str]:
    """Make the child root `into` from `run`'s checkpoint at `step` under `overrides`; {run_uri,
    sft_checkpoint: its initial model}."""
    from areal_core.run import fork as fork_lib

    return fork_lib.fork_task(run, step, into, overrides)


def regrade(run: str, layer: str, reward: str, pool_size: int) -> dict[str, Any]:
    """Re-grade `run`'s graded samples with `reward` ('' = the run's own) into the layer `layer`
    (a retry continues the same request; a committed layer is never written again)."""
    from areal_core.reward.regrade import regrade as regrade_lib

    summary = regrade_lib(run, reward or None, layer, pool_size=pool_size).summary()
    return {"layer": layer, **{k: summary[k] for k in ("samples", "changed", "samples_per_s")}}
