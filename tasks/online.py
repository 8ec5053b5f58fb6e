"""Online retraining tasks: thin wrappers of areal_core.online (retrain, then register if better)."""

from __future__ import annotations

import datetime
from typing import NamedTuple

from flytekit import task

from areal_core import online
from areal_core.logs import setup_logging
from tasks.resources import IMAGE, ROLE, SMALL


class OnlineResult(NamedTuple):
    rows: int
    registered: bool
    model_uri: str
    current_score: float
    candidate_score: float


@task(container_image=IMAGE, requests=ROLE, retries=1)
def retrain_on_sessions(
    config: str, overrides: str, sessions: str, model_name: str, kickoff_time: datetime.datetime | None
) -> str:
    """Train a candidate on the sessions past the cursor and score it against the current model;
    returns the online run root."""
    setup_logging()
    run_id = kickoff_time.strftime("%Y%m%dT%H%M%S") if kickoff_time else ""
    return online.retrain_candidate(config, overrides, sessions, model_name, run_id)


@task(container_image=IMAGE, requests=SMALL, retries=2)
def register_if_better(run_uri: str, min_gain: float) -> OnlineResult:
    """Register the candidate only when it beats the current version, then move the cursor."""
    setup_logging()
    out = online.publish_candidate(run_uri, min_gain)
    return OnlineResult(
        rows=out["rows"],
        registered=out["registered"],
        model_uri=out["model_uri"],
        current_score=float(out["current_score"] if out["current_score"] is not None else -1.0),
        candidate_score=float(out["candidate_score"] if out["candidate_score"] is not None else -1.0),
    )
