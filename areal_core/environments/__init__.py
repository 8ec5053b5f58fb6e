"""Environments other frameworks wrote, run as they are: `rollout.environment = "<kind>:<spec>"`.

    verifiers:<taskset id or pkg.module:load_taskset>   a verifiers 0.4 (`verifiers.v1`) environment, in its
                                                        own venv (areal_core/environments/verifiers_env.py)
    openenv:<url>                                       an OpenEnv server (areal_core/environments/openenv_env.py)

An environment gives both the prompts and the episodes. Its module has

    load_records(spec, task, seed) -> (train, eval)     prompt records (task_data/registry.py's contract);
                                                        each record's meta names the environment
    async run_episode(spec, task, base_url, api_key) -> float | dict | None
                                                        one episode against the proxy at base_url (an agent,
                                                        docs/proxy.md); a dict is {"reward", "info"}

`ENVIRONMENT_AGENT` is the agent (`rollout.agent`) every environment run uses: it reads the spec
from the task's meta and calls the kind's `run_episode`.
"""

from __future__ import annotations

import importlib
from typing import Any

from areal_core.config.base import ConfigError
from areal_core.config.run import ENVIRONMENT_AGENT, ENVIRONMENT_KINDS

ENVIRONMENTS = {kind: f"areal_core.environments.{kind}_env" for kind in ENVIRONMENT_KINDS}
__all__ = ["ENVIRONMENT_AGENT", "ENVIRONMENTS", "load_records", "parse", "run_episode"]


def parse(spec: str) -> tuple[str, str]:
    """`"verifiers:gsm8k"` -> ("verifiers", "gsm8k"); a ConfigError naming `rollout.environment` otherwise."""
    kind, sep, rest = str(spec).partition(":")
    if not sep or kind not in ENVIRONMENTS or not rest.strip():
        raise ConfigError(
            f"config key 'rollout.environment' must look like '<kind>:<spec>' with kind one of {sorted(ENVIRONMENTS)}, "
            f"got {spec!r}"
        )
    return kind, rest.strip()


def module(spec: str) -> Any:
    kind, _ = parse(spec)
    return importlib.import_module(ENVIRONMENTS[kind])


def load_records(spec: str, task: Any, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) prompt records of the environment `spec`; each record's meta holds `environment`."""
    kind, rest = parse(spec)
    train, held_out = module(spec).load_records(rest, task, seed)
    for r in [*train, *held_out]:
        r.setdefault("meta", {})["environment"] = spec
    return train, held_out


async def run_episode(task: dict[str, Any], base_url: str, api_key: str) -> Any:
    """The agent of every environment run: the environment named in the task's meta runs one episode."""
    spec = (task.get("meta") or {}).get("environment")
    if not spec:
        raise ValueError(f"prompt {task.get('prompt_id')!r} names no environment (meta.environment)")
    _, rest = parse(spec)
    return await module(spec).run_episode(rest, task, base_url, api_key)
