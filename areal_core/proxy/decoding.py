"""What the proxy serves from a generation: stop-string cuts, per-token text and log-probs,
usage, and the SSE frames of a stream.

Pure functions of the tokenizer and the generation; the routes in routes/ call them. Every
SSE frame of both streaming routes is built by `sse_chunk`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from areal_core.rollout.engine import Generation

SSE_DONE = b"data: [DONE]\n\n"


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


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def _byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer is byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): its vocabulary
    strings spell bytes through GPT-2's byte-to-unicode table."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw bytes of one token, which `decode([t])` cannot give for a token that is part of a
    UTF-8 character (it gives U+FFFD): a byte-level BPE piece mapped back through the byte table,
    a SentencePiece byte-fallback piece `<0xE9>` as its byte, anything else as its decoded text.
    The bytes of a completion's tokens join to the completion's UTF-8."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and token_id not in getattr(tokenizer, "all_special_ids", ()):
        if (m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)) is not None:
            return bytes([int(m.group(1), 16)])
        table = _unicode_to_byte()
        if _byte_level(tokenizer) and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
    return tokenizer.decode([token_id]).encode()


def token_logprobs(tokenizer: Any, gen: Generation) -> list[dict]:
    """Chat `choices[0].logprobs.content`: one entry per served token; `bytes` its raw bytes."""
    out = []
    for t, lp in zip(gen.token_ids, gen.logprobs):
        s = tokenizer.decode([t])
        out.append({"token": s, "logprob": lp, "bytes": list(token_bytes(tokenizer, t)), "top_logprobs": []})
    return out


def completion_logprobs(tokenizer: Any, gen: Generation) -> dict:
    """Legacy completions' `choices[0].logprobs`: tokens, their log-probs and text offsets
    (offset_i = sum of len(token_j) for j < i)."""
    toks = [tokenizer.decode([t]) for t in gen.token_ids]
    offsets, pos = [], 0
    for s in toks:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": toks, "token_logprobs": gen.logprobs, "top_logprobs": [{} for _ in toks], "text_offset": offsets}


def usage(n_prompt: int, n_completion: int) -> dict:
    """OpenAI's `usage`: total = prompt + completion tokens."""
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def token_pieces(tokenizer: Any, gen: Generation, text: str) -> Iterator[tuple[str, int, int]]:
    """The visible text split per served token, lazily, as (piece, start, end): the piece is what
    tokens [start, end) add (the non-empty pieces join to `text`; consecutive ranges, from 0). Tokens
    after the last piece (an EOS, a tool call cut from `text`) belong to none."""
    prev, start = "", 0
    for i in range(1, len(gen.token_ids) + 1):
        cur = tokenizer.decode(gen.token_ids[:i], skip_special_tokens=True)
        if cur.endswith("\ufffd") or not text.startswith(cur) or len(cur) <= len(prev):
            continue
        yield cur[len(prev) :], start, i
        prev, start = cur, i
    if prev != text:
        yield text[len(prev) :], start, len(gen.token_ids)


def text_pieces(tokenizer: Any, gen: Generation, text: str) -> Iterator[str]:
    """The visible text split per served token, lazily (the non-empty pieces join to `text`)."""
    return (piece for piece, _, _ in token_pieces(tokenizer, gen, text))


def piece_choices(
    pieces: Iterable[tuple[str, int, int]],
    choice: Callable[[str], dict],
    logprobs: Callable[[int, int], dict] | None,
    n_tokens: int,
    final: dict,
) -> Iterator[dict]:
    """A stream's choice per text piece (`token_pieces`), each carrying its tokens' log-probs
    (`logprobs(start, end)`) when asked. The tokens no piece carries (an EOS, a tool call's) go on
    `final`, the choice sent after these: the stream carries every served token's log-prob once, in
    order, as the non-streaming answer does."""
    end = 0
    for piece, start, end in pieces:
        out = choice(piece)
        if logprobs is not None:
            out["logprobs"] = logprobs(start, end)
        yield out
    if logprobs is not None and end < n_tokens:
        final["logprobs"] = logprobs(end, n_tokens)


def sse_chunk(head: dict, choice: dict | None = None, **more: Any) -> bytes:
    """One SSE frame `data: <json>\\n\\n`: the stream's `head` (id, object, created, model), then
    `choices` (`choice` at index 0, its `logprobs` null unless it carries them; empty when `choice`
    is None, as in the usage chunk), then `more` (e.g. `areal`, `usage`)."""
    choices = [] if choice is None else [{"index": 0, "logprobs": None, **choice}]
    return b"data: " + json.dumps({**head, "choices": choices, **more}).encode() + b"\n\n"


async def sse_stream(
    head: dict, choices: Iterable[dict], final: dict, areal: dict, usage: dict | None
) -> AsyncIterator[bytes]:
    """A whole stream: one chunk per choice, the final chunk (with `finish_reason` and
    `areal`), a usage chunk when `usage` is given, then `[DONE]`."""
    for choice in choices:
        yield sse_chunk(head, choice)
    yield sse_chunk(head, final, areal=areal)
    if usage is not None:
        yield sse_chunk(head, usage=usage)
    yield SSE_DONE
