"""What the proxy serves from a generation: stop-string cuts, per-token text and log-probs, SSE frames.

Pure functions of the tokenizer and the generation; the routes in server.py call them.
"""

from __future__ import annotations

import json
from typing import Any

from areal_core.rollout.engine import Generation


def cut_at_stop(
    tokenizer: Any, eos_id: int | None, gen: Generation, stops: list[str] | None
) -> tuple[Generation, str, bool]:
    """(generation cut after the token completing a stop string, visible text, stopped)."""
    ids = gen.token_ids[:-1] if gen.token_ids and gen.token_ids[-1] == eos_id else gen.token_ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not stops or not any(s in text for s in stops):
        return gen, text, False
    for i in range(1, len(gen.token_ids) + 1):
        partial = tokenizer.decode(gen.token_ids[:i], skip_special_tokens=True)
        hits = [partial.find(s) for s in stops if s in partial]
        if hits:
            cut = Generation(gen.token_ids[:i], gen.logprobs[:i], gen.versions[:i], "stop")
            return cut, partial[: min(hits)], True
    return gen, text, False


def token_logprobs(tokenizer: Any, gen: Generation) -> list[dict]:
    out = []
    for t, lp in zip(gen.token_ids, gen.logprobs):
        s = tokenizer.decode([t])
        out.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []})
    return out


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def text_pieces(tokenizer: Any, gen: Generation, text: str) -> list[str]:
    """The visible text split per served token (pieces join to `text`)."""
    pieces, prev = [], ""
    for i in range(1, len(gen.token_ids) + 1):
        cur = tokenizer.decode(gen.token_ids[:i], skip_special_tokens=True)
        if cur.endswith("\ufffd") or not text.startswith(cur) or len(cur) <= len(prev):
            continue
        pieces.append(cur[len(prev) :])
        prev = cur
    if prev != text:
        pieces.append(text[len(prev) :])
    return [p for p in pieces if p]
