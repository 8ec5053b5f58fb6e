"""The tiny run: config overrides for a run small enough for a test or a CPU benchmark to finish
in seconds (a 1-layer model, a few hundred arithmetic prompts). The tests (tests/conftest.py) and
the benchmarks (benchmarks/replay.py) take it from here; benchmarks import no tests."""

from __future__ import annotations

# the tiny policy alone: one layer, 32 wide (the online tests, the proxy tests and the fault benchmark)
MODEL = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=64",
]

TINY = [
    "task.num_train=400",
    "task.num_eval=40",
    "task.min_value=1",
    "task.max_value=9",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=64",
    "model.vocab_size=300",
    "sft.steps=3",
    "sft.batch_size=8",
    "rollout.group_size=4",
    "rollout.max_batch_groups=2",
    "rollout.max_new_tokens=8",
    "train.batch_groups=2",
    "train.steps=4",
    "train.checkpoint_every=2",
    "eval.num_samples=20",
    "eval.max_new_tokens=8",
    "tracking.enabled=false",
    "launcher.progress=false",
    "launcher.timeout_s=300",
    # a reward call of these runs takes milliseconds; the default 5 s (a freshly forked grader
    # included) only has to fire on a hang, and must not on a loaded CI machine (issue 46)
    "reward.timeout_s=60",
]
