"""Register the run's final model (and its newest trainer checkpoint) in the MLflow model registry.

Every version carries tags for the device and the container image that produced it, the run
root, the trainer step and the held-out accuracy. The registered files are plain Hugging Face
safetensors (float32) plus config and tokenizer, so a version trained on cuda or npu loads on any
device: `load_registered("models:/areal-flyte-policy/3", device="cpu")`.

Works with any tracking URI: a sqlite file, or an MLflow server (sqlite or Postgres backend,
artifacts on S3: docs/cluster.md). Idempotent: a retried task finds the version it already
created for this MLflow run instead of adding another.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from flytekit import task

from tasks.cluster import CLUSTER, DEVICE, ENV, IMAGE, IMAGE_NAME
from tasks.resources import task_kwargs

log = logging.getLogger("areal.register")


def _version_for(client, name: str, run_id: str, kind: str):
    for mv in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
        if mv.tags.get("kind") == kind:
            return mv
    return None


def _ensure_registered_model(client, name: str, description: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=description)


def _ensure_artifacts(client, run_id: str, store, rel: str, artifact_path: str, extra: dict[str, bytes]) -> None:
    """Copy `rel` from the run root (plus `extra` files) into the MLflow run's artifacts once."""
    if client.list_artifacts(run_id, artifact_path):
        return
    with tempfile.TemporaryDirectory() as tmp:
        store.get_dir(rel, tmp)
        for name, data in extra.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        client.log_artifacts(run_id, tmp, artifact_path)


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
    import mlflow

    from areal_core.run.tracking import Tracker
    from areal_core.store import LAYOUT, Store
    from areal_core.train import checkpoint

    store = Store(run_uri)
    tracker = Tracker.attach(store)
    if not tracker.enabled:
        log.warning("tracking is disabled for %s: nothing registered", store.uri)
        return {}
    if not store.exists(LAYOUT.committed(LAYOUT.final_model)):
        raise FileNotFoundError(f"{store.url(LAYOUT.final_model)} is not committed: the run has not finished")
    mlflow.set_tracking_uri(tracker.uri)
    client = mlflow.MlflowClient(tracker.uri)
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
    items = [("final", model_name, LAYOUT.final_model, LAYOUT.final_model, {})]
    steps = checkpoint.committed_steps(store) if include_checkpoint else []
    if steps:
        # a checkpoint holds model.safetensors; config and tokenizer come from init_model so it loads alone
        side = {
            rel.rsplit("/", 1)[-1]: store.read_bytes(rel)
            for rel in store.find(LAYOUT.init_model)
            if not rel.endswith((checkpoint.MODEL_FILE, LAYOUT.committed_name))
        }
        base = LAYOUT.checkpoint_dir(steps[-1])
        items.append(("checkpoint", f"{model_name}-checkpoints", base, f"checkpoints/step-{steps[-1]:06d}", side))
    for kind, name, rel, artifact_path, extra in items:
        _ensure_registered_model(client, name, f"AReaL-Flyte {kind} models")
        mv = _version_for(client, name, run_id, kind)
        if mv is None:
            _ensure_artifacts(client, run_id, store, rel, artifact_path, extra)
            mv = client.create_model_version(
                name,
                f"runs:/{run_id}/{artifact_path}",
                run_id,
                tags={**tags, "kind": kind, **({"checkpoint_step": str(steps[-1])} if kind == "checkpoint" else {})},
                description=f"{kind} model of {store.uri}",
            )
        out[kind] = f"models:/{name}/{mv.version}"
    tracker.set_tag("registered_model", out["final"])
    log.info("registered %s", out)
    return out


def load_registered(model_uri: str, device: str = "cpu", tracking_uri: str = "") -> tuple[Any, Any]:
    """(model, tokenizer) of a registered version on `device`, whatever device trained it."""
    import mlflow

    from areal_core.models import load_pretrained

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    local = mlflow.artifacts.download_artifacts(model_uri)
    return load_pretrained(local, device)


@task(container_image=IMAGE, environment=ENV, **task_kwargs(CLUSTER.small, DEVICE))
def register(run_uri: str, model_name: str, before: float, after: float) -> str:
    """Register the final model and the newest checkpoint; returns the final model's models:/ URI
    ('' when the run has tracking disabled)."""
    from areal_core.logs import setup_logging

    setup_logging()
    device = os.environ.get("AREAL_DEVICE", DEVICE)
    image = os.environ.get("AREAL_IMAGE", IMAGE_NAME)
    out = register_run(
        run_uri, model_name, device, image, {"heldout_accuracy_before": before, "heldout_accuracy_after": after}
    )
    return out.get("final", "")
