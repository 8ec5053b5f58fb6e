"""Incremental chat templating: render only the messages that are new, so earlier turns keep
the exact token ids that were fed and served.

The template is ChatML, the one `areal_core.models.CHAT_TEMPLATE` declares:

    <|im_start|>{role}\\n{content}<|im_end|>\\n        one message
    <|im_start|>assistant\\n                          the generation prompt

A turn's prompt is never re-tokenised from text. It is the previous turn's tokens (its prompt
and the token ids the model produced), then the tokens that close that assistant message
(`\\n` after a produced `<|im_end|>`, or `<|im_end|>\\n` when it stopped on length or a stop
string), then each new message rendered and tokenised on its own, then the generation prompt.
Every piece starts and ends at a special token or a newline, so the concatenation equals
what tokenising the whole conversation at once gives (a test checks this).

Tool-call convention (for models without a native tool format, e.g. the tiny model):
the model writes `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`; the server parses
each such block into an OpenAI `tool_calls` entry. Tool results come back as `role: "tool"`
messages and are rendered as `<|im_start|>tool\\n{content}<|im_end|>\\n`. An assistant message in
the history that the server did not serve is rendered with its tool calls in the same form.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
ROLE_ALIASES = {"developer": "system", "function": "tool"}


class TemplateError(ValueError):
    """A message the template cannot render (the server answers 400 with this message)."""


def content_text(content: Any) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                kind, text = part.get("type"), part.get("text")
            else:
                kind, text = getattr(part, "type", None), getattr(part, "text", None)
            if kind != "text" or not isinstance(text, str):
                raise TemplateError(f"only text content parts are supported, got type {kind!r}")
            parts.append(text)
        return "".join(parts)
    raise TemplateError(f"unsupported content of type {type(content).__name__}")


def _arguments_obj(arguments: Any) -> Any:
    """Tool-call arguments as a JSON value (clients send a JSON string; some re-serialise it)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return arguments


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def canonical(message: Any) -> tuple:
    """A hashable key of what a message says, used to match a request's history to a session.

    Tool-call ids are left out, and arguments are compared as parsed JSON, because clients
    (LangChain) rebuild them; the text, roles, tool names and arguments must be equal.
    """
    role = ROLE_ALIASES.get(_get(message, "role"), _get(message, "role"))
    calls = []
    for call in _get(message, "tool_calls") or []:
        fn = _get(call, "function") or {}
        calls.append((_get(fn, "name"), json.dumps(_arguments_obj(_get(fn, "arguments")), sort_keys=True)))
    return (
        role,
        content_text(_get(message, "content")),
        _get(message, "name") or "",
        _get(message, "tool_call_id") or "",
        tuple(calls),
    )


def tool_call_text(name: str, arguments: Any) -> str:
    return TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": _arguments_obj(arguments)}) + TOOL_CALL_CLOSE


@dataclass
class ParsedOutput:
    content: str | None  # the text outside tool-call blocks; None when empty and tools were called
    tool_calls: list[dict[str, Any]]  # OpenAI shape: {id, type: "function", function: {name, arguments}}


def parse_tool_calls(text: str, id_prefix: str | None = None) -> ParsedOutput:
    """Split the model's text into content and OpenAI tool calls (see the module docstring).

    A block whose body is not a JSON object with a string "name" stays in the content as text.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    prefix = id_prefix or f"call_{uuid.uuid4().hex[:12]}"
    for m in _TOOL_CALL_RE.finditer(text):
        try:
            body = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        args = body.get("arguments", {})
        calls.append(
            {
                "id": f"{prefix}_{len(calls)}",
                "type": "function",
                "function": {"name": body["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    kept.append(text[pos:])
    if not calls:
        return ParsedOutput(text, [])
    rest = "".join(kept).strip()
    return ParsedOutput(rest or None, calls)


class ChatMLTemplate:
    """ChatML rendering of single messages, tokenised piece by piece.

    tool_prompt: how a request's `tools` are shown to the model at the start of an episode:
    "full" (a system message with the convention and the JSON tool specs), "names" (one line
    with the tool names) or "none" (nothing: the model learnt its tools in training).
    """

    def __init__(self, tokenizer: Any, tool_prompt: str = "full"):
        if tool_prompt not in ("full", "names", "none"):
            raise ValueError(f"tool_prompt must be full, names or none, got {tool_prompt!r}")
        self.tokenizer = tokenizer
        self.tool_prompt = tool_prompt
        self.eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._cache: dict[str, list[int]] = {}
        self.generation_prompt_ids = self.encode("<|im_start|>assistant\n")
        self.close_after_eos = self.encode("\n")
        self.close_without_eos = self.encode("<|im_end|>\n")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_cached(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = self.encode(text)
            if len(self._cache) < 4096:
                self._cache[text] = ids
        return list(ids)

    def render_message(self, message: Any) -> str:
        role = ROLE_ALIASES.get(_get(message, "role"), _get(message, "role"))
        if role not in ("system", "user", "assistant", "tool"):
            raise TemplateError(f"unsupported role {role!r}")
        text = content_text(_get(message, "content"))
        if role == "assistant":
            for call in _get(message, "tool_calls") or []:
                fn = _get(call, "function") or {}
                text += tool_call_text(_get(fn, "name"), _get(fn, "arguments"))
        return f"<|im_start|>{role}\n{text}<|im_end|>\n"

    def message_ids(self, message: Any) -> list[int]:
        return self.encode(self.render_message(message))

    def tools_text(self, tools: list[Any] | None) -> str | None:
        if not tools or self.tool_prompt == "none":
            return None
        specs = []
        for t in tools:
            fn = _get(t, "function") or {}
            specs.append(
                {
                    k: v
                    for k, v in (
                        ("name", _get(fn, "name")),
                        ("description", _get(fn, "description")),
                        ("parameters", _get(fn, "parameters")),
                    )
                    if v is not None
                }
            )
        if self.tool_prompt == "names":
            body = "tools: " + ", ".join(s["name"] for s in specs)
        else:
            body = (
                "# Tools\nTo call a tool, write "
                + TOOL_CALL_OPEN
                + '{"name": <tool name>, "arguments": <JSON object>}'
                + TOOL_CALL_CLOSE
                + ". Available tools:\n"
                + "\n".join(json.dumps(s) for s in specs)
            )
        return f"<|im_start|>system\n{body}<|im_end|>\n"

    def tools_ids(self, tools: list[Any] | None) -> list[int]:
        text = self.tools_text(tools)
        return self.encode_cached(text) if text else []

    def close_ids(self, served: list[int]) -> list[int]:
        """Tokens that end an assistant message whose last served token is `served[-1]`."""
        if served and served[-1] == self.eos_id:
            return list(self.close_after_eos)
        return list(self.close_without_eos)
