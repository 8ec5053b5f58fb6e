"""Register the run's final model (and its newest trainer checkpoint) in the MLflow model registry
(areal_core/online/registry.py), tagged with the device and image this task runs in."""

from __future__ import annotations

from flytekit import task

from jobs import steps
from jobs.spec import doc_of
from tasks.cluster import SMALL_POD, registered_image
from tasks.resources import SECRETS


@task(task_config=SMALL_POD, secret_requests=SECRETS)
@doc_of(steps.register)
def register(run_uri: str, model_name: str, before: float, after: float) -> str:
    return steps.register(run_uri, model_name, before, after, registered_image)
