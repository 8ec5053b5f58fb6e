"""What a rollout worker runs per group: a `RolloutWorkflow` (AReaL's `arun_episode`).

    class MyWorkflow(RolloutWorkflow):
        def __init__(self, ctx: WorkflowContext): ...
        async def arun_episode(self, engine, task: dict) -> list[Sample]: ...

The worker builds the engine once (`rollout.engine`: torch, continuous, vllm, sglang) and
hands it to every episode as an `AsyncEngine` (`await engine.agenerate(prompts, params)`,
`await engine.generate(prompt_ids, params)`, `engine.version`); `task` is one prompt record
(prompt_id, prompt, answer, meta; `meta.image_ids`: its stored images, read with `ctx.images`
and passed as `agenerate(..., mm=[MMInputs])`). An episode returns one group: the samples that
share an advantage baseline. The worker names them (group_id, sample_id, worker_id), writes them as an
ungraded shard, and the reward workers grade every sample whose `reward` is None; a sample
the workflow already rewarded keeps its reward (`reward_info["reward_source"]` says who set it).

A prompt record the workflow cannot run (its image missing or altered, a prompt its processor
refuses) raises `BadPrompt`: the worker drops that group with the named outcome counted, gives
its admission back and goes on with the next prompt, so one bad record never stops the run nor
crash-loops a restarted worker on it.

Which workflow (`workflow_path`): `rollout.workflow` ("pkg.module:Name", a callable taking the
WorkflowContext, usually the class itself); empty: the agent workflow when `rollout.agent` is
set, else single-turn generation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from areal_core.config.hooks import import_object
from areal_core.protocol import Sample
from areal_core.rollout.engine import SamplingParams

SINGLE_TURN = "areal_core.rollout.single_turn:SingleTurnWorkflow"
AGENT = "areal_core.proxy.agent_workflow:from_context"


class BadPrompt(ValueError):
    """The record is bad input, not an engine failure: its group is dropped and counted as
    `reason` (a `drop` event, the heartbeat's `dropped_groups`); the message names the prompt."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class WorkflowContext:
    """What a workflow is built from: the run's config, the policy's tokenizer, the worker."""

    cfg: Any  # RunConfig
    tokenizer: Any  # a VLM's VisionProcessor (it answers as its tokenizer)
    worker_id: str = "rollout-0"
    worker_index: int = 0
    images: Any = None  # vlm.images.ImageCache over the run's image roots: a record's meta.image_ids

    def sampling(self) -> SamplingParams:
        """The behaviour policy's sampling settings (rollout.max_new_tokens, temperature, top_p, top_k)."""
        ro = self.cfg.rollout
        return SamplingParams(
            max_new_tokens=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k
        )


class RolloutWorkflow(ABC):
    """One group per call; implementations: single-turn, an agent through the proxy, a user's own."""

    max_concurrent_groups: int | None = None  # groups in flight at once; None: rollout.max_batch_groups

    @abstractmethod
    async def arun_episode(self, engine: Any, task: dict[str, Any]) -> list[Sample]:
        """Run one group on `task` with `engine`; an empty list drops the group."""

    def stats(self) -> dict[str, Any]:
        """Counters for the worker's heartbeat."""
        return {}

    def close(self) -> None:
        """Release what the workflow started (a proxy server, threads)."""
        return None


def workflow_path(cfg: Any) -> str:
    """The import path of the run's workflow."""
    if cfg.rollout.workflow:
        return cfg.rollout.workflow
    return AGENT if cfg.rollout.agent else SINGLE_TURN


def load_workflow(ctx: WorkflowContext) -> RolloutWorkflow:
    """The run's workflow, built from `ctx` (loaded by import path, so rollout/ imports no proxy/)."""
    path = workflow_path(ctx.cfg)
    workflow = import_object(path, key="rollout.workflow")(ctx)
    if not isinstance(workflow, RolloutWorkflow):
        raise TypeError(f"rollout.workflow {path!r} built a {type(workflow).__name__}, not a RolloutWorkflow")
    return workflow
