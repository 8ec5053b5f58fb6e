"""prepare -> SFT (cached) -> run_async_rl -> evaluate (with a Deck)."""

from __future__ import annotations

from typing import NamedTuple

from flytekit import Deck, task

from areal_core.run import pipeline
from tasks.execution import bind_execution
from tasks.resources import IMAGE, ROLE, SMALL


class Prepared(NamedTuple):
    run_uri: str
    sft_key: str


class Accuracy(NamedTuple):
    before: float
    after: float


@task(container_image=IMAGE, requests=SMALL)
def prepare(config: str, overrides: str, resume: bool) -> Prepared:
    """Validate the config, then write config.yaml and the prompt set to the run root."""
    run_uri, key = pipeline.prepare(config, overrides, resume)
    return Prepared(run_uri=run_uri, sft_key=key)


@task(container_image=IMAGE, requests=ROLE, cache=True, cache_version="1")
def sft(run_uri: str, sft_key: str) -> str:
    """SFT warm start; cached on (run root, SFT key) so a rerun skips it. Returns the checkpoint URI."""
    return pipeline.sft(run_uri)


@task(container_image=IMAGE, requests=ROLE, retries=2)
def run_async_rl(run_uri: str, init_model: str) -> str:
    """All roles as local processes on one machine; returns the final model URI."""
    bind_execution()
    return pipeline.run_async_rl(run_uri, init_model)


@task(container_image=IMAGE, requests=ROLE, enable_deck=True)
def evaluate(run_uri: str, final_model: str) -> Accuracy:
    """Held-out greedy accuracy before and after RL, logged to MLflow, with a Deck of the curves."""
    result = pipeline.evaluate_run(run_uri)
    Deck("curves", pipeline.curves_html(result["curves"], result["before"], result["after"]))
    return Accuracy(before=result["before"], after=result["after"])
