"""Request and response models of the proxy (they make its OpenAPI description)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

SESSION_ID_RULE = "1-128 of [A-Za-z0-9._:-], not '.' or '..' (the manager refuses any other: 400 invalid_session_id)"


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ImageUrl(_Lenient):
    url: str = Field(description="a data URI, data:image/png;base64,... or data:image/jpeg;base64,... (no fetch)")
    detail: str | None = None  # accepted and ignored: the model's image processor decides the resolution


class ContentPart(_Lenient):
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None  # type "image_url": a vision-language model only (proxy/images.py)


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionSpec(_Lenient):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionName(_Lenient):
    name: str = Field(min_length=1, max_length=128)


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(_Lenient):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]] = Field(min_length=1)


class AllowedToolsChoice(_Lenient):
    """OpenAI's `{"type": "allowed_tools", ...}`: refused as unsupported (proxy/options.py)."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class ResponseFormat(_Lenient):
    """OpenAI's response_format; only "text" is served (proxy/options.py refuses the others: the
    decoder cannot constrain its output to JSON)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class SamplingFields(_Lenient):
    """The fields a chat and a text completion share: the model and how to sample."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    user: str | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: at most 4 non-empty strings")
        return stops


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)


# A reward is training data: a JSON number only (strict: no "1.0" string, no true read as 1.0).
class RewardRequest(_Lenient):
    reward: float = Field(allow_inf_nan=False, strict=True, description="a JSON number (not a string or boolean)")
    turn: int | None = Field(default=None, ge=0, strict=True, description="0-based turn index (an integer)")
    completion_id: str | None = Field(default=None, max_length=256)


class EndRequest(_Lenient):
    reward: float | None = Field(default=None, allow_inf_nan=False, strict=True)
    discount: float | None = Field(default=None, ge=0.0, le=1.0)
    group_id: str | None = Field(default=None, max_length=256)
    prompt_id: str = Field(default="", max_length=256)
    meta: dict[str, Any] | None = None
    return_trajectory: bool = False


class NewSessionRequest(_Lenient):
    session_id: str | None = Field(default=None, description=SESSION_ID_RULE)


# Response schemas: documentation for clients in other languages (handlers return plain dicts).
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ArealTiming(BaseModel):
    queue_s: float = Field(description="time waiting for the engine thread")
    engine_s: float = Field(description="the batched generate() call this request ran in")
    batch_size: int
    server_s: float = Field(description="from the request's arrival to the response being built")


class ArealExtra(BaseModel):
    """What was served, token by token: the record the trajectory is built from."""

    session_id: str
    turn: int = Field(description="index of this completion in the session")
    segment: int = Field(description="which trajectory row of the session this turn extends")
    prompt_token_ids: list[int] = Field(description="the whole prompt the engine was fed")
    token_ids: list[int] = Field(description="the served token ids (EOS included when generated)")
    logprobs: list[float] = Field(description="behaviour log-prob of each served token")
    versions: list[int] = Field(description="policy version that produced each served token")
    policy_version: int
    model_version: str | None = Field(
        default=None,
        description="what the version of the last served token holds when the proxy follows a source "
        "(models:/NAME/N, RUN/weights/vN, a folder); null otherwise",
    )
    timing: ArealTiming
    session_ended: bool = Field(
        default=False,
        description="this turn reached a cap of the key's implicit session: it was ended (its rows "
        "written) and the key's next request starts a fresh one under the same id",
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: dict[str, Any] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    areal: ArealExtra


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: dict[str, Any] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    areal: ArealExtra


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    areal: dict[str, int]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class SessionCreated(BaseModel):
    session_id: str
    header: str = "X-Session-Id"


class TurnInfo(BaseModel):
    turn: int
    completion_id: str
    segment: int
    finish_reason: str
    completion_tokens: int
    tool_calls: int
    reward: float | None


class SegmentInfo(BaseModel):
    segment: int
    kind: Literal["chat", "text"]
    num_tokens: int
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    behav_logprobs: list[float] | None = None
    versions: list[int] | None = None


class SessionInfo(BaseModel):
    session_id: str
    created: float
    updated: float
    ended: bool
    final_reward: float | None
    turns: list[TurnInfo]
    segments: list[SegmentInfo]


class RewardApplied(BaseModel):
    session_id: str
    reward: float
    applied_to: str = Field(description='"turn N" or "final"')


class RowInfo(BaseModel):
    sample_id: str
    num_tokens: int
    num_turns: int
    reward: float | None


class Trajectory(BaseModel):
    sample_id: str
    input_ids: list[int]
    prompt_len: int
    loss_mask: list[int]
    behav_logprobs: list[float]
    versions: list[int]
    reward: float | None
    token_rewards: list[float] | None
    image_ids: list[str] | None = Field(default=None, description="the row's images by sha256 (Layout.image)")


class SessionEnded(BaseModel):
    session_id: str
    turns: int
    rows: list[RowInfo]
    shards: list[str] = Field(description="store objects written (online mode)")
    trajectories: list[Trajectory] | None = None
