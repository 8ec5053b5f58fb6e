"""A segment of a session: one growing token sequence, the turns served in it, and the trajectory
row it becomes when the session ends: each turn's discounted return, then one `Sample` (what was
fed and served, its rewards, where each turn lies in it, and the ids of its images)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from areal_core.protocol import Sample
from areal_core.rollout.engine import Generation


@dataclass
class TurnRecord:
    """One served turn: where it lies in its segment's tokens, and its reward once given."""

    turn: int  # index in the session, in the order turns finished
    completion_id: str
    segment: int
    fed_start: int  # first token this turn fed (close of the previous turn, new messages, generation prompt)
    response_start: int  # first served token
    response_end: int  # one past the last served token
    finish_reason: str
    tool_calls: int = 0
    reward: float | None = None


@dataclass
class Segment:
    """One growing token sequence of a session (proxy/sessions.py): non-policy tokens with mask 0
    and version -1, served tokens with mask 1, their behaviour log-probs and versions."""

    index: int
    kind: str  # "chat" | "text"
    fingerprints: list[tuple] = field(default_factory=list)  # chat: fingerprint of each message consumed so far
    messages: list[Any] = field(default_factory=list)  # chat: those messages (the served replies as served)
    text: str | None = None  # text: prompt + completion text served so far (str prompts)
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    pending_close: list[int] = field(default_factory=list)  # closes the last assistant message if a turn follows
    turns: list[int] = field(default_factory=list)
    # chat, a VLM: (sha256, bytes as sent) of each image whose placeholders `tokens` hold, in order
    images: list[tuple[str, bytes]] = field(default_factory=list)

    def append(self, ids: list[int], policy: Generation | None = None) -> None:
        self.tokens.extend(ids)
        if policy is None:
            self.mask.extend([0] * len(ids))
            self.logprobs.extend([0.0] * len(ids))
            self.versions.extend([-1] * len(ids))
        else:
            self.mask.extend([1] * len(ids))
            self.logprobs.extend(policy.logprobs[: len(ids)])
            self.versions.extend(policy.versions[: len(ids)])


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """The return of each turn, accumulated backwards from the last:

        G_t = r_t + γ·G_{t+1},   G_T = 0 past the last turn T−1

    so γ = 1 gives the sum of the rewards still to come, γ = 0 each turn's own reward, and no
    turns no returns. E.g. rewards [1, 0, 2], γ = 0.5: G_2 = 2, G_1 = 0 + 0.5·2 = 1,
    G_0 = 1 + 0.5·1 = 1.5, so [1.5, 1.0, 2.0].
    """
    returns = [0.0] * len(rewards)
    acc = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = rewards[t] + gamma * acc
        returns[t] = acc
    return returns


def turn_returns(turn_rewards: Sequence[float | None], final_reward: float | None, gamma: float) -> list[float]:
    """The returns of a segment's turns: a turn without a reward counts 0 and the final reward is
    added to the last turn. [] when no reward was given at all (the segment is ungraded)."""
    if final_reward is None and all(r is None for r in turn_rewards):
        return []
    rewards = [r or 0.0 for r in turn_rewards]
    rewards[-1] += final_reward or 0.0
    return discounted_returns(rewards, gamma)


def token_rewards(num_tokens: int, turns: Sequence[TurnRecord], returns: Sequence[float]) -> list[float]:
    """Per token: G_t on the served tokens of turn t, 0 elsewhere."""
    out = [0.0] * num_tokens
    for turn, g in zip(turns, returns):
        for p in range(turn.response_start, turn.response_end):
            out[p] = g
    return out


def segment_row(
    seg: Segment,
    turns: Sequence[TurnRecord],
    final_reward: float | None,
    discount: float,
    *,
    sample_id: str,
    group_id: str,
    prompt_id: str,
    worker_id: str,
    session_id: str,
    segments: int,
    meta: dict[str, Any] | None,
) -> Sample:
    """The trajectory row of a segment that served `turns` (at least one), of a session of
    `segments` segments. Its reward is G_0 (None when ungraded); token_rewards is set only when
    per-turn rewards were given."""
    rewards = [t.reward for t in turns]
    returns = turn_returns(rewards, final_reward, discount)
    reward = returns[0] if returns else None
    per_token = token_rewards(len(seg.tokens), turns, returns) if any(r is not None for r in rewards) else None
    return Sample(
        sample_id=sample_id,
        group_id=group_id,
        prompt_id=prompt_id,
        worker_id=worker_id,
        input_ids=list(seg.tokens),
        prompt_len=turns[0].response_start,
        loss_mask=list(seg.mask),
        behav_logprobs=list(seg.logprobs),
        versions=list(seg.versions),
        finish_reason=turns[-1].finish_reason,
        reward=reward,
        token_rewards=per_token,
        reward_info={
            "turn_rewards": rewards,
            "final_reward": final_reward,
            "discount": discount,
            "turn_returns": returns,
            **({"reward_source": "agent"} if reward is not None else {}),
        },
        num_turns=len(turns),
        image_ids=[sha for sha, _ in seg.images] or None,
        meta={
            **(meta or {}),
            "session_id": session_id,
            "segment": seg.index,
            "segments": segments,
            "tool_calls": sum(t.tool_calls for t in turns),
            "turns": [[t.completion_id, t.fed_start, t.response_start, t.response_end, t.finish_reason] for t in turns],
        },
    )
