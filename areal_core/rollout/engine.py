"""The rollout engine interface: every backend generates token ids with behaviour
log-probs and per-token policy versions, loads weight versions, and reports health."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class SamplingParams:
    max_new_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    greedy: bool = False
    stop: list[str] = field(default_factory=list)  # stop strings (engines given a tokenizer)
    seed: int | None = None  # per-request sampling seed (engines that support it)


@dataclass
class Generation:
    """One response: its tokens, their behaviour log-probs and the version that produced each."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length"


class RolloutEngine(Protocol):
    version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...

    def load_version(self, version: int) -> None: ...

    def health(self) -> dict: ...
