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

from areal_core.config import RunConfig
from areal_core.layout import LAYOUT
from areal_core.run import pipeline
from areal_core.store import Store
from jobs import steps
from jobs.catalog import ACCURACY, SFT_CACHE
from jobs.spec import doc_of
from tasks.deferred import ONE_MACHINE
from tasks.execution import bind_execution
from tasks.resources import PREPARE, ROLE, SECRETS

CACHE = Cache(version=SFT_CACHE.version, ignored_inputs=SFT_CACHE.ignored)  # the job spec's


class Prepared(NamedTuple):
    run_uri: str
    sft_key: str


class Models(NamedTuple):
    init_model: FlyteDirectory
    final_model: FlyteDirectory


Accuracy = ACCURACY.named_tuple()


def model_dir(run_uri: str, name: str) -> FlyteDirectory:
    """The run root's `name` folder (init_model, final_model) as a FlyteDirectory that stays
    where it is (never uploaded elsewhere; a local store as a plain path, which flytekit reads)."""
    store = Store(run_uri)
    return FlyteDirectory(str(store.local_path(name)) if store.local else store.url(name), remote_directory=False)


@task(task_config=ONE_MACHINE, requests=PREPARE, secret_requests=SECRETS)
@doc_of(steps.prepare)
def prepare(cfg: RunConfig, config: str, overrides: str, resume: bool) -> Prepared:
    return Prepared(*steps.prepare(cfg, config, overrides, resume))


@task(task_config=ONE_MACHINE, requests=ROLE, cache=CACHE, secret_requests=SECRETS)
@doc_of(steps.sft)
def sft(run_uri: str, sft_key: str) -> str:
    return steps.sft(run_uri)


REPORT_DECK = "report"


def publish_report(html: str) -> None:
    """Show `html` as this task's "report" Deck (replacing the previous one) and publish the
    Decks now, so the console shows them while the task runs."""
    decks = flytekit.current_context().decks
    decks[:] = [d for d in decks if d.name != REPORT_DECK]
    Deck(REPORT_DECK, html)
    Deck.publish()


@task(task_config=ONE_MACHINE, requests=ROLE, retries=steps.RETRIES["train"], secret_requests=SECRETS, enable_deck=True)
def run_async_rl(run_uri: str, sft_checkpoint: str) -> Models:
    """All roles as local processes on one machine, with the run's report as a Deck refreshed
    while they run; returns the initial and final models."""
    bind_execution()
    pipeline.run_async_rl(run_uri, sft_checkpoint, publish=publish_report)
    return Models(init_model=model_dir(run_uri, LAYOUT.init_model), final_model=model_dir(run_uri, LAYOUT.final_model))


@task(task_config=ONE_MACHINE, requests=ROLE, enable_deck=True, secret_requests=SECRETS)
@doc_of(steps.evaluate)
def evaluate(run_uri: str, init_model: FlyteDirectory, final_model: FlyteDirectory) -> Accuracy:
    result = steps.evaluate(run_uri)
    Deck(REPORT_DECK, result["report"])
    return Accuracy(before=result["before"], after=result["after"])
