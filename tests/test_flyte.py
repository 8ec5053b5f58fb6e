"""What a Flyte cluster would receive (serialised offline) and a local `pyflyte run`."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY


def serialize(entity):
    from flytekit.configuration import Image, ImageConfig, SerializationSettings
    from flytekit.tools.translator import get_serializable

    settings = SerializationSettings(
        image_config=ImageConfig(default_image=Image(name="default", fqn="areal-flyte", tag="test")),
        project="areal",
        domain="development",
        version="test",
    )
    return get_serializable(OrderedDict(), settings, entity)


def test_areal_core_never_imports_flytekit():
    imports = re.compile(r"^\s*(import flytekit|from flytekit[\w.]* import)", re.M)
    offenders = [p for p in (ROOT / "areal_core").rglob("*.py") if imports.search(p.read_text())]
    assert offenders == []


def test_grpo_workflow_serializes_with_its_four_nodes():
    from workflows.grpo import grpo

    wf = serialize(grpo)
    nodes = [n.id for n in wf.template.nodes]
    assert len(nodes) == 4
    assert set(wf.template.interface.inputs) == {"config", "overrides", "resume_run"}


def test_tasks_carry_cache_retries_and_resources():
    from tasks.pipeline import evaluate, run_async_rl, sft
    from tasks.roles import reward_worker, rollout_worker, trainer

    sft_t = serialize(sft).template
    assert sft_t.metadata.discoverable and sft_t.metadata.discovery_version == "1"
    assert serialize(run_async_rl).template.metadata.retries.retries == 2
    for task in (rollout_worker, reward_worker, trainer):
        t = serialize(task).template
        assert t.metadata.retries.retries == 3
        limits = {r.name: r.value for r in t.container.resources.requests}
        assert limits  # cpu and memory requested
    assert serialize(evaluate).template.metadata is not None


@pytest.mark.slow
def test_pyflyte_run_of_the_workflow_end_to_end(tmp_path):
    overrides = " ".join([*TINY, f"store={tmp_path / 'run'}"])
    out = subprocess.run(
        [str(Path(sys.executable).parent / "pyflyte"), "run", "workflows/grpo.py", "grpo", "--overrides", overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out greedy accuracy: before RL" in out.stdout + out.stderr
    assert (tmp_path / "run" / "DONE").exists()
    assert (tmp_path / "run" / "final_model" / "model.safetensors").exists()


@pytest.mark.slow
def test_pyflyte_run_rejects_a_bad_config_before_any_work(tmp_path):
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "pyflyte"),
            "run",
            "workflows/grpo.py",
            "grpo",
            "--overrides",
            f"store={tmp_path}/r train.etaa=1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "unknown config key 'train.etaa'" in out.stdout + out.stderr
    assert not (tmp_path / "r").exists()
