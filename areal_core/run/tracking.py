"""MLflow tracking: one MLflow run per training run, shared by every role through the store.

The launcher creates the run and records its id in `tracking.json` on the store; the
trainer and the evaluator attach to it. Tracking URI: config, else $MLFLOW_TRACKING_URI,
else a sqlite file in the working directory.

A run started inside a Flyte execution is named after it and tagged with its id, project,
domain and console link (`Execution`: the tasks layer puts them in the environment, since
areal_core never imports flytekit); elsewhere it gets a generated name. Every role that attaches
logs system metrics (CPU, memory, disk, network, GPU when pynvml is present) under
`system/<role>/...` while it runs (`Tracker.system_metrics`).

Every model goes to MLflow one way, `log_model`: an MLflow model of the `transformers` flavor
(task text-generation, a string-in string-out signature with `max_new_tokens` and `do_sample`
parameters, fp32 weights as safetensors). The run's `final_model/` (logged by evaluation) and
every registered version (`areal_core/online/registry.py`) are such models, so each serves as
it is: `mlflow.pyfunc.load_model("runs:/<id>/final_model").predict(["1 + 2 ="])`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from areal_core.layout import LAYOUT
from areal_core.store import Store

log = logging.getLogger("areal.tracking")


def tracking_uri(configured: str) -> str:
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlruns.db'}"


def mlflow_client(uri: str) -> Any:
    """An MlflowClient on `uri`, also made the process's tracking URI (artifact downloads use it).
    On a sqlite file, processes open it one at a time (an flock beside it): two runs started at
    once on a new file otherwise race in its schema migration, and one fails ("Online migration
    expected to match one row ... 0 found")."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    if not uri.startswith("sqlite:///"):
        return mlflow.MlflowClient(uri)
    db = Path(uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{db}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        client = mlflow.MlflowClient(uri)
        client.search_experiments(max_results=1)  # opens (and migrates) the store under the lock
    return client


EXECUTION_ENV = {
    "id": "AREAL_FLYTE_EXECUTION_ID",
    "project": "AREAL_FLYTE_EXECUTION_PROJECT",
    "domain": "AREAL_FLYTE_EXECUTION_DOMAIN",
    "console": "AREAL_FLYTE_CONSOLE",
}


@dataclasses.dataclass(frozen=True)
class Execution:
    """The Flyte execution this process runs in: its name (the execution id), project and domain,
    and the Flyte console's address; all empty outside Flyte. Passed down as environment
    variables ($AREAL_FLYTE_EXECUTION_ID, ..._PROJECT, ..._DOMAIN, $AREAL_FLYTE_CONSOLE), which
    also reach the role processes a task starts."""

    id: str = ""
    project: str = ""
    domain: str = ""
    console: str = ""

    @classmethod
    def from_env(cls) -> Execution:
        return cls(**{field: os.environ.get(var, "") for field, var in EXECUTION_ENV.items()})

    def env(self) -> dict[str, str]:
        """The environment variables that `from_env` reads back."""
        return {var: getattr(self, field) for field, var in EXECUTION_ENV.items()}

    @property
    def url(self) -> str:
        """The execution's page: <console>/console/projects/<project>/domains/<domain>/executions/<id>."""
        if not (self.id and self.project and self.domain and self.console):
            return ""
        base = self.console.rstrip("/").removesuffix("/console")
        return f"{base}/console/projects/{self.project}/domains/{self.domain}/executions/{self.id}"

    def run_name(self, fallback: str) -> str:
        """The execution id inside Flyte, else `<fallback>-<UTC time YYYYmmdd-HHMMSS>`."""
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        return self.id or f"{fallback}-{stamp}"

    def tags(self) -> dict[str, str]:
        """flyte.execution_id, flyte.project, flyte.domain and flyte.console_url ({} outside Flyte)."""
        if not self.id:
            return {}
        tags = {"flyte.execution_id": self.id, "flyte.project": self.project, "flyte.domain": self.domain}
        return {**tags, "flyte.console_url": self.url} if self.url else tags


def artifact_root(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a sqlite tracking file
    (`<its folder>/mlartifacts`; MLflow's own default is ./mlruns of whatever the working directory
    is), else the tracking server's choice (None)."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()


def new_run(client: Any, experiment: str, fallback_name: str, tags: dict[str, str] | None = None) -> str:
    """Create an MLflow run in `experiment` (created when missing), named and tagged after this
    process's Flyte execution (`Execution.run_name(fallback_name)`); returns its run id."""
    import mlflow

    execution = Execution.from_env()
    exp = client.get_experiment_by_name(experiment)
    where = artifact_root(mlflow.get_tracking_uri())
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment, where)
    all_tags = {**(tags or {}), **execution.tags()}
    return client.create_run(exp_id, run_name=execution.run_name(fallback_name), tags=all_tags).info.run_id


# The files of a model: a local HF folder, or a function that writes one into an empty folder.
ModelFiles = str | Path | Callable[[str], None]
MODEL_TASK = "text-generation"
MLMODEL = "MLmodel"  # the file that makes an artifact folder an MLflow model
# the libraries a served model needs, pinned to the versions that wrote it
SERVING_REQUIREMENTS = ("torch", "transformers", "tokenizers", "safetensors")


def model_signature() -> Any:
    """The served model's signature: a string prompt in, the generated string out; parameters
    max_new_tokens (default 64) and do_sample (default false: greedy)."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    params = ParamSchema([ParamSpec("max_new_tokens", "long", 64), ParamSpec("do_sample", "boolean", False)])
    return ModelSignature(Schema([ColSpec("string")]), Schema([ColSpec("string")]), params)


def _requirements() -> list[str]:
    from importlib.metadata import version

    return [f"{name}=={version(name).split('+')[0]}" for name in SERVING_REQUIREMENTS]


def save_transformers_model(hf_files: ModelFiles, folder: str) -> None:
    """Write the MLflow `transformers` model (task text-generation) of an HF folder (`hf_files`: a
    folder, or a function writing one) into the empty `folder`; the model is loaded on cpu, in float32."""
    import tempfile

    import mlflow.transformers

    from areal_core.models import load_pretrained

    with tempfile.TemporaryDirectory() as tmp:
        src = tmp if callable(hf_files) else str(hf_files)
        if callable(hf_files):
            hf_files(tmp)
        model, tokenizer = load_pretrained(src, "cpu")
        quiet = logging.getLogger("mlflow.transformers")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # no model card or license on a local checkpoint: not a problem
        try:
            mlflow.transformers.save_model(
                {"model": model, "tokenizer": tokenizer},
                folder,
                task=MODEL_TASK,
                signature=model_signature(),
                pip_requirements=_requirements(),
            )
        finally:
            quiet.setLevel(level)


def log_model(client: Any, run_id: str, artifact_path: str, hf_files: ModelFiles) -> None:
    """The one way a model is logged: as the MLflow transformers model of `hf_files` under
    `artifact_path` of run `run_id`, unless that path holds an MLflow model already (a retried
    task, or the final model evaluation logged before registration), so no file is uploaded twice."""
    import tempfile

    if any(f.path.rsplit("/", 1)[-1] == MLMODEL for f in client.list_artifacts(run_id, artifact_path)):
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(Path(tmp, "model"))
        save_transformers_model(hf_files, folder)
        client.log_artifacts(run_id, folder, artifact_path)


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

    def log_series(self, series: dict[int, dict[str, float]]) -> None:
        """Many steps' metrics {step: {name: value}} in batches of MLflow's 1000-metric limit."""
        if not self._client:
            return
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for step, m in sorted(series.items()) for k, v in m.items()]
        for i in range(0, len(batch), 1000):
            self._client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_artifacts(self, local_dir: str | Path, artifact_path: str) -> None:
        if self._client:
            self._client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_model(self, artifact_path: str, hf_files: ModelFiles) -> None:
        """Log a model the one way (`log_model`): `runs:/<run id>/<artifact_path>` then loads with
        `mlflow.pyfunc.load_model`."""
        if self._client:
            log_model(self._client, self.run_id, artifact_path, hf_files)

    def set_tag(self, key: str, value: str) -> None:
        if self._client:
            self._client.set_tag(self.run_id, key, value)

    @contextlib.contextmanager
    def system_metrics(self, node: str) -> Iterator[None]:
        """Log this machine's system metrics to the run as `system/<node>/...` while the block runs
        (every $MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL seconds, default 10)."""
        if not self._client:
            yield
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(self.run_id, node_id=node, resume_logging=True, tracking_uri=self.uri)
        monitor.start()
        try:
            yield
        finally:
            monitor.finish()

    def finish(self, status: str = "FINISHED") -> None:
        if self._client:
            try:
                import mlflow

                mlflow.flush_async_logging()
            except Exception:  # nothing pending or an older client
                pass
            self._client.set_terminated(self.run_id, status)
