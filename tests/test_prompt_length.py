"""Prepare refuses prompts that leave no room for rollout.max_new_tokens in the model's context:
every reader would quarantine their samples (protocol.shard_limits_for) and the run would wait on
nothing until the launcher's timeout (found with reasoning-gym's long prompts on a tiny model)."""

from __future__ import annotations

import json

import pytest

from areal_core.config import ConfigError
from areal_core.run import pipeline
from benchmarks import tiny_checkpoints as tc
from tests.conftest import TINY


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tc.save("llama", tmp_path_factory.mktemp("ckpt") / "llama")  # max_position_embeddings 512


def data(tmp_path, words: int):
    rows = [{"prompt": "add these " + " ".join(["one"] * (words if i == 7 else 3)), "answer": "1"} for i in range(20)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def overrides(tmp_path, checkpoint, words: int, new_tokens: int) -> list[str]:
    (tmp_path / "data").mkdir()
    folder = data(tmp_path / "data", words)
    return [*TINY, f"store={tmp_path / 'run'}", f"model.path={checkpoint}", "sft.enabled=false", "task.name=dataset",
            f"task.path={folder}", f"rollout.max_new_tokens={new_tokens}"]  # fmt: skip


def test_a_prompt_longer_than_the_context_is_refused_at_prepare(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match=r"preflight prompt_length: config key 'rollout.max_new_tokens': 1 of the "
                       r"\d+ longest training prompts leave no room for 8 new tokens in the model's context of 512 "
                       r"\(the longest, 'dataset-train-7', is \d+ tokens\)"):  # fmt: skip
        pipeline.prepare("", overrides(tmp_path, checkpoint, 600, 8))
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_the_new_tokens_count_against_the_context(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match=r"no room for 500 new tokens"):
        pipeline.prepare("", overrides(tmp_path, checkpoint, 3, 500))


def test_prompts_that_fit_pass(checkpoint, tmp_path):
    run_uri, _ = pipeline.prepare("", overrides(tmp_path, checkpoint, 3, 8))
    assert (tmp_path / "run" / "config.yaml").exists() and run_uri
