"""The rollout engine interface: every backend generates token ids with behaviour
log-probs and per-token policy versions, receives weight versions from the store, and
reports health.

Two families implement it: in-process engines (`local_engine.LocalEngine`: torch, continuous)
stage a verified state dict and swap it between decode steps; remote engines
(`remote_engine.RemoteEngine`: vLLM, SGLang) stage the verified version on local disk and have
their server reload it between its own steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from areal_core.store import Store


MIN_TEMPERATURE = 1e-5  # below it sampling is greedy (as in vLLM)


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

    @property
    def is_greedy(self) -> bool:
        """Greedy when asked, or when the temperature is below MIN_TEMPERATURE: logits / τ for a
        τ that float32 cannot hold (1e-45 rounds to 0) would make every log-prob NaN."""
        return self.greedy or self.temperature < MIN_TEMPERATURE


@dataclass
class Generation:
    """One response: its tokens, their behaviour log-probs and the version that produced each.
    `routes`: an MoE engine's expert choices over prompt + response, [tokens, moe_layers, k]
    (areal_core/routes.py); None where the engine records none."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length"
    routes: Any = field(default=None, compare=False, kw_only=True)


class RolloutEngine(Protocol):
    version: int  # the policy version in use
    swaps: int  # weight versions installed since the engine started

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...

    def receive(self, store: Store, version: int) -> None:
        """Take weights/v{version} from the store (verified) if it is newer than `version`; it is
        in use from the next decode step on. Any thread. WeightsError if the version fails its
        checks (nothing changes)."""
        ...

    def load_version(self, version: int) -> None:
        """Bring the weights in use to `version` now (in-process engines: install what is staged)."""
        ...

    def health(self) -> dict: ...

    def close(self) -> None: ...
