"""benchmarks/vs_trl.py on reasoning-gym (issue 53): the one-shot records both sides are asked, and the TRL side's
reward, which runs in .venv-trl without the project, equal to ours on the same samples (gym_reward; the default job's
gsm8k_reward)."""

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


# what the TRL side may load of the project: these files, and their folders as bare packages (no __init__ runs)
SIDE_FILES = {
    "areal_core/reward/math.py",
    "areal_core/reward/latex.py",
    "areal_core/reward/math_expr.py",
    "task_data/gym_entries.py",
}


def _side_reward(kind: str, completions: list, column: list[str]) -> list[float]:
    """The TRL side's reward `kind`, loaded by path in an isolated interpreter (the project not on sys.path, as in
    .venv-trl); fails if it ran a package's __init__ or loaded another file of the project."""
    code = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('side', {str(SIDE)!r})\n"
        "side = importlib.util.module_from_spec(spec); spec.loader.exec_module(side)\n"
        "completions, column = json.load(sys.stdin)\n"
        "reward = side.trl_reward(sys.argv[1])\n"
        "out = reward(completions, column) if sys.argv[1] == 'reasoning_gym' else reward(completions, answer=column)\n"
        "files = {m: getattr(mod, '__file__', None) for m, mod in sys.modules.items()\n"
        "         if m.split('.')[0] in ('areal_core', 'task_data')}\n"
        "print(json.dumps([out, files]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code, kind],
        input=json.dumps([completions, column]),
        capture_output=True,
        text=True,
        cwd="/",
        check=True,
    )
    rewards, files = json.loads(out.stdout)
    loaded = {str(Path(f).relative_to(ROOT)) for f in files.values() if f}
    assert loaded <= SIDE_FILES, f"the TRL side loaded {sorted(loaded - SIDE_FILES)} of the project"
    return rewards


def test_the_trl_side_reward_of_the_default_job_is_gsm8k_reward():
    from areal_core.reward.math import gsm8k_reward

    samples = [("So 3 + 4 = 7.\n#### 7", "7"), ("#### 8", "7"), ("no answer", "7"), ("#### 1,200", "1200")]
    completions = [c for c, _ in samples[:-1]] + [[{"role": "assistant", "content": samples[-1][0]}]]
    rewards = _side_reward("gsm8k", completions, [a for _, a in samples])
    assert rewards == [gsm8k_reward(c, a) for c, a in samples]
    assert rewards[0] == 1.0


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
    assert (
        _side_reward("reasoning_gym", [c for c, _ in samples], [json.dumps(m["reasoning_gym"]) for _, m in samples])
        == ours
    )
    assert max(ours) > 0  # something scored
