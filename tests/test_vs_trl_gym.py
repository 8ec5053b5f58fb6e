"""benchmarks/vs_trl.py on reasoning-gym (issue 53): the one-shot records both sides are asked, and the TRL side's
reward, which runs in .venv-trl without the project, equal to our gym_reward on the same samples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.config import load_config
from task_data import load_task
from task_data.reasoning_gym import gym_reward

ROOT = Path(__file__).resolve().parents[1]
SIDE = ROOT / "benchmarks" / "vs_trl_side.py"
ONESHOT = ["task.name=reasoning_gym", "task.loader=task_data.reasoning_gym_oneshot:load"]


def records(gym: str, num_train: int = 40, num_eval: int = 8) -> tuple[list[dict], list[dict]]:
    cfg = load_config(None, [*ONESHOT, f"task.gym={gym}", f"task.num_train={num_train}", f"task.num_eval={num_eval}"])
    return load_task(cfg.task, cfg.seed)


def test_each_question_follows_one_solved_training_question_of_its_dataset():
    train, held = records("leg_counting,gcd", num_train=60)
    plain = {r["prompt"] for r in train}
    for r in train + held:
        demo_q, demo_a, asked = r["meta"]["chat"]
        assert (demo_q["role"], demo_a["role"], asked["role"]) == ("user", "assistant", "user")
        assert asked["content"] == r["prompt"]
        first = next(t for t in train if t["meta"]["reasoning_gym"]["dataset"] == r["meta"]["reasoning_gym"]["dataset"])
        assert (demo_q["content"], demo_a["content"]) == (first["prompt"], first["answer"])
        assert demo_a["content"].startswith("<answer>") and demo_a["content"].endswith("</answer>")
    assert not plain & {r["prompt"] for r in held}  # the demonstrations are training questions, never held-out ones


def _side_reward(samples: list[tuple[str | list, dict]]) -> list[float]:
    """The TRL side's reasoning_gym reward, loaded by path in an isolated interpreter (no project on sys.path);
    fails if it imported the project."""
    code = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('side', {str(SIDE)!r})\n"
        "side = importlib.util.module_from_spec(spec); spec.loader.exec_module(side)\n"
        "completions, rg = json.load(sys.stdin)\n"
        "out = side.trl_reward('reasoning_gym')(completions, rg)\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'areal_core'], 'the TRL side imported the project'\n"
        "print(json.dumps(out))\n"
    )
    data = [[c for c, _ in samples], [json.dumps(m["reasoning_gym"]) for _, m in samples]]
    out = subprocess.run(
        [sys.executable, "-I", "-c", code], input=json.dumps(data), capture_output=True, text=True, cwd="/", check=True
    )
    return json.loads(out.stdout)


@pytest.mark.parametrize("gym", ["leg_counting", "word_sorting", "arc_1d", "propositional_logic"])
def test_the_trl_side_reward_is_gym_reward(gym):
    _, held = records(gym, num_train=20, num_eval=3)
    samples = []
    for r in held:
        right = r["answer"]  # <answer>the entry's answer</answer>
        inner = right[len("<answer>") : -len("</answer>")]
        for text in (right, f"Thinking... {right}", f"<answer>{inner} or so</answer>", "<answer>x</answer>", "42"):
            samples.append((text, r["meta"]))
        samples.append(([{"role": "assistant", "content": right}], r["meta"]))  # TRL's conversational completion
    ours = [gym_reward(c if isinstance(c, str) else c[0]["content"], m)[0] for c, m in samples]
    assert _side_reward(samples) == ours
    assert max(ours) > 0  # something scored
