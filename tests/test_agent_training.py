"""Agent training from the config: `rollout.agent` makes the rollout role run the agent against an
in-process proxy, the trainer trains on the stored multi-turn episodes, and the evaluate step
reports held-out agent success (configs/agent_calculator.yaml)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.config import ConfigError, load_config
from areal_core.run import pipeline
from tests.conftest import ROOT

AGENT_CONFIG = str(ROOT / "configs" / "agent_calculator.yaml")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.agent=no_such_pkg.agents:run", "config key 'rollout.agent': cannot import 'no_such_pkg.agents:run'"),
        ("rollout.agent=areal_core.proxy.examples:nope", "has no attribute 'nope'"),
        ("rollout.agent=areal_core.proxy.examples:calculate", "is not an async function"),
        ("rollout.agent=calculator_agent", "must look like 'pkg.module:function'"),
        ("agent.sft_examples=areal_core.proxy.examples:missing", "config key 'agent.sft_examples'"),
        ("agent.tool_prompt=some", "config key 'agent.tool_prompt'"),
        ("train.eval_every=5", "config key 'train.eval_every' must be 0 with rollout.agent"),
    ],
)
def test_a_bad_agent_config_is_one_line_before_any_work(tmp_path, override, message):
    store = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        pipeline.prepare(AGENT_CONFIG, [f"store={store}", override])
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not store.exists()  # nothing written


def test_the_agent_config_resolves():
    cfg = load_config(AGENT_CONFIG)
    assert cfg.rollout.agent == "areal_core.proxy.examples:calculator_agent"
    assert cfg.agent.sft_examples and cfg.agent.corpus and cfg.train.eval_every == 0
    # the SFT cache key covers the agent's warm start, a plain run's key does not change
    assert '"agent"' in pipeline.sft_key(cfg) and '"agent"' not in pipeline.sft_key(load_config(None))


def test_agent_sft_examples_mix_episodes_and_plain_answers():
    from areal_core.models import build_tokenizer
    from areal_core.proxy.examples import calculator_corpus
    from areal_core.train.sft import agent_sft_examples
    from task_data.arithmetic import generate

    train, _ = generate(1, 200, 5, ops="+-", lo=1, hi=9, max_steps=1)
    tok = build_tokenizer(calculator_corpus(train), 400)
    cfg = load_config(AGENT_CONFIG)
    examples = agent_sft_examples(cfg, tok, train)
    assert len(examples) == 200 and all(len(ids) == len(mask) for ids, mask in examples)
    episodes = [ids for ids, _ in examples if "<tool_call>" in tok.decode(ids)]
    assert 0.2 < len(episodes) / 200 < 0.4  # agent.sft_fraction = 0.3
    for _, mask in examples:  # loss only on the assistant's tokens, never on the prompt
        assert mask[0] == 0 and 0 < sum(mask) < len(mask)


def _run_agent_training(store: Path, extra: list[str]) -> tuple[float, float, str]:
    overrides = " ".join([f"store={store}", "launcher.progress=false", *extra])
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "pyflyte"),
            "run",
            "workflows/grpo.py",
            "grpo",
            "--config",
            AGENT_CONFIG,
            "--overrides",
            overrides,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    m = re.search(r"held-out agent success \(.*?\): before RL ([\d.]+), after RL ([\d.]+)", log)
    assert m, log[-3000:]
    return float(m.group(1)), float(m.group(2)), log


@pytest.mark.slow
def test_pyflyte_run_trains_the_calculator_agent_end_to_end(tmp_path):
    """`pyflyte run workflows/grpo.py grpo --config configs/agent_calculator.yaml` (shortened): SFT
    warm start in the agent's format, asynchronous RL with the agent workflow in the rollout worker on
    multi-turn episodes, held-out agent success before/after from the evaluate step."""
    from areal_core.protocol import decode_shard
    from areal_core.store import Store

    short = ["task.num_train=200", "sft.steps=60", "sft.lr=1e-2", "agent.sft_fraction=1.0", "train.steps=2"]
    short += ["eval.num_samples=10", "train.checkpoint_every=2"]  # the warm start must emit tool calls
    before, after, _ = _run_agent_training(tmp_path / "run", short)
    assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0
    store = Store(str(tmp_path / "run"))
    assert store.read_json("DONE")["step"] == 2
    rows = [s for p in store.find("trajectories/graded", ".arrow") for s in decode_shard(store.read_bytes(p))]
    assert len({s.group_id for s in rows}) >= 2 * 4 and all(s.worker_id == "rollout-0" for s in rows)
    assert all(s.reward_info["reward_source"] == "agent" for s in rows)  # kept by the reward worker
    assert store.statuses()["rollout-0"]["episodes"] >= 2 * 4 * 8
    tool_rows = [s for s in rows if s.meta.get("tool_calls")]
    assert tool_rows  # multi-turn episodes: model turns, then tool results the model did not produce
    for s in tool_rows:
        assert s.num_turns >= 2 and 0 in s.loss_mask[s.prompt_len :]
        assert all(v == -1 for v, m in zip(s.versions, s.loss_mask) if not m)
    trained = [store.read_json(p) for p in store.find("trainer/trained", ".json")]
    assert sum(len(t["samples"]) for t in trained) >= 2 * 4 * 2  # B groups per step, ≥ 2 rows a group
