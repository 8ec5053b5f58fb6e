"""Register the run's final model (and its newest trainer checkpoint) in the MLflow model registry
(areal_core/online/registry.py), tagged with the device and image this task runs in."""

from __future__ import annotations

from flytekit import task

from areal_core.online.registry import register_final_model
from tasks.cluster import CLUSTER, DEVICE, ENV, IMAGE, IMAGE_NAME
from tasks.resources import SECRETS, task_kwargs


@task(container_image=IMAGE, environment=ENV, secret_requests=SECRETS, **task_kwargs(CLUSTER.small, DEVICE))
def register(run_uri: str, model_name: str, before: float, after: float) -> str:
    """Register the final model and the newest checkpoint; returns the final model's models:/ URI
    ('' when the run has tracking disabled)."""
    return register_final_model(run_uri, model_name, before, after, DEVICE, IMAGE_NAME)
