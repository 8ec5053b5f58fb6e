"""What every route of one proxy app shares: the backend, the sessions, the template, the
limits and sampling defaults, and one turn (plan, budget, generate) under a session's lock.

`create_app` puts one `ProxyState` on `app.state.proxy`; routes get it with
`Depends(proxy_state)`, spelt `state: State`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Annotated, Any

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from areal_core.proxy.guard import ApiKeys, ProxyError, ProxyLimits
from areal_core.proxy.images import ImageRefused
from areal_core.proxy.manager import SessionManager
from areal_core.proxy.schemas import SamplingFields
from areal_core.proxy.sessions import Session, TurnPlan
from areal_core.proxy.templating import ChatTemplate, TemplateError
from areal_core.rollout.engine import MIN_TEMPERATURE, Generation, SamplingParams

log = logging.getLogger("areal.proxy")


@dataclass
class Turn:
    """One served turn, before it is committed to its session."""

    session: Session
    plan: TurnPlan
    gen: Generation
    wall_s: float
    session_ended: bool = False  # the turn reached a cap of the key's implicit session, which was ended


@dataclass
class ProxyState:
    backend: Any  # an AsyncEngine (proxy/backend.py)
    owns_backend: bool  # create_app wrapped the engine itself: close the backend at shutdown
    tokenizer: Any
    template: ChatTemplate
    sessions: SessionManager
    api_keys: ApiKeys
    limits: ProxyLimits
    context_limit: int
    defaults: SamplingParams
    force_sampling: bool
    model_name: str
    follower: Any = None  # proxy/versions.Follower when the proxy follows a source of versions
    image_refusal: str | None = "this model takes text content only"  # None: a VLM on an engine that takes images
    vision_tokens: frozenset[int] = frozenset()  # a VLM's placeholders: only the template writes them

    def model_version(self, version: int) -> str | None:
        """What serving version `version` holds (models:/NAME/N, RUN/weights/v..., a folder); None
        when the proxy follows no source."""
        return None if self.follower is None else self.follower.label(version)

    def sampling_for(self, req: SamplingFields, max_new: int) -> SamplingParams:
        """The server defaults with `max_new`; the request's temperature, top_p and top_k
        unless sampling is forced."""
        d = self.defaults
        p = replace(d, max_new_tokens=max_new, stop_token_ids=list(d.stop_token_ids))
        if not self.force_sampling:
            if req.temperature is not None:
                p.temperature = req.temperature
                p.greedy = req.temperature < MIN_TEMPERATURE
            if req.top_p is not None:
                p.top_p = req.top_p
            if req.top_k is not None:
                p.top_k = req.top_k
        return p

    def budget(self, n_prompt: int, explicit: int | None) -> int:
        """max_new_tokens for a prompt of `n_prompt` tokens: room = context_limit − n_prompt;
        an explicit max_tokens must fit both the room and limits.max_new_tokens (else 400),
        otherwise min(default, limits.max_new_tokens, room)."""
        room = self.context_limit - n_prompt
        if room < 1:
            raise ProxyError(
                400,
                f"the prompt is {n_prompt} tokens; this model's context is {self.context_limit} tokens, "
                "so no room is left for a completion",
                "context_length_exceeded",
            )
        if explicit is not None:
            if explicit > self.limits.max_new_tokens:
                raise ProxyError(
                    400,
                    f"max_tokens {explicit} exceeds the limit of {self.limits.max_new_tokens}",
                    "max_tokens_too_large",
                )
            if explicit > room:
                raise ProxyError(
                    400,
                    f"prompt ({n_prompt} tokens) + max_tokens ({explicit}) exceeds this model's context of "
                    f"{self.context_limit} tokens",
                    "context_length_exceeded",
                )
            return explicit
        return min(self.defaults.max_new_tokens, self.limits.max_new_tokens, room)

    async def run_turn(
        self,
        sid: str,
        owner: str,
        plan_fn: Callable[[Session], TurnPlan],
        req: SamplingFields,
        explicit: int | None,
    ) -> Turn:
        """Plan, generate and return one turn under the session's lock (the caller commits it, then
        calls `committed`)."""
        for _ in range(3):
            session = self.sessions.open(sid, owner)
            async with session.lock:
                if session.ended:  # ended while this request waited: start the next session
                    continue
                if self.sessions.cap_reached(session) is None:
                    return await self._generate(session, plan_fn, req, explicit)
            # at a cap: the turn that reached it is ending it; this request came in between
            await self.sessions.end_if_capped(session)
        raise ProxyError(409, f"session {sid!r} ended while the request waited", "session_ended")

    async def _generate(
        self, session: Session, plan_fn: Callable[[Session], TurnPlan], req: SamplingFields, explicit: int | None
    ) -> Turn:
        """Plan and generate one turn; the caller holds the session's lock."""
        try:  # tokenising and templating are CPU work: off the event loop, /health stays live
            plan = await run_in_threadpool(plan_fn, session)
        except TemplateError as exc:
            raise ProxyError(400, str(exc), exc.code) from None
        except ImageRefused as exc:  # the processor refusing an image that passed our checks (images.prompt_images)
            raise ProxyError(400, exc.message, exc.code) from None
        if not plan.prompt_ids:  # nothing to condition on: an engine cannot prefill zero tokens
            raise ProxyError(400, "the prompt is empty (it encodes to no tokens)", "empty_prompt")
        if plan.kind == "text" and self.vision_tokens.intersection(plan.fed):
            raise ProxyError(
                400,
                "the prompt holds vision placeholder tokens that stand for no image: send images as image_url "
                "parts of a chat request",
                "invalid_token_id",
            )
        params = self.sampling_for(req, self.budget(len(plan.prompt_ids), explicit))
        images = {"mm": plan.mm} if plan.mm is not None else {}  # a text turn calls the backend as before
        t0 = time.perf_counter()
        try:
            gen = await self.backend.generate(plan.prompt_ids, params, **images)
        except Exception:  # noqa: BLE001 - any engine failure is the client's 500
            ref = uuid.uuid4().hex[:12]  # the engine's own text stays in the server log, under this reference
            log.exception("engine failed (error %s)", ref)
            raise ProxyError(
                500,
                f"the engine failed on this request (error {ref}; the server log has it)",
                "engine_error",
                "server_error",
            ) from None
        return Turn(session, plan, gen, time.perf_counter() - t0)

    async def committed(self, turn: Turn) -> None:
        """After the route committed `turn`: count it, and end the key's implicit session when the
        turn brought it to a cap (`SessionManager.end_if_capped`), which the response then says."""
        self.sessions.counters["turns"] += 1
        await self.sessions.end_if_capped(turn.session)  # or a request that came in between ended it
        turn.session_ended = turn.session.capped is not None

    def areal_extra(self, turn: Turn, record: Any, t_arrival: float) -> dict:
        """The `areal` object of a completion: what was fed and served, and the timing."""
        gen = turn.gen
        return {
            "session_id": turn.session.id,
            "turn": record.turn,
            "segment": record.segment,
            "prompt_token_ids": turn.plan.prompt_ids,
            "token_ids": gen.token_ids,
            "logprobs": gen.logprobs,
            "versions": gen.versions,
            "policy_version": self.backend.version,
            "model_version": self.model_version(gen.versions[-1] if gen.versions else self.backend.version),
            "session_ended": turn.session_ended,
            "timing": {
                "queue_s": getattr(gen, "queue_s", 0.0),
                "engine_s": getattr(gen, "engine_s", turn.wall_s),
                "batch_size": getattr(gen, "batch_size", 1),
                "server_s": time.perf_counter() - t_arrival,
            },
        }

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "areal",
            "areal": {"policy_version": self.backend.version, "context_tokens": self.context_limit},
        }


def proxy_state(request: Request) -> ProxyState:
    """FastAPI dependency: the app's shared state."""
    return request.app.state.proxy


State = Annotated[ProxyState, Depends(proxy_state)]
