"""Proxy sessions: one agent episode, recorded token by token as it was served.

A session is named by its API key alone, or by the `X-Session-Id` header together with the key
that created it; no other key may read, reward or end it. A session holds one or more
*segments*. A segment is one growing token sequence: each turn appends the tokens that
close the previous assistant message, the new messages and the generation prompt (all
non-policy tokens: loss_mask 0, version -1), then the served tokens (loss_mask 1, their
behaviour log-probs and versions). The new messages are the token delta the model's chat
template gives them after the segment's history (proxy/templating.py), so earlier turns keep
the exact ids that were fed and served. A request whose message history extends a segment's
history continues that segment; one that does not (the agent rewrote its history, or runs
two conversations in one session) opens a new segment. A VLM's chat segment also keeps the
bytes of the images its placeholders stand for, in order; its row names them in `image_ids`
and the manager stores them under the run root before the row's shard (proxy/shards.py). Each segment becomes one row of
the trajectory protocol when the session ends; an episode that only ever appends is one row. A
session holds at most `max_rows` rows (the manager's `max_session_rows`): a turn that would start one
more segment is `SessionFull`, and the session goes on with the conversations it has.

Sessions are named within their API key: `SessionManager` (proxy/manager.py) indexes its table by
(owner, id), so a key that asks for another key's session is told that it has none by that name,
exactly as for a name no key uses. Ids are names (`check_session_id`): 1-128 of [A-Za-z0-9._:-],
not "." or ".."; "key-..." ids are the key-derived ones, and only their own key may open one.

Rewards (finite, within the manager's `reward_range`, else `InvalidReward`): per turn (`turn`
index or `completion_id`) or final; at the end the turn rewards of a segment are discounted
backwards, G_t = r_t + γ·G_{t+1} (the final reward is added to the segment's last turn), and the
row's reward is G_0 (proxy/segments.py). When per-turn rewards were set, token_rewards carries G_t on
the tokens of turn t.

What a caller may do wrong is a `SessionProblem`, one subclass per reason; none carries an HTTP
status: the routes choose the answer (proxy/routes/errors.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from areal_core.protocol import Sample
from areal_core.proxy.images import RequestImage, prompt_images
from areal_core.proxy.segments import Segment, TurnRecord, segment_row
from areal_core.proxy.templating import ChatTemplate, TemplateError, fingerprint
from areal_core.rollout.engine import Generation
from areal_core.vlm_processor import MMInputs


class SessionProblem(Exception):
    """A session operation refused; `message` says why in words."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class SessionNotFound(SessionProblem):
    """The owner has no live session of that name: never opened, ended, expired, or another key's
    (whose sessions it cannot see: the same problem, the same message)."""

    def __init__(self, session_id: str):
        super().__init__(f"no live session {session_id!r}")
        self.session_id = session_id


class InvalidSessionId(SessionProblem):
    """A session id that cannot be a name (`check_session_id` says why). Refused by its form alone,
    whoever asks and whatever sessions exist."""

    def __init__(self, session_id: str, reason: str):
        super().__init__(f"invalid session id {shown(session_id)}: {reason}")
        self.session_id, self.reason = session_id, reason


class ReservedSessionId(InvalidSessionId):
    """An id of the form "key-..." other than the caller's own key-derived id, given to open a session.
    Refused by its form alone, for every such id alike: whether a key with that digest exists, has a
    live session, had one or never did is not said (the answer and its message are the same)."""

    def __init__(self, session_id: str):
        reason = f"ids starting with {KEY_SESSION_PREFIX!r} are reserved: each names the session of one API key"
        super().__init__(session_id, reason)


class UnknownCompletion(SessionProblem):
    """A reward for a completion id that the session did not serve."""

    def __init__(self, session_id: str, completion_id: str):
        super().__init__(f"completion {completion_id!r} is not in session {session_id!r}")
        self.session_id, self.completion_id = session_id, completion_id


class TurnOutOfRange(SessionProblem):
    """A reward for a turn index outside the session's turns, 0 .. turns - 1 (the request schema
    refuses a negative one before it gets here)."""

    def __init__(self, session_id: str, turn: int, num_turns: int):
        super().__init__(f"turn {turn} does not exist: session {session_id!r} has {num_turns} turns")
        self.session_id, self.turn, self.num_turns = session_id, turn, num_turns


class TurnMismatch(SessionProblem):
    """A reward naming both a turn and a completion id that is another turn's: which one was meant
    is unknown, and a reward on the wrong turn would train on it silently."""

    def __init__(self, session_id: str, turn: int, completion_id: str, its_turn: int):
        super().__init__(
            f"completion_id is turn {its_turn} of session {session_id!r}, not turn {turn}: "
            "give one of turn and completion_id, or both naming the same turn"
        )
        self.session_id, self.turn, self.completion_id = session_id, turn, completion_id


class InvalidReward(SessionProblem):
    """A reward that is not a finite number within the manager's `reward_range`; the message is
    the reason (protocol.check_reward)."""


class TooManySessions(SessionProblem):
    """Opening one more session would exceed a quota of live sessions: of this API key
    (`per_key`), or of all keys together, where `held` and `fair` say what the key holds and its
    fair share of the table among `keys` keys (proxy/manager.py: a key below its share is not refused
    while another key holds an idle session above its own)."""

    def __init__(self, limit: int, per_key: bool, held: int | None = None, fair: int | None = None, keys: int = 1):
        scope = " for this API key" if per_key else ""
        share = ""
        if held is not None and fair is not None:
            share = f"; this API key holds {held}, its fair share among {keys} keys is {fair}"
        super().__init__(f"too many live sessions{scope} (limit {limit}{share})")
        self.limit, self.per_key, self.held, self.fair = limit, per_key, held, fair


class SessionFull(SessionProblem):
    """A turn that would start one more row (a new segment: a conversation that does not continue one
    of the session's) in a session that already holds `limit` rows, the most one session may write.
    The session stays open: turns that continue one of its conversations are served, and ending it
    writes its rows; a new conversation belongs in a new session. Retrying the same turn cannot help."""

    def __init__(self, session_id: str, limit: int):
        super().__init__(
            f"session {shown(session_id)} holds {limit} rows, the most one session may write (max_session_rows):"
            " a turn that starts a new conversation in it is refused; continue one of its conversations, or end"
            " the session and start the new conversation in a new one"
        )
        self.session_id, self.limit = session_id, limit


MAX_SESSION_ID_CHARS = 128
_SESSION_ID = re.compile(r"[A-Za-z0-9._:\-]+")


def shown(session_id: str, limit: int = 40) -> str:
    """A session id as a message shows it: quoted, escaped, at most `limit` characters of it."""
    return repr(session_id[:limit]) + (f"... ({len(session_id)} chars)" if len(session_id) > limit else "")


def check_session_id(session_id: str) -> str:
    """`session_id` when it can name a session: 1-128 of [A-Za-z0-9._:-], and not "." or "..", which
    standard HTTP clients remove from a URL path (RFC 3986 dot segments), so the session could not be
    read, rewarded or ended. Else `InvalidSessionId` with the reason: empty, overlong, a path separator,
    NUL or another control character, a dot name, another character."""
    if not isinstance(session_id, str) or not session_id:
        raise InvalidSessionId(str(session_id or ""), "it is empty")
    if len(session_id) > MAX_SESSION_ID_CHARS:
        raise InvalidSessionId(session_id, f"longer than {MAX_SESSION_ID_CHARS} characters")
    if _SESSION_ID.fullmatch(session_id) is None:
        if "/" in session_id or "\\" in session_id:
            reason = "it holds a path separator"
        elif any(ord(c) < 32 or ord(c) == 127 for c in session_id):
            reason = "it holds NUL or another control character"
        else:
            reason = "only [A-Za-z0-9._:-] may be used"
        raise InvalidSessionId(session_id, reason)
    if session_id in (".", ".."):
        raise InvalidSessionId(session_id, "'.' and '..' are path steps, not names")
    return session_id


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
class TurnPlan:
    """What a turn will feed; the session changes only when the turn is committed."""

    segment: Segment | None  # None: a new segment
    kind: str
    fed: list[int]  # tokens appended before generation
    prompt_ids: list[int]  # the full prompt the engine sees: segment tokens + fed
    fingerprints: list[tuple] | None = None  # chat: fingerprint of each request message
    messages: list[Any] | None = None  # chat: the segment's messages then the request's new ones
    prompt_text: str | None = None  # text: the request's prompt string
    images: list[RequestImage] | None = None  # chat, a VLM: the images `fed` holds the placeholders of
    mm: MMInputs | None = None  # the whole prompt's images (the segment's and the new ones) for the engine


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
        self.capped: str | None = None  # "segments" or "tokens": ended by the manager at that cap
        self.lock = asyncio.Lock()
        self.max_rows: int | None = None  # the most rows (segments) it may hold: SessionFull beyond; None: no cap
        self.on_row: Callable[[Session], None] | None = None  # called when a turn adds a row beyond the first

    def _room_for_a_row(self) -> None:
        """Before a turn that starts a new segment: `SessionFull` when the session holds `max_rows`."""
        if self.max_rows is not None and len(self.segments) >= self.max_rows:
            raise SessionFull(self.id, self.max_rows)

    # -- planning a turn -----------------------------------------------------------------
    def plan_chat(
        self, messages: list[Any], tools: list[Any] | None, images: list[list[RequestImage]] | None = None
    ) -> TurnPlan:
        """`images`: each message's decoded images (proxy/images.py: request_images), for a VLM."""
        prints = [fingerprint(m) for m in messages]
        best: Segment | None = None  # the chat segment whose history is the longest prefix of the request's
        for seg in self.segments:
            n = len(seg.fingerprints)
            extends = seg.kind == "chat" and n <= len(prints) and prints[:n] == seg.fingerprints
            if extends and (best is None or n > len(best.fingerprints)):
                best = seg
        if best is None:
            self._room_for_a_row()
        t = self.template
        if best is None:
            fed = t.render(messages, tools, generation_prompt=True)
            history: list[Any] = list(messages)
            base: list[int] = []
        else:
            new_msgs = messages[len(best.fingerprints) :]
            fed = best.pending_close + t.delta(best.messages, new_msgs, tools)
            history = best.messages + list(new_msgs)
            base = best.tokens
        plan = TurnPlan(best, "chat", fed, base + fed, fingerprints=prints, messages=history)
        if t.vision is not None:  # a VLM: each image's placeholder expanded to its patches, its pixels
            per_message = images or [[] for _ in messages]
            seen = [im for ims in per_message[: len(best.fingerprints) if best else 0] for im in ims]
            new = [im for ims in per_message[len(best.fingerprints) if best else 0 :] for im in ims]
            if [im.id for im in seen] != [sha for sha, _ in (best.images if best else [])]:
                raise TemplateError("the request's history holds other images than its conversation so far")
            plan.fed, plan.mm = prompt_images(t.vision, fed, seen + new, len(new))
            plan.prompt_ids, plan.images = base + plan.fed, new
        return plan

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
        self._room_for_a_row()
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
            if len(self.segments) > 1 and self.on_row is not None:
                self.on_row(self)
        fed_start = len(seg.tokens)
        seg.append(plan.fed)
        start = len(seg.tokens)
        seg.append(gen.token_ids, policy=gen)
        seg.images += [(im.id, im.data) for im in plan.images or []]
        if plan.kind == "chat":
            reply = assistant_message or {"role": "assistant"}
            seg.fingerprints = list(plan.fingerprints or []) + [fingerprint(reply)]
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

    def num_tokens(self) -> int:
        return sum(len(seg.tokens) for seg in self.segments)

    def image_bytes(self) -> dict[str, bytes]:
        """The bytes of every image the session's rows name, by id (stored before its shard)."""
        return {sha: data for seg in self.segments for sha, data in seg.images}

    # -- rewards and the end ---------------------------------------------------------------
    def set_reward(self, reward: float, turn: int | None = None, completion_id: str | None = None) -> str:
        if completion_id is not None:
            found = [t for t in self.turns if t.completion_id == completion_id]
            if not found:
                raise UnknownCompletion(self.id, completion_id)
            if turn is not None and turn != found[0].turn:
                raise TurnMismatch(self.id, turn, completion_id, found[0].turn)
            found[0].reward = reward
            return f"turn {found[0].turn}"
        if turn is not None:
            if isinstance(turn, bool) or not 0 <= turn < len(self.turns):
                raise TurnOutOfRange(self.id, turn, len(self.turns))
            self.turns[turn].reward = reward
            return f"turn {turn}"
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
        """One trajectory row per segment that served at least one turn (segments.segment_row)."""
        name = f"{self.id}-{self.uid}"
        return [
            segment_row(
                seg,
                [self.turns[i] for i in seg.turns],
                self.final_reward,
                discount,
                sample_id=f"{sample_prefix or name}-s{seg.index}",
                group_id=group_id or name,
                prompt_id=prompt_id,
                worker_id=worker_id,
                session_id=self.id,
                segments=len(self.segments),
                meta=meta,
            )
            for seg in self.segments
            if seg.turns
        ]
