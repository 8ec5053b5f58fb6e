"""Chat rendering through the model's own chat template (`tokenizer.apply_chat_template`).

Messages arrive in OpenAI shape; `hf_message` maps each to the shape HF chat templates read
(role aliases, text content, tool calls whose arguments are JSON objects). Every render passes
`sanitize_control_tokens=True`, so a control token typed inside a message (`<|im_end|>` in a
user's text) is encoded as text and cannot forge a turn.

Multi-turn episodes store exactly the served token ids. A turn's prompt is never re-tokenised:
it is the previous turn's tokens (its prompt and the ids the model produced), then the tokens
that close that assistant message, then the delta of the new messages, rendered the way verl
and SGLang do:

    delta = render(history + new, generation prompt)[len(render(history)):]

where `history` ends with the served assistant message. A template that renders the earlier
turns differently once more follow (render(history) is not a prefix) is refused with a
TemplateError. The closing tokens are probed once from the template: what it writes after an
assistant message's content (`<|im_end|>\\n` for ChatML), less the end token when the model
produced it.

Tools. A template that renders `tools` and assistant `tool_calls` itself (probed) gets them as
is: the tiny model's ChatML template (areal_core.models.CHAT_TEMPLATE) writes a `# Tools` system
message and `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the Qwen2 convention.
A template that ignores them (SmolLM2's) gets SmolLM2's documented tool format spelled into the
messages (HF SmolLM2-1.7B-Instruct model card; Ollama's smollm2 template): a system message
listing the tools in `<tools>[...]</tools>` and asking for `<tool_call>[{"name": ...,
"arguments": {...}}]</tool_call>`; assistant tool calls written that way; tool results as
user messages `<tool_response>\\n...\\n</tool_response>`. `parse_tool_calls` reads both forms:
a `<tool_call>` block holding a JSON object or a JSON list of objects.

Images (a VLM: `tokenizer` is its VisionProcessor). A user message's `image_url` parts become the
template's `{"type": "image"}` parts, so the prompt holds one `<|image_pad|>` per image (expanded
to its patches by proxy/images.py); a message's fingerprint names each image by the sha256 of
its URL. A text model's template gets text only (`content_text`).

tool_prompt: how a request's `tools` reach the template: "full" (as given), "names" (names
only) or "none" (not shown: the model learnt its tools in training).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import jinja2

from areal_core.proxy import strictjson
from areal_core.vlm_processor import VisionProcessor

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
ROLE_ALIASES = {"developer": "system", "function": "tool"}
ROLES = ("system", "user", "assistant", "tool")
SMOLLM2_TOOLS_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, point it out and refuse to answer.\n"
    "If the given question lacks the parameters required by the function, also point it out.\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. If no function call is "
    "needed, please make the tool calls an empty list '[]'.\n"
    '<tool_call>[\n{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n'
    "... (more tool calls as required)\n]</tool_call>"
)
_PROBE_FN, _PROBE_CALL, _PROBE_TEXT = "areal_probe_function", "areal_probe_call", "areal-probe-content"


class TemplateError(ValueError):
    """A conversation the template cannot render (the server answers 400 with this message and `code`)."""

    code = "invalid_messages"


def content_text(content: Any) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind, text = _get(part, "type"), _get(part, "text")
            if kind != "text":
                raise TemplateError(f"only text content parts are supported, got type {kind!r}")
            if not isinstance(text, str):
                raise TemplateError('a content part of type "text" needs a string "text" field')
            parts.append(text)
        return "".join(parts)
    raise TemplateError(f"unsupported content of type {type(content).__name__}")


def image_parts(content: Any) -> list[Any]:
    """The `image_url` parts of a message's content (none for a string)."""
    return [p for p in content if _get(p, "type") == "image_url"] if isinstance(content, list) else []


def url_of(part: Any) -> str | None:
    url = _get(_get(part, "image_url"), "url")
    return url if isinstance(url, str) else None


def content_key(content: Any) -> Any:
    """What a message's content says, for its fingerprint: its text, or with images each part in
    order, an image as the sha256 of its URL (the same image resent matches, another does not)."""
    if not image_parts(content):
        return content_text(content)
    return tuple(
        ("image", hashlib.sha256((url_of(p) or "").encode()).hexdigest())
        if _get(p, "type") == "image_url"
        else ("text", _get(p, "text"))
        for p in content
    )


def vision_parts(content: Any) -> list[dict[str, Any]]:
    """Content with images in the shape VLM chat templates read (Qwen2.5-VL's, VL_CHAT_TEMPLATE): an
    `{"type": "image"}` part per image (the template writes its vision placeholder), text parts as is."""
    parts: list[dict[str, Any]] = []
    for part in content:
        kind, text = _get(part, "type"), _get(part, "text")
        if kind == "image_url":
            parts.append({"type": "image"})
        elif kind == "text" and isinstance(text, str):
            parts.append({"type": "text", "text": text})
        else:
            raise TemplateError(f"only text and image_url content parts are supported, got type {kind!r}")
    return parts


def _arguments_obj(arguments: Any) -> Any:
    """Tool-call arguments as a JSON value (clients send a JSON string; some re-serialise it). Text
    that strict JSON does not take (not JSON; nested too deeply, a lone surrogate escape, a number
    past int64 or float64, NaN) stays the text the client sent: json.loads would hand the template
    a value that fails it with a 500 (a RecursionError, the tokenizer's TypeError on a surrogate),
    while the text itself renders as it is (a call from history, e.g. another model's, is served)."""
    if not isinstance(arguments, str):
        return arguments
    if not arguments.strip():
        return {}
    try:
        return strictjson.loads(arguments)
    except ValueError:
        return arguments


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _role(message: Any) -> str:
    role = _get(message, "role")
    role = ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        raise TemplateError(f"unsupported role {role!r}")
    return role


def fingerprint(message: Any) -> tuple:
    """What a message says, as a hashable tuple, used to match a request's history to a session.

    Tool-call ids are left out, and arguments are compared as parsed JSON, because clients
    (LangChain) rebuild them; the text, roles, tool names and arguments must be equal.
    """
    calls = []
    for call in _get(message, "tool_calls") or []:
        fn = _get(call, "function") or {}
        calls.append((_get(fn, "name"), json.dumps(_arguments_obj(_get(fn, "arguments")), sort_keys=True)))
    return (
        _role(message),
        content_key(_get(message, "content")),
        _get(message, "name") or "",
        _get(message, "tool_call_id") or "",
        tuple(calls),
    )


def hf_message(message: Any, images: bool = False) -> dict[str, Any]:
    """An OpenAI-shaped message (dict or pydantic) in the shape HF chat templates read; with
    `images` (a VLM's template) image parts become the template's image parts."""
    role = _role(message)
    content = _get(message, "content")
    shown = vision_parts(content) if images and image_parts(content) else content_text(content)
    out: dict[str, Any] = {"role": role, "content": shown}
    calls = _get(message, "tool_calls") or []
    if role == "assistant" and calls:
        out["tool_calls"] = []
        for k, call in enumerate(calls):
            fn = _get(call, "function") or {}
            out["tool_calls"].append(
                {
                    "id": _get(call, "id") or f"call_{k}",
                    "type": "function",
                    "function": {"name": _get(fn, "name"), "arguments": _arguments_obj(_get(fn, "arguments"))},
                }
            )
    for name in ("tool_call_id", "name"):
        if role == "tool" and _get(message, name):
            out[name] = _get(message, name)
    return out


def hf_tools(tools: list[Any] | None, mode: str = "full") -> list[dict[str, Any]] | None:
    """OpenAI tool specs as {"type": "function", "function": {name, description, parameters}}
    (unset fields dropped); mode "names" keeps the names only, "none" gives None."""
    if not tools or mode == "none":
        return None
    out = []
    for t in tools:
        fn = _get(t, "function") or {}
        fields = ("name",) if mode == "names" else ("name", "description", "parameters")
        out.append({"type": "function", "function": {f: _get(fn, f) for f in fields if _get(fn, f) is not None}})
    return out


def tool_call_text(name: str, arguments: Any) -> str:
    """One call in the Qwen2 convention, as the tiny model's template writes it."""
    return TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": _arguments_obj(arguments)}) + TOOL_CALL_CLOSE


def spell_smollm2_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """SmolLM2's documented tool format written into plain messages (see the module docstring),
    for a template that renders neither `tools` nor `tool_calls`."""
    out: list[dict[str, Any]] = []
    if tools:
        specs = json.dumps([t["function"] for t in tools])
        system = SMOLLM2_TOOLS_PROMPT.format(tools=specs)
        if messages and messages[0]["role"] == "system":
            system += "\n\n" + messages[0]["content"]
            messages = messages[1:]
        out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = ",\n".join(
                json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                for c in m["tool_calls"]
            )
            out.append(
                {"role": "assistant", "content": f"{m['content']}{TOOL_CALL_OPEN}[\n{calls}\n]{TOOL_CALL_CLOSE}"}
            )
        else:
            out.append(m)
    return out


@dataclass
class ParsedOutput:
    content: str | None  # the text outside tool-call blocks; None when empty and tools were called
    tool_calls: list[dict[str, Any]]  # OpenAI shape: {id, type: "function", function: {name, arguments}}


def parse_tool_calls(text: str, id_prefix: str | None = None) -> ParsedOutput:
    """Split the model's text into content and OpenAI tool calls (see the module docstring).

    A block whose body is not a (strict: strictjson.py) JSON object with a string "name", or a list
    of such objects, stays in the content as text.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    prefix = id_prefix or f"call_{uuid.uuid4().hex[:12]}"
    for m in _TOOL_CALL_RE.finditer(text):
        try:  # strict, as a client's arguments are: the call is sent back in the next request
            body = strictjson.loads(m.group(1))
        except ValueError:
            continue
        items = body if isinstance(body, list) else [body]
        if not items or not all(isinstance(b, dict) and isinstance(b.get("name"), str) for b in items):
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        for b in items:
            args = b.get("arguments", {})
            calls.append(
                {
                    "id": f"{prefix}_{len(calls)}",
                    "type": "function",
                    "function": {"name": b["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
                }
            )
    kept.append(text[pos:])
    if not calls:
        return ParsedOutput(text, [])
    rest = "".join(kept).strip()
    return ParsedOutput(rest or None, calls)


class ChatTemplate:
    """The tokenizer's chat template, rendered whole (first turn) or as a delta (later turns)."""

    def __init__(self, tokenizer: Any, tool_prompt: str = "full"):
        if tool_prompt not in ("full", "names", "none"):
            raise ValueError(f"tool_prompt must be full, names or none, got {tool_prompt!r}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        # a VLM's processor: image parts render as its vision placeholders (proxy/images.py expands
        # them); its text tokenizer renders and encodes (the processor's own encode takes images)
        self.vision = tokenizer if isinstance(tokenizer, VisionProcessor) else None
        self.tokenizer = tokenizer.tokenizer if self.vision is not None else tokenizer
        self.tool_prompt = tool_prompt
        self.eos_id = tokenizer.eos_token_id
        self.native_tools = self._probe_native_tools()
        user = [{"role": "user", "content": "u"}]
        self.generation_prompt_ids = self._suffix(self.render(user), self.render(user, generation_prompt=True))
        probe = self._render_text([*user, {"role": "assistant", "content": _PROBE_TEXT}], None, False)
        if _PROBE_TEXT not in probe:
            raise ValueError("the chat template does not write an assistant message's content")
        self.close_text = probe[probe.rindex(_PROBE_TEXT) + len(_PROBE_TEXT) :]
        self.close_without_eos = self.encode(self.close_text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _probe_native_tools(self) -> bool:
        """Whether the template writes `tools` and assistant `tool_calls` itself."""
        user = {"role": "user", "content": "u"}
        call = {"id": "c0", "type": "function", "function": {"name": _PROBE_CALL, "arguments": {}}}
        try:
            shown = self._render_text([user], [{"type": "function", "function": {"name": _PROBE_FN}}], False, True)
            called = self._render_text(
                [user, {"role": "assistant", "content": "", "tool_calls": [call]}], None, False, True
            )
        except Exception:  # noqa: BLE001 - a template that fails on tools does not support them
            return False
        return _PROBE_FN in shown and _PROBE_CALL in called

    def _prepare(self, messages: list[Any], tools: list[Any] | None, native: bool | None = None):
        """(messages, tools) for apply_chat_template; `native` set: a probe (tools shown whole)."""
        msgs = [hf_message(m, images=self.vision is not None) for m in messages]
        specs = hf_tools(tools, "full" if native is not None else self.tool_prompt)
        if native if native is not None else self.native_tools:
            return msgs, specs
        return spell_smollm2_tools(msgs, specs), None

    def _apply(self, messages, tools, generation_prompt: bool, tokenize: bool) -> Any:
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=generation_prompt,
                tokenize=tokenize,
                return_dict=False,
                sanitize_control_tokens=tokenize,
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template refused the conversation: {exc}") from None
        except RecursionError:  # a value nested deeper than the template's recursion can render
            raise TemplateError("the conversation is nested too deeply for the chat template to render") from None

    def _render_text(self, messages: list[Any], tools, generation_prompt: bool, native: bool | None = None) -> str:
        return self._apply(*self._prepare(messages, tools, native), generation_prompt, tokenize=False)

    def render(self, messages: list[Any], tools: list[Any] | None = None, generation_prompt: bool = False) -> list[int]:
        """Token ids of the whole conversation, as `apply_chat_template` gives them."""
        return list(self._apply(*self._prepare(messages, tools), generation_prompt, tokenize=True))

    @staticmethod
    def _suffix(prefix: list[int], whole: list[int]) -> list[int]:
        if whole[: len(prefix)] != prefix:
            raise TemplateError(
                "the chat template renders the earlier turns differently once new messages follow, so the "
                "served tokens cannot be kept; start a new conversation"
            )
        return whole[len(prefix) :]

    def delta(self, history: list[Any], new: list[Any], tools: list[Any] | None = None) -> list[int]:
        """The tokens the new messages and the generation prompt add after `history` (which ends
        with an assistant message): render(history + new, generation prompt) less render(history)."""
        return self._suffix(self.render(history, tools), self.render([*history, *new], tools, True))

    def close_ids(self, served: list[int]) -> list[int]:
        """Tokens that end an assistant message whose last served token is `served[-1]`."""
        close = self.close_without_eos
        if served and close and served[-1] == close[0]:
            return close[1:]
        return list(close)

    def assistant_ids(self, history: list[Any], message: Any, tools: list[Any] | None = None) -> list[int]:
        """The ids of an assistant message as the template writes it after `history`: what a
        model that follows its template serves (content and tool calls, then the end token)."""
        head = self._render_text(history, tools, True)
        whole = self._render_text([*history, message], tools, False)
        if not whole.startswith(head) or not whole.endswith(self.close_text):
            raise TemplateError("the chat template does not write an assistant message after its generation prompt")
        body = self.encode(whole[len(head) : len(whole) - len(self.close_text)])
        close = self.close_without_eos
        return body + close[:1] if close and close[0] == self.eos_id else body

    def episode(self, messages: list[Any], tools: list[Any] | None = None) -> tuple[list[int], list[int]]:
        """(token ids, loss mask) of a whole conversation as the proxy stores it when each
        assistant message was served as the template writes it (mask 1 on those tokens)."""
        ids: list[int] = []
        mask: list[int] = []
        done = 0  # messages consumed so far
        for k, m in enumerate(messages):
            if _role(m) != "assistant":
                continue
            if done:
                fed = self.close_ids(ids) + self.delta(messages[:done], messages[done:k], tools)
            else:
                fed = self.render(messages[:k], tools, True)
            served = self.assistant_ids(messages[:k], m, tools)
            ids += fed + served
            mask += [0] * len(fed) + [1] * len(served)
            done = k + 1
        return ids, mask
