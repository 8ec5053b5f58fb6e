"""MLflow model registry: register a finished run's models, register an online candidate only when
it beats the champion, and load any registered version on any device.

Every registered version is logged the one way every model is (`areal_core/run/tracking.py:log_model`):
an MLflow model of the `transformers` flavor (task text-generation, a string-in string-out
signature with `max_new_tokens` and `do_sample` parameters, fp32 weights as safetensors), so it
serves as it is:
`mlflow.pyfunc.load_model("models:/areal-flyte-policy@champion").predict(["1 + 2 ="])`.
A version trained on cuda or npu loads on any device:
`load_registered("models:/areal-flyte-policy@champion", device="cpu")`.

Aliases: `champion` is the version in service (the one online retraining starts from and must
beat); `candidate` is the newest version that waits for promotion. A run's registration
(`register_run`): final_model/ becomes a version of `model_name` with alias `candidate` (and
`champion` when the model has none yet), the newest committed trainer checkpoint a version of
`<model_name>-checkpoints`; every version carries tags for the device and the container image
that produced it, the run root, the trainer step and the held-out accuracy. An online candidate
(`register_if_better`) is registered only when it beats the champion, then promoted: `champion`
moves to it. Promote by hand with `MlflowClient().set_registered_model_alias(name, "champion", N)`.

Works with any tracking URI: a sqlite file, or an MLflow server (sqlite or Postgres backend,
artifacts on S3: docs/cluster.md). Idempotent: a retried task finds the version it already
created for this MLflow run instead of adding another, and uploads no file twice; an online
candidate is keyed by its run root (`register_if_better(key=...)`), so a retried publish finds the
MLflow run and the version an earlier attempt made.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_core.layout import LAYOUT
from areal_core.logs import setup_logging
from areal_core.run.tracking import ModelFiles, Tracker, log_model, mlflow_client, new_run
from areal_core.store import Store

log = logging.getLogger("areal.registry")

CHAMPION, CANDIDATE = "champion", "candidate"


# ---------------------------------------------------------------------------------------------
# The one mechanism: log a model once (run/tracking.py:log_model), then make it a registered version
# ---------------------------------------------------------------------------------------------
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
    """Register the model files (an HF folder, or a function writing one) as a new version of
    `name`, logged once as an MLflow transformers model; creates the registered model (with
    `model_description`) on first use; returns the ModelVersion."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=model_description)
    log_model(client, run_id, artifact_path, files)
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


def aliased(client: Any, name: str, alias: str = CHAMPION) -> Any | None:
    """The version of registered model `name` that carries `alias`, or None."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def promote(client: Any, name: str, version: str) -> None:
    """Make `version` the champion; its `candidate` alias, if any, is dropped (it no longer waits)."""
    client.set_registered_model_alias(name, CHAMPION, version)
    candidate = aliased(client, name, CANDIDATE)
    if candidate is not None and str(candidate.version) == str(version):
        client.delete_registered_model_alias(name, CANDIDATE)


def download(model_uri: str, tracking_uri: str = "") -> str:
    """A local HF folder (weights, config, tokenizer) of `model_uri` (models:/name/N or
    models:/name@alias): the MLflow transformers model's model/ with its tokenizer merged in."""
    import shutil

    import mlflow

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    root = Path(mlflow.artifacts.download_artifacts(model_uri))
    model_dir = root / "model"
    for src in (root / "components" / "tokenizer").glob("*"):
        shutil.copy2(src, model_dir / src.name)
    return str(model_dir)


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


CANDIDATE_TAG = "candidate_key"  # on an online candidate's MLflow run: a digest of the caller's key


def _keyed_run(client: Any, experiment: str, key_digest: str) -> str | None:
    """The MLflow run an earlier call with the same key created (its first, if several), or None."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.{CANDIDATE_TAG} = '{key_digest}'",
        order_by=["attributes.start_time ASC"],
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


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
        "format": "mlflow-transformers",
        **{k: f"{v:.4f}" for k, v in (metrics or {}).items()},
    }
    out: dict[str, Any] = {}
    final_files = store_files(store, LAYOUT.final_model, drop=(LAYOUT.committed_name,))
    # the run's final_model artifact: evaluation logged it the same way (log_model), else it is logged now
    items = [("final", model_name, LAYOUT.final_model, final_files, {})]
    steps = checkpoint.committed_steps(store) if include_checkpoint else []
    if steps and store.exists(LAYOUT.checkpoint_file(steps[-1], checkpoint.ADAPTER_FILE)):
        log.info("checkpoint %d holds a LoRA adapter, not a model: only the final model is registered", steps[-1])
        steps = []
    if steps:
        # a checkpoint holds model.safetensors; config and tokenizer come from init_model so it loads alone.
        # Neither manifest travels: each describes its own folder, not this merged one.
        side = {
            rel.rsplit("/", 1)[-1]: store.read_bytes(rel)
            for rel in store.find(LAYOUT.init_model)
            if not rel.endswith((checkpoint.MODEL_FILE, LAYOUT.committed_name, LAYOUT.manifest_name))
        }
        base = LAYOUT.checkpoint_dir(steps[-1])
        files = store_files(store, base, side, drop=(LAYOUT.manifest_name, LAYOUT.committed_name))
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
    final = out["final"].rsplit("/", 1)[-1]
    client.set_registered_model_alias(model_name, CANDIDATE, final)
    if aliased(client, model_name) is None:
        promote(client, model_name, final)
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
def _recorded_score(mv: Any) -> float | None:
    """A registered version's held-out score (its `heldout_score` tag) when it is a finite number."""
    try:
        value = float(mv.tags["heldout_score"]) if mv is not None else None
    except (KeyError, TypeError, ValueError):
        return None
    return value if value is not None and math.isfinite(value) else None


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
    key: str = "",
    score_current: Callable[[str], float | None] | None = None,
) -> dict[str, Any]:
    """Log an MLflow run with both scores; register `model` (an HF folder, or a function writing
    one) as a new version of `model_name` and promote it to champion only when it beats the bar:
    candidate_score > max(current_score, the champion's recorded score) + min_gain, the champion read
    from the registry at this call (a champion moved by hand, or by another run, since the caller
    took its baseline is what must be beaten). A champion with no recorded score (`heldout_score`
    tag) is scored by `score_current(models:/name/N)` and tagged, or, where that gives None, never replaced.
    The move is compare-and-set: the alias is read again just before it moves, and a champion that
    changed meanwhile is left as it is (`out["refused"]` says why nothing moved).

    `key` names the candidate (online retraining passes its run root). A call with the key of an
    earlier call reuses that call's MLflow run and returns the version it registered, promoting it
    only if the earlier call died before it could (and no newer version is champion since), so a
    retried task registers a candidate once.

    Returns {"registered": bool, "model_uri": "models:/name/N" of the champion after the call
    ('' when there is none; with `key`, the candidate's version when it was registered), "run_id"}.
    """
    client = mlflow_client(tracking_uri)
    run_id, earlier = _open_run(client, model_name, experiment, run_name, key)
    for k, v in (params or {}).items():
        client.log_param(run_id, k, str(v)[:500])
    client.log_metric(run_id, "candidate_score", candidate_score)
    if current_score is not None:
        client.log_metric(run_id, "current_score", current_score)
    current = aliased(client, model_name)
    out: dict[str, Any] = {
        "registered": False,
        "run_id": run_id,
        "model_uri": f"models:/{model_name}/{current.version}" if current else "",
        "refused": "",
    }
    if earlier is not None and current is not None and str(earlier.version) == str(current.version):
        out.update(registered=True, model_uri=f"models:/{model_name}/{current.version}")  # a retry of a move made
        client.set_terminated(run_id)
        return out
    recorded, out["refused"] = _champion_score(client, model_name, current, score_current)
    bars = [x for x in (current_score, recorded) if x is not None]
    bar = max(bars) if bars else None
    if recorded is not None:
        client.log_metric(run_id, "champion_score", recorded)
    if not out["refused"] and (bar is None or candidate_score > bar + min_gain):
        labels = {**(tags or {}), "kind": "online", "heldout_score": f"{candidate_score:.4f}"}
        mv = earlier or create_version(
            client,
            model_name,
            run_id,
            "model",
            model,
            labels,
            f"online retrain {run_name}",
            "AReaL-Flyte online retraining",
        )
        out["refused"] = _promote_unless_moved(client, model_name, current, mv.version)
        out.update(registered=not out["refused"], model_uri=f"models:/{model_name}/{mv.version}")
    client.set_tag(run_id, "registered", str(out["registered"]).lower())
    client.set_terminated(run_id)
    log.info(
        "candidate %.4f vs current %s: %s",
        candidate_score,
        "none" if current_score is None else f"{current_score:.4f}",
        f"registered {out['model_uri']}" if out["registered"] else "not registered",
    )
    return out


def _open_run(client: Any, model_name: str, experiment: str, run_name: str, key: str) -> tuple[str, Any]:
    """(run id, the version an earlier call with `key` registered or None): the keyed candidate's
    MLflow run when an earlier call made one (a retried task), else a new run."""
    import hashlib

    digest = hashlib.sha256(key.encode()).hexdigest()[:32] if key else ""
    run_id = (_keyed_run(client, experiment, digest) if key else None) or new_run(
        client, experiment, run_name, {CANDIDATE_TAG: digest} if key else None
    )
    return run_id, (_version_for(client, model_name, run_id, "online") if key else None)


def _champion_score(
    client: Any, model_name: str, current: Any, score_current: Callable[[str], float | None] | None
) -> tuple[float | None, str]:
    """(the champion's held-out score, why nothing may move: '' when something may). A champion
    without a recorded score is scored by `score_current` and tagged; one it cannot score is kept."""
    recorded = _recorded_score(current)
    if current is None or recorded is not None:
        return recorded, ""
    measured = score_current(f"models:/{model_name}/{current.version}") if score_current is not None else None
    if measured is None or not math.isfinite(measured):
        return None, f"champion v{current.version} has no recorded held-out score: score it before replacing it"
    client.set_model_version_tag(model_name, current.version, "heldout_score", f"{float(measured):.4f}")
    return float(measured), ""


def _promote_unless_moved(client: Any, model_name: str, current: Any, version: Any) -> str:
    """Make `version` the champion (compare-and-set: only if the champion is still `current`);
    why it did not ('' when it did, or when it already was promoted)."""
    if current is not None and int(current.version) >= int(version):  # promoted already
        return ""
    now = aliased(client, model_name)
    if (now and str(now.version)) != (current and str(current.version)):
        return f"the champion moved to v{now.version if now else '-'} while this was compared"
    client.set_registered_model_alias(model_name, CANDIDATE, version)
    promote(client, model_name, version)
    return ""
