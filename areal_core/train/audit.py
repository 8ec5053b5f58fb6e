"""The audit record of one trained step, trainer/trained/step-{N}.json: the samples trained, in
order, the metrics and the drops. Replay reads it back (run/replay.py)."""

from __future__ import annotations

from areal_core.protocol import Sample


def audit_record(
    step: int,
    version: int,
    eta: int,
    samples: list[Sample],
    metrics: dict,
    dropped: list[Sample],
    abandoned: list[Sample],
    abandoned_versions: list[list[int]],
    staleness_histogram: dict,
    threads: list[int] | None = None,
) -> dict:
    """The record of `step`, trained at trainer `version`; `*_workers` complete each identity
    (`Sample.identity()` is worker/sample id). The abandoned keys appear only in a run that has
    abandoned versions; `threads` (train.borrow_idle_cores: the step's torch thread count at each decoder layer
    pass, in order) only where the trainer chose them."""
    record = {
        "step": step,
        "trainer_version": version,
        "eta": eta,
        "samples": [[s.sample_id, s.min_version()] for s in samples],
        "sample_workers": [s.worker_id for s in samples],
        "metrics": {k: float(v) for k, v in metrics.items()},
        "dropped": [[s.sample_id, s.min_version()] for s in dropped],
        "dropped_workers": [s.worker_id for s in dropped],
        "staleness_histogram": staleness_histogram,
    }
    if threads is not None:
        record["threads"] = list(threads)
    if abandoned_versions or abandoned:
        record["abandoned"] = [[s.sample_id, s.min_version()] for s in abandoned]
        record["abandoned_workers"] = [s.worker_id for s in abandoned]
        record["abandoned_versions"] = abandoned_versions
    return record
