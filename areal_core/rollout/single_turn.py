"""Single-turn generation: `rollout.group_size` completions of one prompt in the chat template,
ungraded (the reward workers run the task's verifier)."""

from __future__ import annotations

from typing import Any

from areal_core.models import chat_prompt
from areal_core.protocol import Sample
from areal_core.rollout.workflow import RolloutWorkflow, WorkflowContext


class SingleTurnWorkflow(RolloutWorkflow):
    def __init__(self, ctx: WorkflowContext):
        self.tokenizer = ctx.tokenizer
        self.system = ctx.cfg.task.system_prompt
        self.group_size = ctx.cfg.rollout.group_size
        self.params = ctx.sampling()
        self._prompt_ids: dict[str, list[int]] = {}

    def prompt_ids(self, task: dict[str, Any]) -> list[int]:
        key = task["prompt_id"]
        if key not in self._prompt_ids:
            self._prompt_ids[key] = chat_prompt(self.tokenizer, task["prompt"], self.system)
        return self._prompt_ids[key]

    async def arun_episode(self, engine: Any, task: dict[str, Any]) -> list[Sample]:
        prompt = self.prompt_ids(task)
        gens = await engine.agenerate([prompt] * self.group_size, self.params)
        n_p = len(prompt)
        return [
            Sample(
                sample_id="",
                group_id="",
                prompt_id=task["prompt_id"],
                worker_id="",
                input_ids=prompt + gen.token_ids,
                prompt_len=n_p,
                loss_mask=[0] * n_p + [1] * len(gen.token_ids),
                behav_logprobs=[0.0] * n_p + list(gen.logprobs),
                versions=[-1] * n_p + list(gen.versions),
                finish_reason=gen.finish_reason,
            )
            for gen in gens
        ]
