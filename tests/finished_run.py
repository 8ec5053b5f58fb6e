"""One finished tiny run with hard-bound drops, shared by the dataset and re-grade tests (made
once per test process: the pipeline takes about a minute and a half on two cores)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from areal_core.run import pipeline
from areal_core.run.launcher import launch
from areal_core.store import Store
from tests.conftest import TINY

# η = 1 with admission off and slow steps: the rollout side floods the trainer, which drops
# (and counts) every sample older than v − η, and leaves some graded samples untrained
DROPS = ["train.eta=1", "rollout.admission=false", "train.slow_step_s=0.5", "train.steps=5"]


@functools.cache
def finished_run() -> tuple[str, dict]:
    """(run root URI, the launcher's result: the trainer's own counters)."""
    root = Path(tempfile.mkdtemp(prefix="areal-finished-run-")) / "run"
    run_uri, _ = pipeline.prepare("", [*TINY, *DROPS, f"store={root}"])
    pipeline.sft(run_uri)
    result = launch(run_uri, 1, 1, timeout_s=300, progress=False)
    assert Store(run_uri).done()
    return run_uri, result
