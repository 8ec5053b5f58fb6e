"""prepare -> SFT (cached) -> run_async_rl (a live report Deck) -> evaluate (the final report Deck).

The models are FlyteDirectory values (the console's lineage: which run root's initial model a
final model came from). The SFT cache is keyed on what determines the model (`sft_key`: seed,
task, model and SFT settings), not on the run root, so another run (a scheduled one, a new
store) hits it; its value is the checkpoint's URI as a string, because a cached checkpoint can
vanish (`make clean`, a deleted run root) and a dangling FlyteDirectory would fail in flytekit's
input conversion before our code runs: the next task copies a hit into its run root, or runs SFT
again when the folder is gone (areal_core/run/pipeline.py: ensure_init_model).
"""

from __future__ import annotations

from typing import NamedTuple

import flytekit
from flytekit import Cache, Deck, task
from flytekit.types.directory import FlyteDirectory

from areal_core.config import ConfigError, RunConfig
from areal_core.layout import LAYOUT
from areal_core.run import pipeline
from areal_core.store import Store
from tasks.deferred import ONE_MACHINE
from tasks.execution import bind_execution
from tasks.resources import ROLE, SECRETS, SMALL

# bump the version when the SFT code changes what it produces for the same key
SFT_CACHE = Cache(version="2", ignored_inputs=("run_uri",))


class Prepared(NamedTuple):
    run_uri: str
    sft_key: str


class Models(NamedTuple):
    init_model: FlyteDirectory
    final_model: FlyteDirectory


class Accuracy(NamedTuple):
    before: float
    after: float


def model_dir(run_uri: str, name: str) -> FlyteDirectory:
    """The run root's `name` folder (init_model, final_model) as a FlyteDirectory that stays
    where it is (never uploaded elsewhere; a local store as a plain path, which flytekit reads)."""
    store = Store(run_uri)
    return FlyteDirectory(str(store.local_path(name)) if store.local else store.url(name), remote_directory=False)


@task(task_config=ONE_MACHINE, requests=SMALL, secret_requests=SECRETS)
def prepare(cfg: RunConfig, config: str, overrides: str, resume: bool) -> Prepared:
    """Validate the config (YAML files < the typed config's changes < overrides), then write
    config.yaml and the prompt set to the run root."""
    try:
        run_uri, key = pipeline.prepare(config, overrides, resume, typed=cfg)
    except ConfigError as exc:  # the message is the finding: raised here, its traceback is one frame, not the stack
        raise ConfigError(str(exc)) from None
    return Prepared(run_uri=run_uri, sft_key=key)


@task(task_config=ONE_MACHINE, requests=ROLE, cache=SFT_CACHE, secret_requests=SECRETS)
def sft(run_uri: str, sft_key: str) -> str:
    """SFT warm start, cached on `sft_key` alone; returns the checkpoint's URI."""
    return pipeline.sft(run_uri)


REPORT_DECK = "report"


def publish_report(html: str) -> None:
    """Show `html` as this task's "report" Deck (replacing the previous one) and publish the
    Decks now, so the console shows them while the task runs."""
    decks = flytekit.current_context().decks
    decks[:] = [d for d in decks if d.name != REPORT_DECK]
    Deck(REPORT_DECK, html)
    Deck.publish()


@task(task_config=ONE_MACHINE, requests=ROLE, retries=2, secret_requests=SECRETS, enable_deck=True)
def run_async_rl(run_uri: str, sft_checkpoint: str) -> Models:
    """All roles as local processes on one machine, with the run's report as a Deck refreshed
    while they run; returns the initial and final models."""
    bind_execution()
    pipeline.run_async_rl(run_uri, sft_checkpoint, publish=publish_report)
    return Models(init_model=model_dir(run_uri, LAYOUT.init_model), final_model=model_dir(run_uri, LAYOUT.final_model))


@task(task_config=ONE_MACHINE, requests=ROLE, enable_deck=True, secret_requests=SECRETS)
def evaluate(run_uri: str, init_model: FlyteDirectory, final_model: FlyteDirectory) -> Accuracy:
    """Held-out greedy accuracy before and after RL, logged to MLflow, with the run's final report
    (and the held-out scores) as a Deck."""
    result = pipeline.evaluate_run(run_uri)
    Deck(REPORT_DECK, result["report"])
    return Accuracy(before=result["before"], after=result["after"])
