"""reasoning-gym (0.1.25, open-thought/reasoning-gym) as a task family: `task.name=reasoning_gym`, the datasets
named in `task.gym`, each with its weight and config, mixed as reasoning-gym's own CompositeDataset mixes them.

The prompt and the answer follow reasoning-gym's convention:
- the question is the entry's `question` as the user message; the system prompt is the run's task.system_prompt,
  which the config sets to reasoning_gym.utils.SYSTEM_PROMPTS["default"] when empty
  (areal_core.config.task.REASONING_GYM_SYSTEM_PROMPT); it asks for the final answer in `<answer>...</answer>`;
- the answer graded is `reasoning_gym.utils.extract_answer(completion)`: the text of the LAST `<answer>...</answer>`
  (non-greedy, across lines, stripped); None when there is none, which the datasets score 0
  (countdown, fraction_simplification and puzzle24: 0.01);
- the reward is the dataset's own `score_answer(answer, entry)` (in [0, 1]; some give partial credit).

Seeds. Item `idx` of a dataset seeded `s` is generated from `Random(s + idx)` (nearly every dataset; acre draws all
its items from one `Random(s)`), and the composite seeds its i-th
dataset `seed + i + 1`. The training split is the composite seeded by the run's seed, the held-out split the one
seeded `seed + EVAL_SEED_OFFSET` (2**30, above any task.num_train), so the two never draw from the same generator.
Small question spaces can still repeat a question by chance: a held-out question equal to a training one (or to an
earlier held-out one) is skipped, so no held-out question was trained on.

The record. `prompt` is the question, `answer` the SFT demonstration in the form the reward pays for,
`<answer>{entry answer}</answer>`, and `meta["reasoning_gym"]` holds what score_answer needs: the dataset's name,
its config, the seed it was built with, the item's index and the whole entry (question, answer, metadata), stored
rather than regenerated in the reward worker, because:
- regeneration is not reproducible across processes for every dataset: polynomial_multiplication's questions
  depend on Python's per-process string hashing (PYTHONHASHSEED), and the reward workers are other processes;
- the entry is what the sample was asked: the run's prompts/ hold it, and the reward workers and a re-grade
  (areal_core/reward/regrade.py) pass each sample its record's meta (reward/signatures.py `reward_job`).
Entries hold tuples (arc_agi's grids, whose scorer compares them as tuples: a JSON list scores 0.05 where the tuple
scores 1), int-keyed dicts (graph_color, codeio) and numpy scalars, so the entry is stored in a lossless JSON form
(`encode` / `decode`: tuples, sets, non-string keys and non-finite floats tagged), strict JSON either way.

A dataset whose entries give no answer has its demonstration from an example answer in its metadata
(propositional_logic, rubiks_cube, graph_color; propositional_logic's own scorer pays some of its examples less
than 1); one with neither (boxnet, rush_hour: scored by simulation) is refused at prepare.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
from typing import Any

from areal_core.config import ConfigError
from task_data.gym_entries import decode, encode  # stdlib only: vs_trl.py's TRL side loads it by path

log = logging.getLogger("areal.task_data")

EVAL_SEED_OFFSET = 1 << 30  # the held-out composite's seed, past the training one's generators
EXAMPLE_ANSWER_KEYS = ("example_answer", "example_correct_answer", "possible_answer")
RESERVED = ("seed", "size")  # set by the run (its seed, task.num_train / num_eval), never by task.gym


def _registry() -> dict[str, tuple[type, type]]:
    from reasoning_gym.factory import DATASETS

    return {name: classes for name, classes in DATASETS.items() if name != "composite"}


def check_specs(gym: list[Any]) -> list[Any]:
    """task.gym (areal_core.config.task.GymDatasetSpec list) as reasoning_gym.composite.DatasetSpec list, each
    name a registered dataset and each config one its config dataclass accepts (its own validate() included);
    otherwise ConfigError, one line naming task.gym."""
    from reasoning_gym.composite import DatasetSpec

    registry = _registry()
    out = []
    for i, spec in enumerate(gym):
        if spec.name not in registry:
            near = difflib.get_close_matches(spec.name, registry, n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else f" ({len(registry)} datasets, e.g. leg_counting)"
            raise ConfigError(f"config key 'task.gym.{i}.name': {spec.name!r} is not a reasoning-gym dataset{hint}")
        config_cls = registry[spec.name][1]
        fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in RESERVED]
        for key in spec.config:
            if key in RESERVED:
                raise ConfigError(
                    f"config key 'task.gym.{i}.config.{key}': the run sets {key} (its seed; task.num_train, "
                    "task.num_eval), so that training and held-out questions come from disjoint seeds"
                )
            if key not in fields:
                raise ConfigError(
                    f"config key 'task.gym.{i}.config.{key}' is not a setting of {spec.name} "
                    f"({config_cls.__name__}: {', '.join(fields)})"
                )
        try:
            config = config_cls(**spec.config, seed=0, size=1)
            if hasattr(config, "validate"):
                config.validate()
        except Exception as exc:  # the dataclass's own checks are asserts, TypeErrors and ValueErrors
            text = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise ConfigError(f"config key 'task.gym.{i}.config': {spec.name} refuses it: {text}") from None
        out.append(DatasetSpec(name=spec.name, weight=float(spec.weight), config=dict(spec.config)))
    return out


def composite(specs: list[Any], seed: int, size: int) -> Any:
    """reasoning-gym's CompositeDataset of `specs` (DatasetSpec), seeded `seed`, `size` items."""
    from reasoning_gym.composite import CompositeConfig, CompositeDataset

    return CompositeDataset(CompositeConfig(size=size, seed=seed, datasets=[dataclasses.replace(s) for s in specs]))


def _demonstration(entry: dict[str, Any]) -> str | None:
    """The final answer a demonstration gives: the entry's answer, else the example answer in its metadata
    (propositional_logic, rubiks_cube: `example_answer`, `example_correct_answer`; graph_color's `possible_answer` as
    the JSON map its question asks for); None when there is neither."""
    if isinstance(entry.get("answer"), str) and entry["answer"].strip():
        return entry["answer"]
    for key in EXAMPLE_ANSWER_KEYS:
        value = entry["metadata"].get(key)
        text = value if isinstance(value, str) or value is None else json.dumps(value, default=str)
        if text and text.strip():
            return text
    return None


def record(comp: Any, idx: int, split: str, n: int, configs: dict[str, dict]) -> dict[str, Any]:
    """Item `idx` of the composite `comp` as the `n`-th prompt record of `split`."""
    entry = comp[idx]
    name = entry["metadata"]["source_dataset"]
    dataset = comp.datasets[name]
    demo = _demonstration(entry)
    if demo is None:
        raise ConfigError(
            f"config key 'task.gym': {name} gives no answer to its questions (it is scored by simulation), so no "
            "demonstration or reference can be made; reasoning_gym supports the datasets that do"
        )
    try:
        stored = encode(entry)
        json.dumps(stored, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config key 'task.gym': {name}: {exc}") from None
    meta = {"dataset": name, "config": configs[name], "seed": dataset.seed, "index": idx, "entry": stored}
    return {
        "prompt_id": f"reasoning_gym-{split}-{n}",
        "prompt": entry["question"],
        "answer": f"<answer>{demo}</answer>",
        "meta": {"reasoning_gym": meta},
    }


def load(task: Any, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) records of task.gym (`task`: areal_core.config.TaskConfig): task.num_train questions of the
    composite seeded `seed`, task.num_eval of the one seeded `seed + EVAL_SEED_OFFSET` that are not training ones."""
    specs = check_specs(task.gym)
    configs = {s.name: s.config for s in specs}
    comp = composite(specs, seed, task.num_train)
    train = [record(comp, i, "train", i, configs) for i in range(task.num_train)]
    seen = {r["prompt"] for r in train}
    tries = 4 * task.num_eval + 64
    comp = composite(specs, seed + EVAL_SEED_OFFSET, tries)
    held: list[dict[str, Any]] = []
    for idx in range(tries):
        if len(held) == task.num_eval:
            break
        question = comp[idx]["question"]
        if question not in seen:
            seen.add(question)
            held.append(record(comp, idx, "test", len(held), configs))
    if not held:
        raise ConfigError(
            f"config key 'task.gym': every held-out question of {tries} drawn is a training one: the datasets' "
            "configs allow too few questions for task.num_train"
        )
    if len(held) < task.num_eval:
        log.warning("reasoning_gym: %d held-out questions apart from the training ones, of %d asked", len(held), tries)
    return train, held


@functools.lru_cache(maxsize=64)
def _scorer(name: str, config_json: str, seed: int) -> Any:
    """The dataset whose score_answer grades an entry of `name` (built once per process; its size does not enter
    any dataset's scoring, so it is 1: some datasets build every item up front)."""
    from reasoning_gym.factory import create_dataset

    return create_dataset(name, **json.loads(config_json), seed=seed, size=1)


def gym_reward(completion: str, meta: dict[str, Any] | None = None, **_: Any) -> tuple[float, dict[str, Any]]:
    """The reward of a task.name=reasoning_gym sample: its dataset's `score_answer(extract_answer(completion),
    entry)` (reasoning_gym.utils.extract_answer: the last <answer>...</answer>, None when there is none), with the
    entry and dataset from the record's `meta["reasoning_gym"]`. A scorer that raises on the answer (e.g.
    prime_factorization on a non-number) scores 0, its reason in the info's `score_error`.

    Info: the dataset's name and the answer extracted (its first 200 characters; None when there was none)."""
    from reasoning_gym.utils import extract_answer

    spec = (meta or {}).get("reasoning_gym")
    if not isinstance(spec, dict) or "entry" not in spec:
        raise ValueError("gym_reward grades task.name=reasoning_gym samples: this one's meta has no 'reasoning_gym'")
    entry = decode(spec["entry"])
    dataset = _scorer(spec["dataset"], json.dumps(spec["config"], sort_keys=True), int(spec["seed"]))
    answer = extract_answer(completion)
    info: dict[str, Any] = {"dataset": spec["dataset"], "extracted": None if answer is None else answer[:200]}
    try:
        score = float(dataset.score_answer(answer, entry))
    except Exception as exc:
        score, info["score_error"] = 0.0, f"{type(exc).__name__}: {exc}"[:200]
    return score, info
