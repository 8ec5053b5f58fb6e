"""docs/data.md's worked examples, run as written (their overrides read from the page) on a tiny
checkpoint: GSM8K in the hub's Parquet layout, MATH JSONL, a custom table with the user's reward,
and a loader plug-in; the first also through `pyflyte run`."""

from __future__ import annotations

import re
import shlex

import pytest

from areal_core.run import pipeline
from areal_core.run.launcher import launch
from areal_core.store import Store
from benchmarks import tiny_checkpoints as tc
from tests.conftest import ROOT, TINY
from tests.test_flyte import pyflyte

EXAMPLES = re.findall(r'--overrides "([^"]+)"', (ROOT / "docs" / "data.md").read_text())


def test_the_page_has_the_four_examples():
    assert [shlex.split(e)[0] for e in EXAMPLES] == ["task.name=gsm8k", "task.name=math", "task.name=dataset"] + [
        "task.name=dataset"
    ]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tc.save("llama", tmp_path_factory.mktemp("ckpt") / "llama")


def overrides(example: str, checkpoint, store) -> list[str]:
    return [*TINY, f"store={store}", f"model.path={checkpoint}", "sft.enabled=false", *shlex.split(example)]


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=["gsm8k-hub", "math", "dataset-reward", "loader"])
def test_each_example_trains_to_done(example, checkpoint, tmp_path):
    run_uri, _ = pipeline.prepare("", overrides(example, checkpoint, tmp_path / "run"))
    pipeline.sft(run_uri)
    launch(run_uri, 1, 1, timeout_s=600, progress=False)
    store = Store(run_uri)
    assert store.done() and store.latest_version() == 4


@pytest.mark.slow
def test_the_hub_example_through_pyflyte_run(checkpoint, tmp_path):
    store = tmp_path / "run"
    out = pyflyte(
        "run",
        "workflows/grpo.py",
        "grpo",
        "--overrides",
        shlex.join(overrides(EXAMPLES[0], checkpoint, store)),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out greedy accuracy: before RL" in out.stdout + out.stderr
    assert (store / "DONE").exists() and "name: gsm8k" in (store / "config.yaml").read_text()
