"""What `flyte deploy` would send for the Flyte 2 front end, serialized offline (no control plane,
no image build): every task's spec and every trigger, as JSON (`flyte deploy --dry-run` needs a
configured endpoint; this does not). tests/test_flyte2.py inspects it.

    python -m flyte2.dryrun                 # the tasks of flyte2/grpo.py, online.py and derived.py
    python -m flyte2.dryrun flyte2.grpo     # one module's

Each task as {"env", "type", "image", "requests", "limits", "shm", "accelerator", "retries", "timeout_s",
"interruptible", "cache", "reuse", "plugin", "env_vars", "secrets"}, each trigger as {"task",
"name", "cron", "kickoff_input", "inputs", "notify"}, each device's image as {"uri", "base_image",
"python", "apt", "packages", "extra_index_urls", "commands", "env"}.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import pathlib
import sys
from typing import Any

MODULES = ("flyte2.grpo", "flyte2.online", "flyte2.derived")


# -- the SDK's private names: here only, one function each -----------------------------------------
# flyte 2.12.1 has no public offline serialization: `flyte.deploy(dry_run=True)` connects to a control
# plane (ensure_client) and builds every image before it serializes, and `flyte.Image` has no public
# accessor for its layers. These three functions are the only places the front end reaches into the
# SDK's internals; an SDK release that moves them fails here (tests/test_flyte2.py runs this module).
def wire_task(task: Any, context: Any) -> Any:
    """The TaskSpec `flyte deploy` would send for `task` (flyte._internal.runtime.task_serde)."""
    from flyte._internal.runtime.task_serde import translate_task_to_wire

    return translate_task_to_wire(task, context)


async def wire_trigger(trigger: Any, task: Any, spec: Any) -> Any:
    """The TaskTrigger `flyte deploy` would send for `trigger` (flyte._internal.runtime.trigger_serde)."""
    from flyte._internal.runtime.trigger_serde import to_task_trigger

    return await to_task_trigger(trigger, task.name, spec.task_template.interface.inputs, [])


def image_layers(image: Any) -> dict[str, Any]:
    """The layers of a `flyte.Image` (its private `_layers`, of the classes of flyte._image), as lists."""
    from flyte._image import AptPackages, Commands, Env, PipPackages

    out: dict[str, Any] = {"apt": [], "packages": [], "extra_index_urls": [], "commands": [], "env": {}}
    for layer in image._layers:
        if isinstance(layer, AptPackages):
            out["apt"] += list(layer.packages)
        elif isinstance(layer, PipPackages):
            out["packages"] += list(layer.packages or ())
            out["extra_index_urls"] += list(layer.extra_index_urls or ())
        elif isinstance(layer, Commands):
            out["commands"] += list(layer.commands)
        elif isinstance(layer, Env):
            out["env"] |= dict(layer.env_vars)
    return out


# -- the summaries ----------------------------------------------------------------------------------


def _resources(entries: list[dict[str, str]]) -> dict[str, str]:
    return {e["name"].lower(): e["value"] for e in entries}


def task_summary(task: Any, spec: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    tt = MessageToDict(spec.task_template)
    container, meta = tt.get("container", {}), tt.get("metadata", {})
    resources = container.get("resources", {})
    custom = tt.get("custom") or {}
    timeout = meta.get("timeout", "0s")
    return {
        "env": task.parent_env_name,
        "type": tt.get("type"),
        "image": container.get("image", ""),
        "requests": _resources(resources.get("requests", [])),
        "limits": _resources(resources.get("limits", [])),
        "shm": tt.get("extendedResources", {}).get("sharedMemory", {}).get("sizeLimit", ""),
        "accelerator": tt.get("extendedResources", {}).get("gpuAccelerator", {}).get("device", ""),
        "retries": int(meta.get("retries", {}).get("retries", 0)),
        "timeout_s": float(timeout.rstrip("s") or 0),
        "interruptible": bool(meta.get("interruptible", False)),
        "cache": {"enabled": bool(meta.get("discoverable")), "ignored": meta.get("cacheIgnoreInputVars", [])},
        "reuse": custom.get("spec") if tt.get("type") == "actor" else None,
        "plugin": custom if "elasticConfig" in custom else None,
        "env_vars": {e["key"]: e["value"] for e in container.get("env", [])},
        "secrets": sorted(
            (s["group"], s["key"], s.get("envVar", "")) for s in tt.get("securityContext", {}).get("secrets", [])
        ),
    }


async def trigger_summary(task: Any, spec: Any) -> list[dict[str, Any]]:
    from google.protobuf.json_format import MessageToDict

    out = []
    for trigger in task.triggers:
        body = MessageToDict(await wire_trigger(trigger, task, spec))
        schedule = body["automationSpec"]["schedule"]
        inputs = {}
        for lit in body["spec"].get("inputs", {}).get("literals", []):
            inputs[lit["name"]] = next(iter(lit["value"]["scalar"]["primitive"].values()))
        rules = body["spec"].get("runSpec", {}).get("notificationRules", {}).get("rules", [])
        out.append(
            {
                "task": task.name,
                "name": trigger.name,
                "cron": schedule.get("cron", {}).get("expression", ""),
                "kickoff_input": schedule.get("kickoffTimeInputArg", ""),
                "inputs": inputs,
                "notify": [
                    {"phases": r["onPhases"], "to": [a["address"] for a in r["deliveryTemplate"]["email"]["to"]]}
                    for r in rules
                ],
            }
        )
    return out


def image_summary(image: Any) -> dict[str, Any]:
    """A `flyte.Image`: its URI, base image, Python version and layers."""
    out: dict[str, Any] = {"uri": image.uri, "base_image": image.base_image, "python": list(image.python_version)}
    return out | image_layers(image)


def dry_run(modules: tuple[str, ...] = MODULES) -> dict[str, Any]:
    from flyte.models import SerializationContext

    root = pathlib.Path(__file__).resolve().parents[1]
    context = SerializationContext(version="dry-run", project="areal", domain="development", root_dir=root)
    for module in modules:
        importlib.import_module(module)
    from flyte2 import envs

    tasks: dict[str, Any] = {}
    triggers: list[dict[str, Any]] = []
    for env in (envs.DRIVER, *envs.DRIVER.depends_on):
        for name, task in env.tasks.items():
            spec = wire_task(task, context)
            tasks[name] = task_summary(task, spec)
            triggers += asyncio.run(trigger_summary(task, spec))
    from areal_core.config.device import DEVICES
    from flyte2.images import image_for

    images = {device: image_summary(image_for(device)) for device in DEVICES}
    return {"tasks": tasks, "triggers": triggers, "images": images}


if __name__ == "__main__":
    print(json.dumps(dry_run(tuple(sys.argv[1:]) or MODULES), indent=1, sort_keys=True))
