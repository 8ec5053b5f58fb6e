"""The trainer role of a run: the one trainer (train/trainer.py) on the run's graded shards,
publishing every version and checkpointing (a fork's frozen parent shards are read by the same
source), on one process or on every rank of a torchrun group."""

from __future__ import annotations

from collections.abc import Callable

from areal_core.config import RunConfig
from areal_core.events import EventLog
from areal_core.forks import image_roots, read_fork
from areal_core.layout import LAYOUT
from areal_core.store import Store
from areal_core.train.distributed import env_ranks, shutdown
from areal_core.train.parts import load_parts, shard_limits
from areal_core.train.sinks import PublishingSink, Sink
from areal_core.train.sources import GradedShards
from areal_core.train.trainer import Evaluate, MetricsTracker, Trainer
from areal_core.vlm.images import ImageCache
from areal_core.vlm.inputs import PlaceholderCheck
from areal_core.vlm_processor import VisionProcessor
from areal_core.weights.publisher import WeightPublisher, published_dtype


def build_run_trainer(
    run_uri: str,
    cfg: RunConfig,
    *,
    evaluate: Evaluate | None = None,
    tracker: MetricsTracker | None = None,
    guard: Callable[[], None] | None = None,
    events: EventLog | None = None,
    source_class: type[GradedShards] = GradedShards,
    make_sink: Callable[[WeightPublisher], Sink] = PublishingSink,
) -> Trainer:
    """The run's trainer on init_model, its newest committed checkpoint restored; nothing is
    written until `start()` (or `fit()`). `source_class`: the run's graded shards, or a subclass
    reading them another way (online/live_sessions.py: live sessions). `make_sink`: where the versions
    go, given the run's publisher (online/promotion.py: published and offered to a promotion gate)."""
    store = Store(run_uri)
    events = events or EventLog(None, "trainer", "0")
    parts = load_parts(store.url(LAYOUT.init_model), cfg, restore_from=store)
    for step, why in parts.skipped_checkpoints:
        events.emit("checkpoint_skipped", step=step, reason=why)
    limits = shard_limits(parts.model)
    fork = read_fork(store)
    source = source_class(store, cfg, parts.state, events, fork=fork, pending=parts.pending, limits=limits)
    if isinstance(parts.tokenizer, VisionProcessor) and isinstance(source, GradedShards):
        source.check = PlaceholderCheck(parts.tokenizer, ImageCache(image_roots(store), capacity=1024))
    tc = cfg.train
    publisher = WeightPublisher(store, parts.side_files, tc.weight_delta, tc.weight_full_every, published_dtype(cfg))
    sink = make_sink(publisher)
    return Trainer(parts, source, sink, store, cfg, evaluate=evaluate, tracker=tracker, guard=guard, events=events)


def run_trainer(
    run_uri: str,
    cfg: RunConfig,
    *,
    evaluate: Evaluate | None = None,
    tracker: MetricsTracker | None = None,
    guard: Callable[[], None] | None = None,
) -> dict[str, float]:
    """The trainer role on this process: one process, or every rank of a torchrun group (FSDP2)."""
    with EventLog(Store(run_uri), "trainer", str(env_ranks()[0])) as events:
        trainer = build_run_trainer(run_uri, cfg, evaluate=evaluate, tracker=tracker, guard=guard, events=events)
        try:
            return trainer.fit()
        finally:
            shutdown(trainer.dist)
