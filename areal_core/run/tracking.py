"""MLflow tracking: one MLflow run per training run, shared by every role through the store.

The launcher creates the run and records its id in `tracking.json` on the store; the
trainer and the evaluator attach to it. Tracking URI: config, else $MLFLOW_TRACKING_URI,
else a sqlite file in the working directory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from areal_core.store import LAYOUT, Store

log = logging.getLogger("areal.tracking")


def tracking_uri(configured: str) -> str:
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlruns.db'}"


def mlflow_client(uri: str) -> Any:
    """An MlflowClient on `uri`, also made the process's tracking URI (artifact downloads use it)."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    return mlflow.MlflowClient(uri)


def new_run(client: Any, experiment: str, run_name: str, tags: dict[str, str] | None = None) -> str:
    """Create an MLflow run in `experiment` (created when missing); returns its run id."""
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    return client.create_run(exp_id, run_name=run_name, tags=tags).info.run_id


class Tracker:
    """A thin handle on one MLflow run; every method is a no-op when tracking is disabled."""

    def __init__(self, run_id: str | None, uri: str):
        self.run_id, self.uri = run_id, uri
        self._client = None
        if run_id:
            self._client = mlflow_client(uri)

    @classmethod
    def create(cls, store: Store, cfg: Any) -> Tracker:
        """Create the MLflow run for this training run (or reuse the one already recorded)."""
        if not cfg.tracking.enabled:
            return cls(None, "")
        if store.exists(LAYOUT.tracking):
            return cls.attach(store)
        uri = tracking_uri(cfg.tracking.uri)
        run_id = new_run(mlflow_client(uri), cfg.tracking.experiment, cfg.name, {"store": store.uri})
        store.write_json(LAYOUT.tracking, {"run_id": run_id, "uri": uri})
        tracker = cls(run_id, uri)
        from areal_core.config import to_flat_dict

        tracker.log_params(to_flat_dict(cfg))
        return tracker

    @classmethod
    def attach(cls, store: Store) -> Tracker:
        if not store.exists(LAYOUT.tracking):
            return cls(None, "")
        info = store.read_json(LAYOUT.tracking)
        return cls(info["run_id"], info["uri"])

    @property
    def enabled(self) -> bool:
        return self._client is not None

    def log_params(self, params: dict[str, Any]) -> None:
        if not self._client:
            return
        from mlflow.entities import Param

        items = [Param(k, str(v)[:500]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self._client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self._client:
            return
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        try:
            self._client.log_batch(self.run_id, metrics=batch, synchronous=False)
        except TypeError:  # older clients have no asynchronous logging
            self._client.log_batch(self.run_id, metrics=batch)

    def log_artifacts(self, local_dir: str | Path, artifact_path: str) -> None:
        if self._client:
            self._client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def set_tag(self, key: str, value: str) -> None:
        if self._client:
            self._client.set_tag(self.run_id, key, value)

    def finish(self, status: str = "FINISHED") -> None:
        if self._client:
            try:
                import mlflow

                mlflow.flush_async_logging()
            except Exception:  # nothing pending or an older client
                pass
            self._client.set_terminated(self.run_id, status)
