"""All live sessions of one proxy: who owns which (by API key), the quotas and each key's fair share
of them, expiry, the row cap of a session and the caps on a key's implicit session, and ending a
session into its trajectory rows (written as one shard in online mode). One session's record is
proxy/sessions.py; the problems raised here are defined there too."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from areal_core.protocol import Sample, check_reward
from areal_core.proxy.backpressure import SessionAdmission
from areal_core.proxy.sessions import (
    KEY_SESSION_PREFIX,
    InvalidReward,
    ReservedSessionId,
    Session,
    SessionNotFound,
    TooManySessions,
    check_session_id,
    key_session_id,
)
from areal_core.proxy.shards import ShardWriter
from areal_core.proxy.templating import ChatTemplate
from areal_core.store import Store

log = logging.getLogger("areal.proxy")


class SessionManager:
    """All live sessions of one proxy. Used from the server's event loop only.

    Sessions are owned by the API key that created them and named within it: the table is indexed
    by (owner, session id), so two keys may use the same X-Session-Id without meeting, and no key
    can claim, read, reward or end another key's session, live or ended. A key asking for a session
    it does not own gets `SessionNotFound`, the same problem with the same message as for an id no
    key uses: whether another key has that session is never said. Key-derived ids ("key-...") can
    only be opened by their own key (`ReservedSessionId`, by the id's form alone, for every such id
    alike).

    Quotas, and why no key can lock another out: `max_sessions` live sessions in all and
    `max_sessions_per_key` per key (`TooManySessions` above either), with two rules on top.
    - A key's implicit session is always opened: it counts in both quotas but neither refuses it
      (there is one per accepted key, so the table holds at most `max_sessions` plus one per key).
      Only the trainer's bound (online mode) can refuse it, as it refuses every new session.
    - Fair share: when the table is full, a key holding fewer than its fair share, max(1,
      max_sessions // K) with K the keys holding live sessions (the asking key included), takes the
      place of the least recently used idle session (no request in flight; never an implicit
      session) of the key holding the most above its own share. That session is dropped as an
      expired one is (nothing written, counted `evicted`; its id then names a fresh session). A key
      at or above its share, or one below it while every session above a share is in use, gets
      `TooManySessions` saying what it holds and its share.

    Rows: a session writes one row per segment, at most `max_session_rows` (None: no cap); a turn
    that would start one more is `SessionFull` (sessions.py). In online mode every open session holds
    max(1, its rows) of the trainer's bound (`held_rows`; `SessionAdmission.check`), so waiting rows
    stay ≤ bound + (max_session_rows − 1) × the sessions open when the bound was reached (each of
    which held at least one row of it: ≤ max_session_rows × bound in all).

    A key's implicit session (its key-derived id: requests without X-Session-Id) is one a client
    may never end. It is capped: once it holds `max_key_session_segments` segments (or
    `max_session_rows`, the smaller) or `max_key_session_tokens` tokens (None: no cap), the turn that
    reached the cap is its last; it is ended like a normal end (rows written in online mode, the hooks
    called, counted as `ended` and `capped`), and the key's next request opens a fresh one under the
    same id.
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
        max_key_session_segments: int | None = 256,
        max_key_session_tokens: int | None = 262_144,
        admission: SessionAdmission | None = None,
        max_session_rows: int | None = 64,
    ):
        self.template = template
        self.worker_id = worker_id
        self.turn_discount = turn_discount
        self.writer = ShardWriter(store, worker_id) if store is not None else None
        self.admission = admission  # online mode: no new session while the trainer is behind
        self.session_ttl_s = session_ttl_s
        self.max_sessions, self.max_sessions_per_key = max_sessions, max_sessions_per_key
        self.reward_range = reward_range
        caps = {
            "max_key_session_segments": max_key_session_segments,
            "max_key_session_tokens": max_key_session_tokens,
            "max_session_rows": max_session_rows,
        }
        for name, cap in caps.items():
            if cap is not None and cap < 1:
                raise ValueError(f"{name} must be >= 1 or None (no cap), not {cap}")
        self.max_key_session_segments, self.max_key_session_tokens = max_key_session_segments, max_key_session_tokens
        self.max_session_rows = max_session_rows
        self.held_rows = 0  # Σ max(1, rows) over the live sessions: what they will write at least
        self.sessions: dict[tuple[str, str], Session] = {}  # (owner, session id) -> live session
        self.per_key: dict[str, int] = {}  # owner -> live sessions
        self.on_finish: list[Callable[[Session, list[Sample]], None]] = []
        self.counters = {"created": 0, "ended": 0, "expired": 0, "capped": 0, "turns": 0, "rows_written": 0}
        self.counters["evicted"] = 0  # idle sessions whose place a key below its fair share took
        self._last_sweep = time.time()

    def _drop(self, s: Session) -> None:
        if self.sessions.pop((s.owner, s.id), None) is s:
            self.held_rows -= max(1, len(s.segments))
            self.per_key[s.owner] -= 1
            if not self.per_key[s.owner]:
                del self.per_key[s.owner]

    def _sweep(self) -> None:
        """Drop sessions idle for longer than the TTL (never written: an abandoned episode)."""
        self._last_sweep = time.time()
        cutoff = time.time() - self.session_ttl_s
        for s in [s for s in self.sessions.values() if s.updated < cutoff and not s.lock.locked()]:
            self._drop(s)
            s.ended = True
            self.counters["expired"] += 1

    def check_reward(self, reward: float | None) -> float | None:
        """`reward` when it is None or finite within `reward_range`, else `InvalidReward` saying why."""
        if reward is None:
            return None
        try:
            return check_reward(reward, *self.reward_range)
        except ValueError as exc:
            raise InvalidReward(str(exc)) from None

    def open(self, session_id: str, owner: str) -> Session:
        """The live session `session_id` of `owner`, created if absent; `InvalidSessionId` for an id
        that is not a name, `ReservedSessionId` for a key-derived id not of `owner`, `TooManySessions`
        over a quota (the class docstring: a key's implicit session is never refused by one, and a key
        below its fair share of a full table takes an idle session's place), `TrainerBehind` (online
        mode) while the trainer has not settled enough rows."""
        s = self.sessions.get((owner, check_session_id(session_id)))
        if s is not None:
            return s
        implicit = session_id == key_session_id(owner)
        if session_id.startswith(KEY_SESSION_PREFIX) and not implicit:
            raise ReservedSessionId(session_id)
        if len(self.sessions) >= self.max_sessions or time.time() - self._last_sweep > min(60.0, self.session_ttl_s):
            self._sweep()
        victim = None
        if not implicit:
            if self.per_key.get(owner, 0) >= self.max_sessions_per_key:
                raise TooManySessions(self.max_sessions_per_key, per_key=True)
            if len(self.sessions) >= self.max_sessions:
                victim = self._fair_victim(owner)
        if self.admission is not None:
            self.admission.check(self.held_rows)
        if victim is not None:
            self._drop(victim)
            victim.ended = True
            self.counters["evicted"] += 1
            log.info("session table full: an idle session of a key above its fair share gave its place")
        s = Session(session_id, owner, self.template)
        s.max_rows, s.on_row = self.max_session_rows, self._row_added
        self.sessions[(owner, session_id)] = s
        self.per_key[owner] = self.per_key.get(owner, 0) + 1
        self.held_rows += 1
        self.counters["created"] += 1
        return s

    def fair_share(self, owner: str) -> tuple[int, int]:
        """(the fair share of the table, the keys it is shared among): max(1, max_sessions // K), K the
        keys holding live sessions, `owner` included."""
        keys = len(self.per_key) + (owner not in self.per_key)
        return max(1, self.max_sessions // keys), keys

    def _fair_victim(self, owner: str) -> Session:
        """The session whose place `owner` takes in a full table: the least recently used idle named
        session of the key holding the most above its fair share, when `owner` holds less than its
        share; else `TooManySessions`."""
        fair, keys = self.fair_share(owner)
        held = self.per_key.get(owner, 0)
        if held < fair:
            idle = [
                s
                for s in self.sessions.values()
                if self.per_key[s.owner] > fair and not s.lock.locked() and s.id != key_session_id(s.owner)
            ]
            if idle:
                return min(idle, key=lambda s: (-self.per_key[s.owner], s.updated))
        raise TooManySessions(self.max_sessions, per_key=False, held=held, fair=fair, keys=keys)

    def _row_added(self, s: Session) -> None:
        """A turn of `s` started a row beyond its first: one more row held of the trainer's bound."""
        if self.sessions.get((s.owner, s.id)) is s:
            self.held_rows += 1

    def get(self, session_id: str, owner: str) -> Session:
        """The live session `session_id` of `owner`; `InvalidSessionId` for an id that is not a name,
        else `SessionNotFound`, whether or not another key has a session by that name (or the id is
        another key's key-derived one): a key cannot tell another key's session from no session."""
        s = self.sessions.get((owner, check_session_id(session_id)))
        if s is None:
            raise SessionNotFound(session_id)
        return s

    # -- the caps on a key's implicit session ----------------------------------------------------
    def cap_reached(self, s: Session) -> str | None:
        """The cap `s` is at, "segments" or "tokens", when it is a key's implicit session; else None."""
        if s.id != key_session_id(s.owner):
            return None
        segment_caps = [c for c in (self.max_key_session_segments, self.max_session_rows) if c is not None]
        if segment_caps and len(s.segments) >= min(segment_caps):
            return "segments"
        if self.max_key_session_tokens is not None and s.num_tokens() >= self.max_key_session_tokens:
            return "tokens"
        return None

    async def end_if_capped(self, s: Session) -> bool:
        """End `s` (this session object, never a fresher one by its name) when it is at a cap: its rows
        written and counted as for a normal end, meta["capped"] the cap. True when this call ended it."""
        cap = self.cap_reached(s)
        if cap is None:
            return False
        try:
            await self._end(s, meta={"capped": cap}, capped=cap)
        except SessionNotFound:  # another request ended it first
            return False
        self.counters["capped"] += 1
        return True

    async def reward(
        self,
        session_id: str,
        owner: str,
        reward: float,
        turn: int | None = None,
        completion_id: str | None = None,
    ) -> str:
        """Set a reward of a live session (`Session.set_reward`); what it applied to."""
        reward = self.check_reward(reward)
        s = self.get(session_id, owner)
        async with s.lock:
            if s.ended:  # ended while this request waited for the lock
                raise SessionNotFound(session_id)
            return s.set_reward(reward, turn, completion_id)

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
        return await self._end(s, reward, discount, group_id, prompt_id, meta, sample_prefix, write)

    async def _end(
        self,
        s: Session,
        reward: float | None = None,
        discount: float | None = None,
        group_id: str | None = None,
        prompt_id: str = "",
        meta: dict[str, Any] | None = None,
        sample_prefix: str | None = None,
        write: bool = True,
        capped: str | None = None,
    ) -> tuple[Session, list[Sample], list[str]]:
        async with s.lock:
            if s.ended:
                raise SessionNotFound(s.id)
            s.capped = capped
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
            names = await asyncio.to_thread(self.writer.write, samples, s.image_bytes())
            self.counters["rows_written"] += len(samples)
            if self.admission is not None:
                self.admission.add_written(len(samples))
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
            except SessionNotFound:  # ended meanwhile
                continue
            rows.extend(samples)
        return rows
