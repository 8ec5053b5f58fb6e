"""Single-turn generation: `rollout.group_size` completions of one prompt in the chat template,
ungraded (the reward workers run the task's verifier). A prompt with images (`meta.image_ids`,
a vision-language run) is encoded by the model's processor and generated with its images; its
samples name them in `image_ids`. A record whose image is missing, altered or not an image id
(`bad_image`), or whose prompt the processor refuses (`bad_prompt`), raises `BadPrompt`: the
worker drops that group, counted, and goes on."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from areal_core.models import record_prompt
from areal_core.protocol import Sample
from areal_core.rollout.workflow import BadPrompt, RolloutWorkflow, WorkflowContext
from areal_core.vlm.images import ImageError
from areal_core.vlm.records import record_image_ids
from areal_core.vlm_processor import MMInputs, VisionProcessor

MM_CACHE = 64  # prompts whose pixel values are kept (a group's rows share one)


class SingleTurnWorkflow(RolloutWorkflow):
    def __init__(self, ctx: WorkflowContext):
        self.tokenizer = ctx.tokenizer
        self.images = ctx.images
        self.system = ctx.cfg.task.system_prompt
        self.prompt_format = ctx.cfg.task.prompt_format
        self.group_size = ctx.cfg.rollout.group_size
        self.params = ctx.sampling()
        self._prompt_ids: dict[str, list[int]] = {}
        self._mm: OrderedDict[str, MMInputs] = OrderedDict()

    def prompt_ids(self, task: dict[str, Any]) -> list[int]:
        return self.encode(task)[0]

    def encode(self, task: dict[str, Any]) -> tuple[list[int], MMInputs | None]:
        """The prompt's token ids (vision tokens included) and its images as model inputs (None: text)."""
        key, ids = task["prompt_id"], record_image_ids(task)
        if not ids:
            if key not in self._prompt_ids:
                self._prompt_ids[key] = record_prompt(self.tokenizer, task, self.system, self.prompt_format)
            return self._prompt_ids[key], None
        if not isinstance(self.tokenizer, VisionProcessor) or self.images is None:
            raise ValueError(f"prompt {key!r} has images but the policy is a text model (set model.kind=vlm)")
        if key in self._mm:
            self._mm.move_to_end(key)
            return self._prompt_ids[key], self._mm[key]
        try:
            images = self.images.load(ids)
        except ImageError as exc:  # checked against its id on every read: damaged or hand-made records
            raise BadPrompt("bad_image", f"prompt {key!r}: {exc}") from exc
        try:
            prompt, mm = self.tokenizer.encode(task["prompt"], images, self.system)
        except ValueError as exc:  # pad tokens typed in its text, an image the processor cannot size
            raise BadPrompt("bad_prompt", f"prompt {key!r}: {exc}") from exc
        self._prompt_ids[key], self._mm[key] = prompt, mm
        while len(self._mm) > MM_CACHE:
            self._mm.popitem(last=False)
        return prompt, mm

    async def arun_episode(self, engine: Any, task: dict[str, Any]) -> list[Sample]:
        prompt, mm = self.encode(task)
        if mm is None:
            gens = await engine.agenerate([prompt] * self.group_size, self.params)
        else:
            gens = await engine.agenerate([prompt] * self.group_size, self.params, mm=[mm] * self.group_size)
        n_p = len(prompt)
        image_ids = record_image_ids(task) or None
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
                image_ids=image_ids,
                routes=gen.routes,  # an MoE engine's expert choices over prompt and response (areal_core/routes.py)
            )
            for gen in gens
        ]
