"""Preflight check of a user's reward function (`reward.function`, one or several with
`reward.weights`), registered with the model checks of run/preflight.py: each imports; its
signature is recognised (reward/signatures.py: ours, verl's compute_score, TRL's batched
reward_func) with every required parameter one the workers pass (ours, or a dataset column),
else one error naming what was found and what was expected; and called as the workers call it (a
RewardPool process, the run's timeout) on a few training records, with each record's own answer as
the completion, it returns finite rewards (a non-finite one is refused). A call that raises is
logged, not refused: raising is how some graders score a completion 0 (the code reward on text that
holds no program), except a TypeError on every call: the function cannot be called so, or returns
no number. The project's own functions (areal_core., task_data.) are tested by the suite and not
called here."""

from __future__ import annotations

import logging
from typing import Any

from areal_core.config import ConfigError
from areal_core.reward.pool import RewardPool, reward_function
from areal_core.reward.signatures import load_functions, reward_job
from areal_core.run.preflight import Preflight, preflight

log = logging.getLogger("areal.preflight")

REWARD_PROBES = 3
OWN = ("areal_core.", "task_data.")  # the shipped graders


@preflight("reward")
def check_reward(ctx: Preflight) -> None:
    cfg = ctx.cfg
    path = cfg.reward.function
    if not path or cfg.rollout.agent:  # the task's own verifier, or an agent's reward
        return
    columns = tuple(sorted({c for r in ctx.train[:REWARD_PROBES] for c in (r.get("meta") or {}).get("columns", {})}))
    spec = reward_function(cfg)
    functions = load_functions(spec, columns)
    ctx.notes["reward_signatures"] = ", ".join(f"{f.name}: {f.kind}" for f in functions)
    rows = ctx.train[:REWARD_PROBES]
    if not rows or all(f.path.startswith(OWN) for f in functions):
        return
    jobs = [reward_job(str(r.get("answer", "")), r, completion_ids=_ids(ctx.tokenizer, r)) for r in rows]
    with RewardPool(spec, size=1, timeout_s=cfg.reward.timeout_s, retries=0) as pool:
        results = pool.grade(jobs)
    errors = [str(r.info.get("error")) for r in results if r.info.get("failed")]
    nonfinite = [e for e in errors if "non-finite" in e]
    # a TypeError on every call: the function cannot be called as the workers call it, or returns
    # no number (None, a generator, an object): never a grader's way to score 0
    if errors and len(errors) == len(jobs) and all(e.startswith("TypeError") for e in errors):
        raise ConfigError(
            f"config key 'reward.function': {path} cannot be called the way the reward workers call it, or returns "
            f"no number, on any of {len(jobs)} training records: {errors[0][:300]}"
        )
    shape = [e for e in errors if "rewards for 1 completion" in e or "not a list of rewards" in e]
    if shape:
        raise ConfigError(
            f"config key 'reward.function': {path} must return one reward per completion (TRL's list in, list out), "
            f"on {len(shape)} of {len(jobs)} training records: {shape[0][:300]}"
        )
    if nonfinite:
        raise ConfigError(
            f"config key 'reward.function': {path} returned a non-finite reward on {len(nonfinite)} of {len(jobs)} "
            f"training records (each record's answer as the completion): {nonfinite[0][:300]}"
        )
    if errors:
        shown = errors[0][:200]
        n = len(jobs)
        log.warning("preflight reward: %s raised on %d of %d records (scored 0): %s", path, len(errors), n, shown)
    ctx.notes["reward"] = f"{path} on {len(jobs)} records: " + ", ".join(f"{r.reward:g}" for r in results)


def _ids(tokenizer: Any, record: dict[str, Any]) -> list[int]:
    """The probe completion's token ids (TRL's `completion_ids`): the answer tokenized when the
    checkpoint's tokenizer is loaded, else none."""
    if tokenizer is None:
        return []
    return list(tokenizer(str(record.get("answer", "")), add_special_tokens=False)["input_ids"])
