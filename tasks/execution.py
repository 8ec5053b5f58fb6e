"""The Flyte execution a task runs in, handed to areal_core (which never imports flytekit) as
environment variables: areal_core.run.tracking.Execution reads them back, to name the MLflow run
after the execution and tag it with the execution id and a console link. The variables also reach
the role processes a task starts.
"""

from __future__ import annotations

import os

from areal_core.run.tracking import EXECUTION_ENV, Execution

LOCAL = "local"  # flytekit's project, domain and name of a local execution


def console_endpoint() -> str:
    """The Flyte console's address: $AREAL_FLYTE_CONSOLE, else flytekit's platform config
    (`console.endpoint`, else http(s)://<admin endpoint> when an endpoint is configured); '' when
    neither is known."""
    if value := os.environ.get(EXECUTION_ENV["console"]):
        return value
    from flytekit.configuration import PlatformConfig

    platform = PlatformConfig.auto()
    if platform.console_endpoint:
        return platform.console_endpoint
    if platform.endpoint and platform.endpoint != PlatformConfig().endpoint:
        host = platform.endpoint.removeprefix("dns:///")
        return f"{'http' if platform.insecure else 'https'}://{host}"
    return ""


def console_env() -> dict[str, str]:
    """{$AREAL_FLYTE_CONSOLE: the console address} as known where the workflow is registered, for
    the tasks' environment (a pod has no flytekit config of its own); {} when unknown."""
    endpoint = console_endpoint()
    return {EXECUTION_ENV["console"]: endpoint} if endpoint else {}


def bind_execution() -> Execution:
    """Put the current Flyte execution (id, project, domain, console) into this process's
    environment for areal_core; a local execution binds nothing (its runs get generated names)."""
    from flytekit import current_context

    ex = current_context().execution_id
    if not ex.name or ex.name == LOCAL:
        return Execution()
    execution = Execution(ex.name, ex.project, ex.domain, console_endpoint())
    os.environ.update(execution.env())
    return execution


def refuse_local_workflow(workflow: str) -> None:
    """A workflow whose nodes must run concurrently fails at once under flytekit's local executor,
    which runs nodes one at a time (its pools would wait forever for a trainer that never starts)."""
    from flytekit.core.context_manager import ExecutionState, FlyteContextManager

    state = FlyteContextManager.current_context().execution_state
    if state is not None and state.mode == ExecutionState.Mode.LOCAL_WORKFLOW_EXECUTION:
        raise RuntimeError(
            f"{workflow} runs its rollout pool, reward pool and trainer concurrently, which flytekit's local "
            f"executor cannot do (it runs nodes one at a time). Use `pyflyte run --remote --copy all "
            f"workflows/grpo.py {workflow}`, or `workflows/grpo.py grpo` on one machine, or start each role "
            "with `pyflyte run tasks/roles.py <role> --run_uri ...` as separate processes."
        )
