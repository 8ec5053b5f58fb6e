"""Reward functions in the signatures users already have, detected once and adapted to one call.

A reward spec (`reward.function`, `reward.weights`; `reward_spec` below) names one function or
several, `"pkg.mod:f,pkg.mod:g"`, with weights (TRL's `reward_funcs` / `reward_weights`). Each
function's signature is recognised by its parameter names:

    areal   f(completion, reference, prompt, prompt_id, meta, <column>..., **kw) -> float | (float, info) | dict
    verl    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | {"score", ...}
    trl     reward_func(prompts, completions, completion_ids, **columns) -> list[float | None]   (batched)

A grading job (reward/worker.py `grade_samples`) holds `completion`, `completion_ids` (its token
ids), `reference`, `prompt`, `prompt_id`, `meta` and `columns` (the record's other dataset
columns, `meta.columns`), each column also passed by its own name where no argument of ours has
that name. verl gets `ground_truth` as the dataset holds it (a struct stays a dict: the record's
`meta.reference`, else the reference text) and `extra_info` ({} when the row has none), as verl's
reward manager passes them. TRL gets `prompts`, `completions`, `completion_ids` and each column
as lists of one: conversational (a list of messages, the completion as one assistant message) when
the record's prompt is a chat (`meta.chat`), else plain strings; and `log_metric(name, value)` /
`log_extra(column, values)`, whose values go into the result's info as `<function>/<name>`. TRL's
`trainer_state` is not passed (a reward process knows no trainer): a function requiring it is
refused at prepare.

Several functions: reward = Σ wᵢ·rᵢ over the functions that returned a number; TRL's None means
"not applicable to this sample" (TRL's nansum). When every function returns None the sample is
skipped: reward 0, `info["skipped"]`, and the trainer drops it, counted (never trained on). Each
function's own value is kept in `info["rewards"][name]` (logged apart).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from areal_core.config.base import ConfigError
from areal_core.config.hooks import import_object

REWARD_ARGUMENTS = ("completion", "reference", "prompt", "prompt_id", "meta")  # what every caller passes
JOB_ONLY = ("columns", "completion_ids", "ground_truth")  # job keys that are no argument of ours
TRL_MARKS = {"completions", "completion_ids"}  # parameter names only TRL's batched signature has
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "log_metric", "log_extra")  # what a TRL call gets
EXPECTED = (
    "areal: f(completion, reference, prompt, prompt_id, meta, **columns); "
    "verl: compute_score(data_source, solution_str, ground_truth, extra_info=None); "
    "trl: reward_func(prompts, completions, **columns) -> list"
)


class RewardSkipped(Exception):
    """Every reward function returned None for the sample (TRL's convention): it is not trained on."""


def _params(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def _required(params: dict[str, inspect.Parameter]) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [n for n, p in params.items() if p.default is inspect.Parameter.empty and p.kind in kinds]


def signature_kind(fn: Callable[..., Any], path: str, columns: tuple[str, ...] | None = None) -> str:
    """ "areal", "verl" or "trl" by `fn`'s parameter names. With the dataset's `columns` known
    (prepare), a ConfigError naming what was found and what is expected when it fits none (a
    required parameter no caller passes, a positional-only one)."""
    params = _params(fn)
    names = set(params)
    if names & TRL_MARKS:  # TRL's docs have `reward_func(completion_ids, **kwargs)`, without completions
        kind = "trl"
        known = {*TRL_ARGUMENTS, *(columns or ())}
    elif {"solution_str", "ground_truth"} <= names:
        kind = "verl"
        known = {"data_source", "solution_str", "ground_truth", "extra_info"}
    else:
        kind = "areal"
        known = {*REWARD_ARGUMENTS, *(columns or ())}
    if columns is None:
        return kind
    unknown = [n for n in _required(params) if n not in known]
    positional_only = [n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    if unknown or positional_only:
        try:
            found = str(inspect.signature(fn))
        except (TypeError, ValueError):
            found = "(no readable signature)"
        why = (
            f"requires {unknown}, which no caller passes"
            if unknown
            else f"takes {positional_only} positionally only, but rewards are called with keyword arguments"
        )
        raise ConfigError(
            f"config key 'reward.function': {path}{found} {why} (read as the {kind} signature; dataset columns: "
            f"{list(columns)[:12]}); expected one of: {EXPECTED} (docs/reward.md)"
        )
    return kind


def _accepted(params: dict[str, inspect.Parameter], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Only the keyword arguments the function declares (all of them if it takes **kwargs)."""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _resolve(out: Any) -> Any:
    if inspect.isawaitable(out):
        return asyncio.run(_await(out))
    return out


async def _await(awaitable: Any) -> Any:
    return await awaitable


@dataclass
class RewardFunction:
    """One user function, its detected signature and weight; `__call__(job)` -> its raw value."""

    name: str
    path: str
    fn: Callable[..., Any]
    kind: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        self.params = _params(self.fn)
        self.logged: dict[str, Any] = {}  # what the last TRL call gave log_metric / log_extra

    def __call__(self, job: dict[str, Any]) -> Any:
        columns = dict(job.get("columns") or {})
        meta = job.get("meta") or {}
        self.logged = {}
        if self.kind == "verl":
            kwargs = {
                "data_source": columns.get("data_source"),
                "solution_str": job["completion"],
                "ground_truth": job.get("ground_truth", job["reference"]),
                "extra_info": columns.get("extra_info") or {},  # verl's reward manager: {} when the row has none
            }
            return verl_value(_resolve(self.fn(**_accepted(self.params, kwargs))), self.name)
        if self.kind == "trl":
            chat = meta.get("chat") if isinstance(meta.get("chat"), list) else None
            kwargs = {
                **{k: [v] for k, v in columns.items()},  # TRL passes each column as the batch's list
                "prompts": [chat if chat else job["prompt"]],
                "completions": [[{"role": "assistant", "content": job["completion"]}] if chat else job["completion"]],
                "completion_ids": [list(job.get("completion_ids") or [])],
                "log_metric": self._log_metric,
                "log_extra": self._log_extra,
            }
            return trl_value(_resolve(self.fn(**_accepted(self.params, kwargs))), self.name)
        # ours: every key of the job (a caller's token_offsets, prompt_len too) over the columns
        kwargs = {**columns, **{k: v for k, v in job.items() if k not in JOB_ONLY}}
        return _resolve(self.fn(**_accepted(self.params, kwargs)))

    def _log_metric(self, name: str, value: Any) -> None:
        self.logged[f"{self.name}/{name}"] = _json_value(value)

    def _log_extra(self, column: str, values: Any) -> None:
        values = list(values)
        self.logged[f"{self.name}/{column}"] = _json_value(values[0] if len(values) == 1 else values)


def _json_value(value: Any) -> Any:
    """`value` as JSON (it is stored in the sample's reward_info): a non-finite number is null."""
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict)):
        try:
            value = value.item()  # a numpy or torch scalar
        except (TypeError, ValueError):
            pass
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return json.loads(json.dumps(value, default=str))


def reward_job(
    completion: str, record: dict[str, Any] | None, sample: Any = None, completion_ids: list[int] | None = None
) -> dict[str, Any]:
    """The keyword arguments of one grading call: the completion and its token ids (`completion_ids`,
    else the sample's response ids, else none known: []), its prompt record's reference (and as the
    dataset holds it, verl's `ground_truth`: the record's `meta.reference`, never a sample's),
    prompt text and meta (the sample's own meta over it: an agent's), and the dataset's other
    columns (`meta.columns`, the sample's copy first; one that is not a dict is ignored)."""
    record = record or {}
    own = record.get("meta") if isinstance(record.get("meta"), dict) else {}
    theirs = getattr(sample, "meta", None)
    theirs = theirs if isinstance(theirs, dict) else {}  # an online client's session meta is anything
    meta = {**own, **theirs}
    columns = next((m["columns"] for m in (theirs, own) if isinstance(m.get("columns"), dict)), {})
    if completion_ids is None and sample is not None and hasattr(sample, "response_ids"):
        completion_ids = sample.response_ids()
    return {
        "completion": completion,
        "completion_ids": [] if completion_ids is None else [int(i) for i in completion_ids],
        "reference": record.get("answer", ""),
        "ground_truth": own["reference"] if "reference" in own else record.get("answer", ""),  # the record's own
        "prompt": record.get("prompt", ""),
        "prompt_id": getattr(sample, "prompt_id", None) or record.get("prompt_id", ""),
        "meta": meta,
        "columns": dict(columns),
    }


def verl_value(out: Any, name: str = "compute_score") -> Any:
    """verl's compute_score returns a number, or a dict whose "score" is the reward (the rest: info).
    A dict without "score" is a TypeError (verl's reward manager fails on it too): prepare refuses it."""
    if isinstance(out, dict):
        if "score" not in out:
            raise TypeError(f"verl reward function {name} returned a dict without 'score' (keys {sorted(out)[:8]})")
        info = {k: v for k, v in out.items() if k != "score" and isinstance(v, (int, float, str, bool))}
        return {"reward": out["score"], "info": info}
    return out


def trl_value(out: Any, name: str) -> float | None:
    """The one value of a TRL reward function's list (or array, tensor) for one completion; None:
    not applicable."""
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__getitem__"):
        raise TypeError(f"TRL reward function {name} returned a {type(out).__name__}, not a list of rewards")
    if len(out) != 1:
        raise ValueError(f"TRL reward function {name} returned {len(out)} rewards for 1 completion")
    value = out[0]
    if value is None:
        return None
    if isinstance(value, (str, bytes)):  # TRL's torch.tensor refuses it too: never parsed as a number
        raise TypeError(f"TRL reward function {name} returned a {type(value).__name__} reward {value!r:.40}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        value = float(value)  # a numpy or torch scalar
    return float(value)


def parse_spec(spec: str) -> list[tuple[str, float]]:
    """`"a:f"` -> [("a:f", 1.0)]; `"a:f@1,b:g@0.5"` -> both with their weights."""
    out = []
    for part in [p.strip() for p in str(spec).split(",") if p.strip()]:
        path, _, weight = part.partition("@")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ConfigError(f"config key 'reward.weights': {weight!r} is not a number") from None
        out.append((path.strip(), w))
    if not out:
        raise ConfigError("config key 'reward.function' names no function")
    return out


def reward_spec(cfg: Any, default: str) -> str:
    """The spec of a run's reward: reward.function (one or several, comma-separated) with
    reward.weights, else `default` (the task's own verifier)."""
    paths = [p.strip() for p in (cfg.reward.function or default).split(",") if p.strip()]
    weights = list(cfg.reward.weights) or [1.0] * len(paths)
    if len(weights) != len(paths):
        raise ConfigError(f"config key 'reward.weights' has {len(weights)} weights for {len(paths)} reward functions")
    if len(paths) == 1 and weights[0] == 1.0:
        return paths[0]
    return ",".join(f"{p}@{float(w)!r}" for p, w in zip(paths, weights))  # repr: the weight exactly


def load_functions(spec: str, columns: tuple[str, ...] | None = None) -> list[RewardFunction]:
    """Each function of `spec`, imported and its signature recognised (checked against the
    dataset's `columns` when given: a ConfigError otherwise)."""
    out: list[RewardFunction] = []
    for path, weight in parse_spec(spec):
        fn = import_object(path, key="reward.function")
        base = name = getattr(fn, "__name__", None) or type(fn).__name__
        while any(f.name == name for f in out):  # each function's value is kept and logged under its name
            name = f"{base}_{len(out)}" if name == base else f"{name}_"
        if not math.isfinite(weight):
            raise ConfigError(f"config key 'reward.weights': {weight} for {path} is not finite")
        out.append(RewardFunction(name, path, fn, signature_kind(fn, path, columns), weight))
    return out


def per_function_means(infos: list[dict[str, Any] | None]) -> dict[str, float]:
    """`reward/<name>`: the mean of each reward function's own value over the samples it scored
    (several functions, or an environment's weighted rubric, each logged apart)."""
    sums: dict[str, list[float]] = {}
    for info in infos:
        for name, value in ((info or {}).get("rewards") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                sums.setdefault(str(name)[:64], []).append(float(value))
    return {f"reward/{name}": sum(v) / len(v) for name, v in sums.items()}
