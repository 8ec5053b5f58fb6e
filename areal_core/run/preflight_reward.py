"""Preflight check of a user's reward function (`reward.function`), registered with the model
checks of run/preflight.py: it imports; its required parameters are ones the reward workers
pass (docs/reward.md); and called as the workers call it (a RewardPool process, the run's
timeout) on a few training records, with each record's own answer as the completion, it
returns finite rewards (a non-finite one is refused). A call that raises is logged, not refused:
raising is how some graders score a completion 0 (the code reward on text that holds no program),
except a TypeError on every call: the function cannot be called so, or returns no number.
The project's own functions (areal_core., task_data.) are tested by the suite and not called here."""

from __future__ import annotations

import inspect
import logging

from areal_core.config import ConfigError
from areal_core.config.hooks import import_object
from areal_core.run.preflight import Preflight, preflight

log = logging.getLogger("areal.preflight")

# the keyword arguments every caller passes (reward workers, evaluation, re-grading: docs/reward.md)
REWARD_ARGUMENTS = ("completion", "reference", "prompt", "prompt_id", "meta")
REWARD_PROBES = 3
OWN = ("areal_core.", "task_data.")  # the shipped graders


@preflight("reward")
def check_reward(ctx: Preflight) -> None:
    cfg = ctx.cfg
    path = cfg.reward.function
    if not path or cfg.rollout.agent:  # the task's own verifier, or an agent's reward
        return
    fn = import_object(path, key="reward.function")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        params = []
    required = [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    unknown = [n for n in required if n not in REWARD_ARGUMENTS]
    positional_only = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    if unknown or positional_only:
        raise ConfigError(
            f"config key 'reward.function': {path} requires {unknown or positional_only}, which the reward workers "
            f"never pass; it is called with keyword arguments named from {list(REWARD_ARGUMENTS)} "
            "(declare the ones it needs, or **kwargs; docs/reward.md)"
        )
    rows = ctx.train[:REWARD_PROBES]
    if not rows or path.startswith(OWN):
        return
    from areal_core.reward.pool import RewardPool

    jobs = [
        {
            "completion": str(r.get("answer", "")),
            "reference": r.get("answer", ""),
            "prompt": r.get("prompt", ""),
            "prompt_id": r.get("prompt_id", ""),
            "meta": r.get("meta", {}),
        }
        for r in rows
    ]
    with RewardPool(path, size=1, timeout_s=cfg.reward.timeout_s, retries=0) as pool:
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
