"""Promotion gates of continuous online RL: every `online.promote_every` steps the trainer's version
is scored on the held-out split, and the registry's `champion` alias moves to it only when it wins.

    PromotionGate   the decision and its record: the champion's score to beat (the starting
                    policy's at first), `register_if_better` (online/registry.py) keyed by the run
                    root and version, so a retried offer registers nothing twice; every offer is
                    appended to trainer/promotions.json (`LAYOUT.promotions`), which a restarted
                    trainer reads back: the score to beat survives it
    PromotingSink   the run's `PublishingSink` plus the gate: the trainer is unchanged, only where
                    its versions go is

A serving proxy that follows `models:/NAME@champion` (production) therefore serves a new version only
once it has won its gate; one that follows `RUN/weights` (research) serves every version.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from typing import Any

from areal_core.layout import LAYOUT
from areal_core.run.tracking import ModelFiles
from areal_core.store import Store
from areal_core.train.sinks import PublishingSink, Trainer
from areal_core.weights.publisher import WeightPublisher

log = logging.getLogger("areal.online")


class PromotionGate:
    """Offers versions to the registry; the alias moves only for a score above the champion's + min_gain."""

    def __init__(self, store: Store, model_name: str, tracking_uri: str, min_gain: float = 0.0):
        self.store, self.model_name, self.tracking_uri, self.min_gain = store, model_name, tracking_uri, min_gain
        record = self._read()
        self.champion_score: float | None = record.get("champion_score")
        self.offers: list[dict[str, Any]] = record.get("offers", [])

    def _read(self) -> dict[str, Any]:
        try:
            record = self.store.read_json(LAYOUT.promotions)
        except FileNotFoundError:
            return {}
        except ValueError as exc:  # not JSON
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
            mv = aliased(mlflow_client(self.tracking_uri), self.model_name)
            value = float(mv.tags["heldout_score"]) if mv is not None and "heldout_score" in mv.tags else None
        except Exception as exc:  # noqa: BLE001 - an unreachable registry: the start's score stands
            log.warning(
                "registry %s unreadable (%s): the score to beat is the starting policy's", self.tracking_uri, exc
            )
            return None
        return value if value is not None and math.isfinite(value) else None

    def offer(self, version: int, step: int, score: float, files: ModelFiles) -> bool:
        """Register `files` (an HF folder or a function writing one) as a version of the model and move
        `champion` to it when `score` beats the champion's; returns whether it did. A registry that
        fails, or a score that is not a finite number, is recorded with the offer and promotes nothing:
        the trainer goes on, and the next gate offers again."""
        from areal_core.online.registry import register_if_better

        offer: dict[str, Any] = {"version": version, "step": step, "score": score, "time": time.time()}
        offer.update(champion_score=self.champion_score, promoted=False, model_uri="")
        try:
            if not math.isfinite(score):
                raise ValueError(f"held-out score {score} is not a finite number")
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
            )
            offer.update(promoted=bool(out["registered"]), model_uri=out["model_uri"])
        except Exception as exc:  # noqa: BLE001 - recorded: the gate must not stop the trainer
            offer["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            offer["score"] = score if math.isfinite(score) else None
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
        super().__init__(publisher)
        self.gate, self.every = gate, every

    def start(self, trainer: Trainer) -> None:
        super().start(trainer)
        if self.gate.champion_score is None:  # the same file on every rank: the same decision
            score = trainer.evaluate()  # collective
            if trainer.dist.is_main:
                self.gate.baseline(score)

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
            promoted = self.gate.offer(st.version, st.step, score, tmp)
        trainer.ev.emit("promotion", version=st.version, score=score, promoted=promoted)
        log.info("version %d scored %.4f: %s", st.version, score, "promoted" if promoted else "not promoted")
        return seconds
