"""Register the run's final model (and its newest trainer checkpoint) in the MLflow model registry
(areal_core/online/registry.py), tagged with the device and image this task runs in."""

from __future__ import annotations

from flytekit import task

from areal_core.online.registry import register_final_model
from areal_core.run.cluster import pod_identity
from tasks.cluster import SMALL_POD, registered_image
from tasks.resources import SECRETS


@task(task_config=SMALL_POD, secret_requests=SECRETS)
def register(run_uri: str, model_name: str, before: float, after: float) -> str:
    """Register the final model and the newest checkpoint; returns the final model's models:/ URI
    ('' when the run has tracking disabled)."""
    return register_final_model(run_uri, model_name, before, after, *pod_identity(registered_image).values())
