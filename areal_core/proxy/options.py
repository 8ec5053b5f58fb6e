"""Request options the proxy cannot honour are refused, never ignored: an ignored option returns a
completion the client did not ask for (plain text for a JSON schema, no tool call for
tool_choice "required", empty top log-probs) and, in training, records it as if it had.

Each check raises a 400 `ProxyError` whose code names the option (`unsupported_*`), or a 400 for a
combination OpenAI refuses too (top_logprobs without logprobs, a tool_choice naming no tool).
The engines sample from temperature, top-p and top-k only and return the sampled token's log-prob
only, so penalties, logit_bias and top-k alternatives cannot be served.
"""

from __future__ import annotations

from typing import Any

from areal_core.proxy.guard import ProxyError
from areal_core.proxy.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields


def check_n(req: SamplingFields) -> None:
    if req.n != 1:
        raise ProxyError(400, "n > 1 is not supported: send one request per sample", "unsupported_n")


def check_sampling(req: SamplingFields, forced: bool) -> None:
    """Penalties and logit_bias change the sampling distribution, which the engines cannot do. With
    forced sampling (training) the request's sampling options are all ignored by design, these too."""
    if forced:
        return
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name):
            msg = f"{name} is not supported (only 0 or absent): the engine does not apply it"
            raise ProxyError(400, msg, "unsupported_penalty")
    if req.logit_bias:
        raise ProxyError(400, "logit_bias is not supported (only {} or absent)", "unsupported_logit_bias")


def check_chat_logprobs(logprobs: bool | None, top_logprobs: int | None) -> None:
    """top_logprobs needs logprobs: true (as OpenAI answers); only 0 alternatives can be served."""
    if top_logprobs is None:
        return
    if not logprobs:
        raise ProxyError(400, "top_logprobs needs logprobs set to true", "invalid_top_logprobs")
    if top_logprobs > 0:
        raise ProxyError(
            400,
            "top_logprobs > 0 is not supported: the engine returns the sampled token's log-prob only "
            "(logprobs: true gives it; top_logprobs: 0 or absent)",
            "unsupported_top_logprobs",
        )


def check_response_format(fmt: Any) -> None:
    if fmt is not None and fmt.type != "text":
        raise ProxyError(
            400,
            f"response_format {fmt.type!r} is not supported: the decoder cannot constrain its output "
            '(only {"type": "text"})',
            "unsupported_response_format",
        )


def check_tool_choice(choice: Any, tools: list[Any] | None, forced: bool = False) -> None:
    """ "none" and "auto" are served; "required", a named function and allowed_tools need tools
    (else 400) and a decoder that forces or limits calls, which this one is not (400
    `unsupported_tool_choice`). With forced sampling (training) a valid one is ignored, as the
    request's other sampling options are: the agent's episode runs and the policy decides."""
    if choice is None or choice in ("none", "auto"):
        return
    names = {t.function.name for t in tools or []}
    if not names:
        raise ProxyError(400, f"tool_choice {_label(choice)} needs tools", "invalid_tool_choice")
    if getattr(choice, "type", "") == "function" and choice.function.name not in names:
        name = choice.function.name
        raise ProxyError(400, f"tool_choice names function {name!r}, which is not in tools", "invalid_tool_choice")
    if forced:
        return
    raise ProxyError(
        400,
        f'tool_choice {_label(choice)} is not supported: the decoder cannot force a tool call (use "auto" or "none")',
        "unsupported_tool_choice",
    )


def _label(choice: Any) -> str:
    if isinstance(choice, str):
        return repr(choice)
    return f"function {choice.function.name!r}" if choice.type == "function" else repr(choice.type)


def check_chat(req: ChatCompletionRequest, forced: bool) -> None:
    """Every refusal of a chat request's options, before any session opens."""
    check_n(req)
    check_sampling(req, forced)
    check_chat_logprobs(req.logprobs, req.top_logprobs)
    check_response_format(req.response_format)
    check_tool_choice(req.tool_choice, req.tools, forced)


def check_completion(req: CompletionRequest, forced: bool) -> None:
    """Every refusal of a completions request's options, before any session opens."""
    check_n(req)
    check_sampling(req, forced)
    if req.echo:
        raise ProxyError(400, "echo is not supported", "unsupported_echo")
    if req.suffix:
        msg = "suffix is not supported (insertion needs a fill-in-the-middle model)"
        raise ProxyError(400, msg, "unsupported_suffix")
    if req.best_of is not None and req.best_of > 1:
        raise ProxyError(400, "best_of > 1 is not supported: send one request per sample", "unsupported_best_of")
    if req.logprobs:
        raise ProxyError(
            400,
            "logprobs > 0 is not supported: the engine returns the sampled token's log-prob only "
            "(logprobs: 0 gives tokens and token_logprobs)",
            "unsupported_top_logprobs",
        )
