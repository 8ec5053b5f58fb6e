"""Promotion gates of continuous online RL: every `online.promote_every` steps the trainer's version
is scored on the held-out split, and the registry's `champion` alias moves to it only when it wins.

    PromotionGate   the decision and its record: the champion's score to beat (the starting
                    policy's at first), `register_if_better` (online/registry.py) keyed by the run
                    root and version, so a retried offer registers nothing twice; every offer is
                    appended to trainer/promotions.json (`LAYOUT.promotions`), which a restarted
                    trainer reads back: the score to beat survives it
    PromotingSink   the run's `PublishingSink` plus the gate: the trainer is unchanged, only where
                    its versions go is; a version is offered only once its own publication is in
                    the store (train.background_publish: drained after the score, before the offer)

A serving proxy that follows `models:/NAME@champion` (production) therefore serves a new version only
once it has won its gate; one that follows `RUN/weights` (research) serves every version.

The gate cannot demote: the bar is the registry's champion as it is at the move (its recorded
score, or one measured now by the trainer for a champion without one), never only the gate's own
baseline, and the alias moves by compare-and-set (online/registry.py: register_if_better). Registry
calls are bounded (`REGISTRY_TIMEOUT_S` a request, no retries) and a failing registry opens a
circuit breaker: for `BREAKER_S` the gate promotes nothing and records why, and a training step
never waits on the registry for more than one bounded call.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from areal_core.layout import LAYOUT
from areal_core.run.tracking import ModelFiles
from areal_core.store import Store
from areal_core.train.sinks import PublishingSink, Trainer
from areal_core.weights.publisher import WeightPublisher

log = logging.getLogger("areal.online")

REGISTRY_TIMEOUT_S = 10  # one registry request at most this long, not retried (MLflow's default: 120 s, 7 retries)
BREAKER_S = 300.0  # after a failed registry call, the gate skips the registry this long
MAX_RECORD_BYTES = 64 << 20  # promotions.json: ~200 bytes an offer


@contextlib.contextmanager
def registry_limits() -> Iterator[None]:
    """MLflow's HTTP requests bounded for the calls inside (its settings are read per request)."""
    keys = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(REGISTRY_TIMEOUT_S), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class PromotionGate:
    """Offers versions to the registry; the alias moves only for a score above the champion's + min_gain."""

    def __init__(self, store: Store, model_name: str, tracking_uri: str, min_gain: float = 0.0):
        self.store, self.model_name, self.tracking_uri, self.min_gain = store, model_name, tracking_uri, min_gain
        self.down_until = 0.0  # the circuit breaker: no registry call before this time
        self.skipped = 0  # offers not made while the breaker was open
        record = self._read()
        self.champion_score: float | None = record.get("champion_score")
        self.offers: list[dict[str, Any]] = record.get("offers", [])

    def _read(self) -> dict[str, Any]:
        try:
            record = json.loads(self.store.read_bytes(LAYOUT.promotions, MAX_RECORD_BYTES))
        except FileNotFoundError:
            return {}
        except (ValueError, RecursionError) as exc:  # not JSON, nested past reason, or over MAX_RECORD_BYTES
            raise ValueError(f"{self.store.url(LAYOUT.promotions)} is damaged: {exc}") from None
        score = record.get("champion_score") if isinstance(record, dict) else None
        offers = record.get("offers") if isinstance(record, dict) else None
        finite = score is None or (type(score) in (int, float) and math.isfinite(score))
        if not finite or not isinstance(offers, list):
            raise ValueError(f"{self.store.url(LAYOUT.promotions)} is damaged: {str(record)[:200]}")
        return {"champion_score": score, "offers": offers}

    def baseline(self, score: float) -> None:
        """The score to beat when none is recorded yet: the starting policy's, or the registry's
        champion's held-out score (its `heldout_score` tag) when that is higher, so a champion from
        another run is not replaced by a version that only beats this run's start."""
        if self.champion_score is not None:
            return
        self.champion_score = max(score, self.registered_champion_score() or -math.inf)
        self._write()

    def registered_champion_score(self) -> float | None:
        from areal_core.online.registry import aliased
        from areal_core.run.tracking import mlflow_client

        try:
            with registry_limits():
                mv = aliased(mlflow_client(self.tracking_uri), self.model_name)
            value = float(mv.tags["heldout_score"]) if mv is not None and "heldout_score" in mv.tags else None
        except Exception as exc:  # noqa: BLE001 - an unreachable registry: the start's score stands
            self.down_until = time.time() + BREAKER_S
            log.warning(
                "registry %s unreadable (%s): the score to beat is the starting policy's, and the registry's "
                "champion at each offer",
                self.tracking_uri,
                exc,
            )
            return None
        return value if value is not None and math.isfinite(value) else None

    def offer(
        self,
        version: int,
        step: int,
        score: float,
        files: ModelFiles,
        score_current: Callable[[str], float] | None = None,
    ) -> bool:
        """Register `files` (an HF folder or a function writing one) as a version of the model and move
        `champion` to it when `score` beats the champion's (the registry's, at the move; `score_current`
        scores one with no recorded score); returns whether it did. A registry that fails, a breaker
        still open, or a score that is not a finite number is recorded with the offer and promotes
        nothing: the trainer goes on, and the next gate offers again."""
        from areal_core.online.registry import register_if_better

        offer: dict[str, Any] = {"version": version, "step": step, "score": score, "time": time.time()}
        offer.update(champion_score=self.champion_score, promoted=False, model_uri="")
        if not math.isfinite(score):
            offer.update(error=f"ValueError: held-out score {score} is not a finite number", score=None)
        elif time.time() < self.down_until:
            self.skipped += 1
            offer["error"] = f"registry skipped: it failed within the last {BREAKER_S:g} s ({self.skipped} so far)"
        else:
            try:
                with registry_limits():
                    out = register_if_better(
                        files,
                        self.model_name,
                        self.tracking_uri,
                        score,
                        self.champion_score,
                        self.min_gain,
                        run_name=f"continuous-v{version}",
                        tags={"run_root": self.store.uri, "trainer_version": str(version), "trainer_step": str(step)},
                        key=f"{self.store.uri}#v{version}",
                        score_current=score_current,
                    )
                offer.update(promoted=bool(out["registered"]), model_uri=out["model_uri"])
                if out.get("refused"):
                    offer["refused"] = out["refused"]
            except Exception as exc:  # noqa: BLE001 - recorded: the gate must not stop the trainer
                self.down_until = time.time() + BREAKER_S
                offer["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if offer.get("error"):
            log.warning("version %d not offered: %s", version, offer["error"])
        if offer["promoted"]:
            self.champion_score = score
        self.offers.append(offer)
        self._write()
        return offer["promoted"]

    def _write(self) -> None:
        self.store.write_json(LAYOUT.promotions, {"champion_score": self.champion_score, "offers": self.offers})


class PromotingSink(PublishingSink):
    """Publishes every version as the run does; every `every` steps offers it to `gate`."""

    def __init__(self, publisher: WeightPublisher, gate: PromotionGate, every: int):
        super().__init__(publisher, readers=())  # continuous mode: the proxies writing sessions
        self.gate, self.every = gate, every

    def start(self, trainer: Trainer) -> None:
        super().start(trainer)
        if self.gate.champion_score is None:  # the same file on every rank: the same decision
            score = trainer.evaluate()  # collective
            if trainer.dist.is_main:
                self.gate.baseline(score)

    def _scorer(self, trainer: Trainer) -> Callable[[str], float]:
        """Scores a registered model (a champion with no recorded score) as the trainer scores its own."""

        def score(model_uri: str) -> float:
            from areal_core.online.registry import load_registered

            model, _ = load_registered(model_uri, tracking_uri=self.gate.tracking_uri)
            return trainer.score(model)

        return score

    def after_step(self, trainer: Trainer) -> float:
        seconds = super().after_step(trainer)
        if trainer.state.step % self.every:
            return seconds
        model = trainer.full_model()  # collective: gathered once for the score and the files
        if not trainer.dist.is_main:
            return seconds
        st = trainer.state
        with trainer.ev.span("eval"):
            score = trainer.score(model)
        with tempfile.TemporaryDirectory() as tmp:
            from areal_core.models import save_pretrained

            save_pretrained(model, trainer.tokenizer, tmp)
            with trainer.ev.span("publish"):  # v's own write done first (train.background_publish): its
                self.drain(trainer)  # failure raises here, and the registry never holds an unpublished v
            promoted = self.gate.offer(st.version, st.step, score, tmp, score_current=self._scorer(trainer))
        trainer.ev.emit("promotion", version=st.version, score=score, promoted=promoted)
        log.info("version %d scored %.4f: %s", st.version, score, "promoted" if promoted else "not promoted")
        return seconds
