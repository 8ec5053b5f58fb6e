"""The registration: `pyflyte package` in a fresh process, parsed back into protobuf entities."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from flyteidl.admin import launch_plan_pb2, task_pb2, workflow_pb2
from flyteidl.core import tasks_pb2
from flyteidl.core import workflow_pb2 as core_workflow_pb2

PYFLYTE = str(Path(sys.executable).parent / "pyflyte")
IMAGE = "areal-flyte:podemu"  # the default image (tasks that name none); cluster tasks name their own


@dataclass
class Package:
    """What `pyflyte register` would send to FlyteAdmin, by entity name."""

    tasks: dict[str, tasks_pb2.TaskTemplate] = field(default_factory=dict)
    workflows: dict[str, core_workflow_pb2.WorkflowTemplate] = field(default_factory=dict)
    launch_plans: dict[str, launch_plan_pb2.LaunchPlanSpec] = field(
        default_factory=dict
    )  # the default one has the workflow's name


def package(root: Path, out_dir: Path, env: dict[str, str], packages: str = "workflows") -> Package:
    """Serialize `packages` as `pyflyte --pkgs <packages> package` does, in a fresh process with
    `env` (the registering user's environment), and parse the archive."""
    out_dir.mkdir(parents=True, exist_ok=True)
    archive = out_dir / "flyte-package.tgz"
    cmd = [PYFLYTE, "--pkgs", packages, "package", "--image", IMAGE, "--output", str(archive), "--force"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"pyflyte package failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    pkg = Package()
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if not member.name.endswith(".pb"):
                continue
            data = tar.extractfile(member).read()
            kind = member.name.rsplit("_", 1)[1]  # <n>_<name>_<1 task | 2 workflow | 3 launch plan>.pb
            if kind == "1.pb":
                spec = task_pb2.TaskSpec.FromString(data)
                pkg.tasks[spec.template.id.name] = spec.template
            elif kind == "2.pb":
                wf = workflow_pb2.WorkflowSpec.FromString(data)
                pkg.workflows[wf.template.id.name] = wf.template
            elif kind == "3.pb":
                lp = launch_plan_pb2.LaunchPlan.FromString(data)
                pkg.launch_plans[lp.id.name] = lp.spec
    return pkg
