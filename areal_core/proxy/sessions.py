"""Proxy sessions: one agent episode, recorded token by token as it was served.

A session is keyed by its API key, or by the `X-Session-Id` header together with the key
that created it; no other key may read, reward or end it. A session holds one or more
*segments*. A segment is one growing token sequence: each turn appends the tokens that
close the previous assistant message, the new messages and the generation prompt (all
non-policy tokens: loss_mask 0, version -1), then the served tokens (loss_mask 1, their
behaviour log-probs and versions). The new messages are the token delta the model's chat
template gives them after the segment's history (proxy/templating.py), so earlier turns keep
the exact ids that were fed and served. A request whose message history extends a segment's
history continues that segment; one that does not (the agent rewrote its history, or runs
two conversations in one session) opens a new segment. Each segment becomes one row of
the trajectory protocol when the session ends; an episode that only ever appends is one row.

Sessions are named within their key: `SessionManager` keys its table by (owner, id).

Rewards (finite, within the manager's `reward_range`, else 422): per turn (`turn` index or `completion_id`) or final; at the end the turn rewards
of a segment are discounted backwards, G_t = r_t + γ·G_{t+1} (the final reward is added to
the segment's last turn), and the row's reward is G_0. When per-turn rewards were set,
token_rewards carries G_t on the tokens of turn t.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areal_core.protocol import Sample, check_reward
from areal_core.proxy.shards import ShardWriter
from areal_core.proxy.templating import ChatTemplate, canonical
from areal_core.rollout.engine import Generation
from areal_core.store import Store


class SessionError(Exception):
    """An HTTP-visible session problem: status code and message."""

    def __init__(self, status: int, message: str, code: str = "session_error"):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


KEY_SESSION_PREFIX = "key-"


def key_session_id(owner: str) -> str:
    """The id of the session keyed by an API key alone (no X-Session-Id header), from the key's
    digest: "key-" + its first 24 hex digits. Ids with this prefix are reserved: only that key
    may open one."""
    return KEY_SESSION_PREFIX + owner[:24]


def session_id_for_key(api_key: str) -> str:
    return key_session_id(key_digest(api_key))


@dataclass
class TurnRecord:
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
    index: int
    kind: str  # "chat" | "text"
    keys: list[tuple] = field(default_factory=list)  # chat: canonical messages consumed so far
    messages: list[Any] = field(default_factory=list)  # chat: those messages (the served replies as served)
    text: str | None = None  # text: prompt + completion text served so far (str prompts)
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    pending_close: list[int] = field(default_factory=list)  # closes the last assistant message if a turn follows
    turns: list[int] = field(default_factory=list)

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


@dataclass
class TurnPlan:
    """What a turn will feed; the session changes only when the turn is committed."""

    segment: Segment | None  # None: a new segment
    kind: str
    fed: list[int]  # tokens appended before generation
    prompt_ids: list[int]  # the full prompt the engine sees: segment tokens + fed
    keys: list[tuple] | None = None  # chat: canonical request messages
    messages: list[Any] | None = None  # chat: the segment's messages then the request's new ones
    prompt_text: str | None = None  # text: the request's prompt string


class Session:
    def __init__(self, session_id: str, owner: str, template: ChatTemplate):
        self.id = session_id
        self.uid = uuid.uuid4().hex[:12]  # this session among all that ever carried its id (any key)
        self.owner = owner
        self.template = template
        self.created = self.updated = time.time()
        self.segments: list[Segment] = []
        self.turns: list[TurnRecord] = []
        self.final_reward: float | None = None
        self.ended = False
        self.lock = asyncio.Lock()

    # -- planning a turn -----------------------------------------------------------------
    def plan_chat(self, messages: list[Any], tools: list[Any] | None) -> TurnPlan:
        keys = [canonical(m) for m in messages]
        best: Segment | None = None
        for seg in self.segments:
            n = len(seg.keys)
            if seg.kind == "chat" and n <= len(keys) and keys[:n] == seg.keys and (best is None or n > len(best.keys)):
                best = seg
        t = self.template
        if best is None:
            fed = t.render(messages, tools, generation_prompt=True)
            history: list[Any] = list(messages)
            base: list[int] = []
        else:
            new_msgs = messages[len(best.keys) :]
            fed = best.pending_close + t.delta(best.messages, new_msgs, tools)
            history = best.messages + list(new_msgs)
            base = best.tokens
        return TurnPlan(best, "chat", fed, base + fed, keys=keys, messages=history)

    def plan_text(self, prompt: str | list[int]) -> TurnPlan:
        t = self.template
        for seg in reversed(self.segments):
            if seg.kind != "text":
                continue
            if isinstance(prompt, str) and seg.text is not None and prompt.startswith(seg.text):
                fed = t.encode(prompt[len(seg.text) :]) if len(prompt) > len(seg.text) else []
                return TurnPlan(seg, "text", fed, seg.tokens + fed, prompt_text=prompt)
            if isinstance(prompt, list) and prompt[: len(seg.tokens)] == seg.tokens:
                fed = list(prompt[len(seg.tokens) :])
                return TurnPlan(seg, "text", fed, list(prompt), prompt_text=None)
        fed = t.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return TurnPlan(None, "text", fed, list(fed), prompt_text=prompt if isinstance(prompt, str) else None)

    # -- committing a served turn ----------------------------------------------------------
    def commit(
        self,
        plan: TurnPlan,
        gen: Generation,
        completion_id: str,
        finish_reason: str,
        assistant_message: dict[str, Any] | None = None,
        completion_text: str | None = None,
        tool_calls: int = 0,
    ) -> TurnRecord:
        seg = plan.segment
        if seg is None:
            seg = Segment(index=len(self.segments), kind=plan.kind)
            self.segments.append(seg)
        fed_start = len(seg.tokens)
        seg.append(plan.fed)
        start = len(seg.tokens)
        seg.append(gen.token_ids, policy=gen)
        if plan.kind == "chat":
            reply = assistant_message or {"role": "assistant"}
            seg.keys = list(plan.keys or []) + [canonical(reply)]
            seg.messages = list(plan.messages or []) + [reply]
            seg.pending_close = self.template.close_ids(gen.token_ids)
        else:
            seg.text = plan.prompt_text + (completion_text or "") if plan.prompt_text is not None else None
            seg.pending_close = []
        record = TurnRecord(
            turn=len(self.turns),
            completion_id=completion_id,
            segment=seg.index,
            fed_start=fed_start,
            response_start=start,
            response_end=len(seg.tokens),
            finish_reason=finish_reason,
            tool_calls=tool_calls,
        )
        self.turns.append(record)
        seg.turns.append(record.turn)
        self.updated = time.time()
        return record

    # -- rewards and the end ---------------------------------------------------------------
    def set_reward(self, reward: float, turn: int | None = None, completion_id: str | None = None) -> str:
        if completion_id is not None:
            found = [t for t in self.turns if t.completion_id == completion_id]
            if not found:
                raise SessionError(404, f"completion {completion_id!r} is not in session {self.id!r}", "unknown_turn")
            found[0].reward = reward
            return f"turn {found[0].turn}"
        if turn is not None:
            idx = turn if turn >= 0 else len(self.turns) + turn
            if not 0 <= idx < len(self.turns):
                raise SessionError(
                    400, f"turn {turn} does not exist: session {self.id!r} has {len(self.turns)} turns", "unknown_turn"
                )
            self.turns[idx].reward = reward
            return f"turn {idx}"
        self.final_reward = reward
        return "final"

    def summary(self, include_tokens: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "session_id": self.id,
            "created": self.created,
            "updated": self.updated,
            "ended": self.ended,
            "final_reward": self.final_reward,
            "turns": [
                {
                    "turn": t.turn,
                    "completion_id": t.completion_id,
                    "segment": t.segment,
                    "finish_reason": t.finish_reason,
                    "completion_tokens": t.response_end - t.response_start,
                    "tool_calls": t.tool_calls,
                    "reward": t.reward,
                }
                for t in self.turns
            ],
            "segments": [{"segment": s.index, "kind": s.kind, "num_tokens": len(s.tokens)} for s in self.segments],
        }
        if include_tokens:
            for info, s in zip(out["segments"], self.segments):
                info.update(input_ids=s.tokens, loss_mask=s.mask, behav_logprobs=s.logprobs, versions=s.versions)
        return out

    def to_samples(
        self,
        worker_id: str,
        discount: float = 1.0,
        group_id: str | None = None,
        prompt_id: str = "",
        meta: dict[str, Any] | None = None,
        sample_prefix: str | None = None,
    ) -> list[Sample]:
        """One trajectory row per segment that served at least one turn."""
        out = []
        for seg in self.segments:
            if not seg.turns:
                continue
            turns = [self.turns[i] for i in seg.turns]
            rewards = [t.reward for t in turns]
            any_turn = any(r is not None for r in rewards)
            if not any_turn and self.final_reward is None:
                reward, token_rewards, returns = None, None, []
            else:
                r = [x or 0.0 for x in rewards]
                r[-1] += self.final_reward or 0.0
                returns = [0.0] * len(r)
                acc = 0.0
                for i in range(len(r) - 1, -1, -1):
                    acc = r[i] + discount * acc
                    returns[i] = acc
                reward = returns[0]
                token_rewards = None
                if any_turn:
                    token_rewards = [0.0] * len(seg.tokens)
                    for t, g in zip(turns, returns):
                        for p in range(t.response_start, t.response_end):
                            token_rewards[p] = g
            prompt_len = turns[0].response_start
            out.append(
                Sample(
                    sample_id=f"{sample_prefix or self.id + '-' + self.uid}-s{seg.index}",
                    group_id=group_id or f"{self.id}-{self.uid}",
                    prompt_id=prompt_id,
                    worker_id=worker_id,
                    input_ids=list(seg.tokens),
                    prompt_len=prompt_len,
                    loss_mask=list(seg.mask),
                    behav_logprobs=list(seg.logprobs),
                    versions=list(seg.versions),
                    finish_reason=turns[-1].finish_reason,
                    reward=reward,
                    token_rewards=token_rewards,
                    reward_info={
                        "turn_rewards": rewards,
                        "final_reward": self.final_reward,
                        "discount": discount,
                        "turn_returns": returns,
                        **({"reward_source": "agent"} if reward is not None else {}),
                    },
                    num_turns=len(turns),
                    meta={
                        **(meta or {}),
                        "session_id": self.id,
                        "segment": seg.index,
                        "segments": len(self.segments),
                        "tool_calls": sum(t.tool_calls for t in turns),
                        "turns": [
                            [t.completion_id, t.fed_start, t.response_start, t.response_end, t.finish_reason]
                            for t in turns
                        ],
                    },
                )
            )
        return out


class SessionManager:
    """All live sessions of one proxy. Used from the server's event loop only.

    Sessions are owned by the key that created them and named within it: the table is keyed by
    (owner, session id), so two keys may use the same X-Session-Id without meeting, and no key
    can claim, read, reward or end another key's session, live or ended. Key-derived ids
    ("key-...") can only be opened by their own key. Quotas: `max_sessions` live sessions in all,
    `max_sessions_per_key` per key (429 above either), so one key cannot fill the table.
    """

    def __init__(
        self,
        template: ChatTemplate,
        worker_id: str = "proxy-0",
        turn_discount: float = 1.0,
        store: Store | None = None,
        session_ttl_s: float = 3600.0,
        max_sessions: int = 100_000,
        max_sessions_per_key: int = 1_000,
        reward_range: tuple[float, float] = (-10.0, 10.0),
    ):
        self.template = template
        self.worker_id = worker_id
        self.turn_discount = turn_discount
        self.writer = ShardWriter(store, worker_id) if store is not None else None
        self.session_ttl_s = session_ttl_s
        self.max_sessions, self.max_sessions_per_key = max_sessions, max_sessions_per_key
        self.reward_range = reward_range
        self.sessions: dict[tuple[str, str], Session] = {}  # (owner, session id) -> live session
        self.per_key: dict[str, int] = {}  # owner -> live sessions
        self.per_id: dict[str, int] = {}  # session id -> live sessions of that name (all keys)
        self.on_finish: list[Callable[[Session, list[Sample]], None]] = []
        self.counters = {"created": 0, "ended": 0, "expired": 0, "turns": 0, "rows_written": 0}
        self._last_sweep = time.time()

    def _drop(self, s: Session) -> None:
        if self.sessions.pop((s.owner, s.id), None) is s:
            for counts, k in ((self.per_key, s.owner), (self.per_id, s.id)):
                counts[k] -= 1
                if not counts[k]:
                    del counts[k]

    def _sweep(self) -> None:
        """Drop sessions idle for longer than the TTL (never written: an abandoned episode)."""
        self._last_sweep = time.time()
        cutoff = time.time() - self.session_ttl_s
        for s in [s for s in self.sessions.values() if s.updated < cutoff and not s.lock.locked()]:
            self._drop(s)
            s.ended = True
            self.counters["expired"] += 1

    def check_reward(self, reward: float | None) -> float | None:
        """`reward` when it is None or finite within `reward_range`, else 422 saying why."""
        if reward is None:
            return None
        try:
            return check_reward(reward, *self.reward_range)
        except ValueError as exc:
            raise SessionError(422, f"invalid request: {exc}", "invalid_reward") from None

    def open(self, session_id: str, owner: str) -> Session:
        """The live session `session_id` of `owner`, created if absent; 403 for another key's
        key-derived id, 429 over a quota."""
        s = self.sessions.get((owner, session_id))
        if s is not None:
            return s
        if session_id.startswith(KEY_SESSION_PREFIX) and session_id != key_session_id(owner):
            raise SessionError(403, f"session id {session_id!r} is reserved for another API key", "forbidden")
        if len(self.sessions) >= self.max_sessions or time.time() - self._last_sweep > min(60.0, self.session_ttl_s):
            self._sweep()
        if self.per_key.get(owner, 0) >= self.max_sessions_per_key:
            raise SessionError(
                429, f"too many live sessions for this API key (limit {self.max_sessions_per_key})", "too_many_sessions"
            )
        if len(self.sessions) >= self.max_sessions:
            raise SessionError(429, f"too many live sessions (limit {self.max_sessions})", "too_many_sessions")
        s = Session(session_id, owner, self.template)
        self.sessions[(owner, session_id)] = s
        self.per_key[owner] = self.per_key.get(owner, 0) + 1
        self.per_id[session_id] = self.per_id.get(session_id, 0) + 1
        self.counters["created"] += 1
        return s

    def get(self, session_id: str, owner: str) -> Session:
        """The live session `session_id` of `owner`; 403 when only another key has one by that
        name, else 404."""
        s = self.sessions.get((owner, session_id))
        if s is not None:
            return s
        reserved = session_id.startswith(KEY_SESSION_PREFIX) and session_id != key_session_id(owner)
        if reserved or session_id in self.per_id:
            raise SessionError(403, f"session {session_id!r} belongs to another API key", "forbidden")
        raise SessionError(404, f"no live session {session_id!r}", "unknown_session")

    def of_owner(self, owner: str) -> list[Session]:
        """The live sessions of one key, in the order they were created."""
        return [s for (o, _), s in self.sessions.items() if o == owner]

    async def end(
        self,
        session_id: str,
        owner: str,
        reward: float | None = None,
        discount: float | None = None,
        group_id: str | None = None,
        prompt_id: str = "",
        meta: dict[str, Any] | None = None,
        sample_prefix: str | None = None,
        write: bool = True,
    ) -> tuple[Session, list[Sample], list[str]]:
        """End a session: its rows (one per segment), and the shard names written (online mode)."""
        reward = self.check_reward(reward)
        s = self.get(session_id, owner)
        async with s.lock:
            if s.ended:
                raise SessionError(404, f"no live session {session_id!r}", "unknown_session")
            if reward is not None:
                s.final_reward = reward
            s.ended = True
            self._drop(s)
        samples = s.to_samples(
            self.worker_id,
            self.turn_discount if discount is None else discount,
            group_id=group_id,
            prompt_id=prompt_id,
            meta=meta,
            sample_prefix=sample_prefix,
        )
        names: list[str] = []
        if write and self.writer is not None and samples:
            names = await asyncio.to_thread(self.writer.write, samples)
            self.counters["rows_written"] += len(samples)
        self.counters["ended"] += 1
        for hook in self.on_finish:
            hook(s, samples)
        return s, samples, names

    async def end_all(self, owner: str, sample_prefix: str | None = None, **kwargs: Any) -> list[Sample]:
        """End every live session of one key (an episode's key: its own session and any
        X-Session-Id sessions it opened); rows of all of them, in the order they were created."""
        sids = [s.id for s in self.of_owner(owner)]
        rows: list[Sample] = []
        for k, sid in enumerate(sids):
            prefix = sample_prefix if len(sids) == 1 or sample_prefix is None else f"{sample_prefix}-{k}"
            try:
                _, samples, _ = await self.end(sid, owner, sample_prefix=prefix, **kwargs)
            except SessionError as exc:  # ended meanwhile
                if exc.status != 404:
                    raise
                continue
            rows.extend(samples)
        return rows
