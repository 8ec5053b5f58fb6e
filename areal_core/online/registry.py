"""MLflow model registry: register a finished run's models, register an online candidate only when
it beats the current version, and load any registered version on any device.

A run's registration (`register_run`): final_model/ becomes a version of `model_name` and the
newest committed trainer checkpoint a version of `<model_name>-checkpoints`. Every version carries
tags for the device and the container image that produced it, the run root, the trainer step and
the held-out accuracy. The registered files are plain Hugging Face safetensors (float32) plus
config and tokenizer, so a version trained on cuda or npu loads on any device:
`load_registered("models:/areal-flyte-policy/3", device="cpu")`.

Works with any tracking URI: a sqlite file, or an MLflow server (sqlite or Postgres backend,
artifacts on S3: docs/cluster.md). Idempotent: a retried task finds the version it already
created for this MLflow run instead of adding another, and uploads no file twice.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_core.logs import setup_logging
from areal_core.run.tracking import Tracker, mlflow_client, new_run
from areal_core.store import LAYOUT, Store

log = logging.getLogger("areal.registry")

# The files of a model: a local folder, or a function that writes them into an empty folder.
ModelFiles = str | Path | Callable[[str], None]


# ---------------------------------------------------------------------------------------------
# The one mechanism: upload a model's files once, then make them a registered version
# ---------------------------------------------------------------------------------------------
def log_model_files(client: Any, run_id: str, artifact_path: str, files: ModelFiles) -> None:
    """Upload `files` under `artifact_path` of MLflow run `run_id`, unless the run has them already
    (a retried task); a function is called (on an empty temporary folder) only when needed."""
    import tempfile

    if client.list_artifacts(run_id, artifact_path):
        return
    if not callable(files):
        client.log_artifacts(run_id, str(files), artifact_path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        files(tmp)
        client.log_artifacts(run_id, tmp, artifact_path)


def create_version(
    client: Any,
    name: str,
    run_id: str,
    artifact_path: str,
    files: ModelFiles,
    tags: dict[str, str],
    description: str,
    model_description: str,
) -> Any:
    """Register the model files (uploaded once) as a new version of `name`, creating the registered
    model (with `model_description`) on first use; returns the ModelVersion."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=model_description)
    log_model_files(client, run_id, artifact_path, files)
    return client.create_model_version(
        name, f"runs:/{run_id}/{artifact_path}", run_id, tags=tags, description=description
    )


def store_files(
    store: Store, rel: str, extra: dict[str, bytes] | None = None, drop: tuple[str, ...] = ()
) -> ModelFiles:
    """The folder `rel` of a run root as model files, plus `extra` files and without those in `drop`."""

    def write(folder: str) -> None:
        store.get_dir(rel, folder)
        for name, data in (extra or {}).items():
            Path(folder, name).write_bytes(data)
        for name in drop:
            Path(folder, name).unlink(missing_ok=True)

    return write


def latest_version(client: Any, name: str) -> Any | None:
    """The newest version of registered model `name`, or None."""
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name = '{name}'")
    except MlflowException:
        return None
    return max(versions, key=lambda mv: int(mv.version), default=None)


def download(model_uri: str, tracking_uri: str = "") -> str:
    """A local folder holding the files of `model_uri` (models:/name/N)."""
    import mlflow

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    return mlflow.artifacts.download_artifacts(model_uri)


def load_registered(model_uri: str, device: str = "cpu", tracking_uri: str = "") -> tuple[Any, Any]:
    """(model, tokenizer) of a registered version on `device`, whatever device trained it."""
    from areal_core.models import load_pretrained

    return load_pretrained(download(model_uri, tracking_uri), device)


# ---------------------------------------------------------------------------------------------
# A finished training run
# ---------------------------------------------------------------------------------------------
def _version_for(client: Any, name: str, run_id: str, kind: str) -> Any | None:
    for mv in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
        if mv.tags.get("kind") == kind:
            return mv
    return None


def register_run(
    run_uri: str,
    model_name: str,
    device: str,
    image: str,
    metrics: dict[str, float] | None = None,
    include_checkpoint: bool = True,
) -> dict[str, Any]:
    """Register final_model/ as a version of `model_name` and the newest committed trainer
    checkpoint as a version of `<model_name>-checkpoints`; returns their models:/ URIs ({} when
    tracking is disabled for the run)."""
    from areal_core.train import checkpoint

    store = Store(run_uri)
    tracker = Tracker.attach(store)
    if not tracker.enabled:
        log.warning("tracking is disabled for %s: nothing registered", store.uri)
        return {}
    if not store.exists(LAYOUT.committed(LAYOUT.final_model)):
        raise FileNotFoundError(f"{store.url(LAYOUT.final_model)} is not committed: the run has not finished")
    client = mlflow_client(tracker.uri)
    run_id = tracker.run_id
    done = store.read_json(LAYOUT.done) if store.exists(LAYOUT.done) else {}
    tags = {
        "device": device,
        "image": image,
        "run_uri": store.uri,
        "step": str(done.get("step", "")),
        "format": "hf-safetensors-fp32",
        **{k: f"{v:.4f}" for k, v in (metrics or {}).items()},
    }
    out: dict[str, Any] = {}
    items = [("final", model_name, LAYOUT.final_model, store_files(store, LAYOUT.final_model), {})]
    steps = checkpoint.committed_steps(store) if include_checkpoint else []
    if steps:
        # a checkpoint holds model.safetensors; config and tokenizer come from init_model so it loads alone
        side = {
            rel.rsplit("/", 1)[-1]: store.read_bytes(rel)
            for rel in store.find(LAYOUT.init_model)
            if not rel.endswith((checkpoint.MODEL_FILE, LAYOUT.committed_name))
        }
        base = LAYOUT.checkpoint_dir(steps[-1])
        files = store_files(store, base, side)
        items.append(
            (
                "checkpoint",
                f"{model_name}-checkpoints",
                f"checkpoints/step-{steps[-1]:06d}",
                files,
                {"checkpoint_step": str(steps[-1])},
            )
        )
    for kind, name, artifact_path, files, extra_tags in items:
        mv = _version_for(client, name, run_id, kind)
        if mv is None:
            mv = create_version(
                client,
                name,
                run_id,
                artifact_path,
                files,
                {**tags, "kind": kind, **extra_tags},
                f"{kind} model of {store.uri}",
                f"AReaL-Flyte {kind} models",
            )
        out[kind] = f"models:/{name}/{mv.version}"
    tracker.set_tag("registered_model", out["final"])
    log.info("registered %s", out)
    return out


def register_final_model(
    run_uri: str, model_name: str, before: float, after: float, default_device: str, default_image: str
) -> str:
    """What the workflow's `register` task does: register_run, tagged with the held-out accuracy
    before and after RL and with the device and image the task runs in ($AREAL_DEVICE and
    $AREAL_IMAGE, set on every cluster task, else the defaults); returns the final model's
    models:/ URI ('' when tracking is disabled)."""
    setup_logging()
    device = os.environ.get("AREAL_DEVICE", default_device)
    image = os.environ.get("AREAL_IMAGE", default_image)
    metrics = {"heldout_accuracy_before": before, "heldout_accuracy_after": after}
    return register_run(run_uri, model_name, device, image, metrics).get("final", "")


# ---------------------------------------------------------------------------------------------
# An online candidate: register only when better
# ---------------------------------------------------------------------------------------------
def register_if_better(
    model: ModelFiles,
    model_name: str,
    tracking_uri: str,
    candidate_score: float,
    current_score: float | None,
    min_gain: float = 0.0,
    experiment: str = "areal-flyte-online",
    run_name: str = "online",
    params: dict[str, Any] | None = None,
    tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Log an MLflow run with both scores; register `model` (a folder, or a function writing the
    files) as a new version of `model_name` only when there is no current version or
    candidate_score > current_score + min_gain.

    Returns {"registered": bool, "model_uri": "models:/name/N" or the current one, "run_id"}.
    """
    client = mlflow_client(tracking_uri)
    run_id = new_run(client, experiment, run_name)
    for k, v in (params or {}).items():
        client.log_param(run_id, k, str(v)[:500])
    client.log_metric(run_id, "candidate_score", candidate_score)
    if current_score is not None:
        client.log_metric(run_id, "current_score", current_score)
    better = current_score is None or candidate_score > current_score + min_gain
    current = latest_version(client, model_name)
    out: dict[str, Any] = {
        "registered": False,
        "run_id": run_id,
        "model_uri": f"models:/{model_name}/{current.version}" if current else "",
    }
    if better:
        mv = create_version(
            client,
            model_name,
            run_id,
            "model",
            model,
            {**(tags or {}), "heldout_score": f"{candidate_score:.4f}"},
            f"online retrain {run_name}",
            "AReaL-Flyte online retraining",
        )
        out.update(registered=True, model_uri=f"models:/{model_name}/{mv.version}")
    client.set_tag(run_id, "registered", str(out["registered"]).lower())
    client.set_terminated(run_id)
    log.info(
        "candidate %.4f vs current %s: %s",
        candidate_score,
        "none" if current_score is None else f"{current_score:.4f}",
        f"registered {out['model_uri']}" if out["registered"] else "not registered",
    )
    return out
