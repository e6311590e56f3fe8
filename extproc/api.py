"""The OpenAI request shapes the gateway understands, and OpenAI-style error bodies.

Requests are validated strictly (an ill-typed known field is a 400 naming its ``param``) but unknown
top-level fields pass through untouched: vLLM accepts many extensions (``top_k``, ``min_p``,
``guided_json``...) that a gateway in front of it must not drop.
Shapes follow the OpenAI API reference for ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/embeddings``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# ---------------------------------------------------------------------------------------------
# Errors


@dataclass(frozen=True, slots=True)
class ApiError(Exception):
    """An error the client sees as ``{"error": {"message", "type", "param", "code"}}``."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> bytes:
        """The JSON body OpenAI's API returns for this error."""
        return orjson.dumps(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        )


def invalid_json(detail: str) -> ApiError:
    """400: the body is not a JSON object."""
    return ApiError(400, f"We could not parse the JSON body of your request: {detail}", code="invalid_json")


# ---------------------------------------------------------------------------------------------
# Request models


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class TextPart(_Part):
    """``{"type": "text", "text": ...}``."""

    type: Literal["text"]
    text: str


class ImageUrl(_Part):
    """The ``image_url`` object of an image content part."""

    url: str
    detail: Literal["auto", "low", "high"] = "auto"


class ImagePart(_Part):
    """``{"type": "image_url", "image_url": {"url", "detail"}}``."""

    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(_Part):
    """The ``input_audio`` object: base64 ``data`` and its ``format``."""

    data: str
    format: Literal["wav", "mp3"]


class AudioPart(_Part):
    """``{"type": "input_audio", "input_audio": {"data", "format"}}``."""

    type: Literal["input_audio"]
    input_audio: InputAudio


class RefusalPart(_Part):
    """An assistant message's ``{"type": "refusal", "refusal": ...}`` part."""

    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[TextPart | ImagePart | AudioPart | RefusalPart, Field(discriminator="type")]
Content = str | list[ContentPart]


class FunctionCall(_Part):
    """A function call an assistant made: ``name`` and JSON-encoded ``arguments``."""

    name: str
    arguments: str


class ToolCall(_Part):
    """An entry of an assistant message's ``tool_calls``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Part):
    """``role: system`` (or ``developer``, its newer name)."""

    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Part):
    """``role: user``: text or multimodal parts."""

    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Part):
    """``role: assistant``: content may be null when it carries tool calls."""

    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(_Part):
    """``role: tool``: the result of a tool call."""

    role: Literal["tool"]
    content: Content
    tool_call_id: str


class FunctionMessage(_Part):
    """``role: function`` (deprecated by OpenAI, still accepted)."""

    role: Literal["function"]
    content: str | None
    name: str


Message = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage,
    Field(discriminator="role"),
]


class FunctionDefinition(_Part):
    """A tool's ``function``: name, description and JSON-schema ``parameters``."""

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Part):
    """``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Part):
    """``{"name": ...}`` inside a named tool choice."""

    name: str


class NamedToolChoice(_Part):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchema(_Part):
    """``response_format.json_schema``."""

    name: Annotated[str, Field(min_length=1, max_length=64)]
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextFormat(_Part):
    """``response_format: {"type": "text"}``."""

    type: Literal["text"]


class JsonObjectFormat(_Part):
    """``response_format: {"type": "json_object"}``."""

    type: Literal["json_object"]


class JsonSchemaFormat(_Part):
    """``response_format: {"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StreamOptions(_Part):
    """``stream_options``: ``include_usage`` asks for a final usage chunk."""

    include_usage: bool | None = None


Temperature = Annotated[float, Field(ge=0, le=2)]
Probability = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
PositiveInt = Annotated[int, Field(ge=1)]
Stop = str | list[str]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    model: Annotated[str, Field(min_length=1)]
    user: str | None = None


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    stop: Stop | None = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise _ParamError("stream_options", "stream_options is only allowed when stream is true")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise _ParamError("tool_choice", "tool_choice is only allowed when tools are specified")
        return self

    @property
    def output_limit(self) -> int | None:
        """The client's cap on generated tokens (``max_completion_tokens`` supersedes ``max_tokens``)."""
        return self.max_completion_tokens or self.max_tokens


TokenIds = list[Annotated[int, Field(ge=0)]]
Prompt = str | list[str] | TokenIds | list[TokenIds]


class CompletionRequest(_Request):
    """``POST /v1/completions`` (legacy): ``prompt`` is a string, strings, token ids or lists of them."""

    prompt: Prompt
    suffix: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    stop: Stop | None = None
    seed: int | None = None
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> CompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise _ParamError("stream_options", "stream_options is only allowed when stream is true")
        if isinstance(self.prompt, list) and not self.prompt:
            raise _ParamError("prompt", "prompt must not be an empty list")
        return self

    @property
    def output_limit(self) -> int | None:
        """The client's cap on generated tokens."""
        return self.max_tokens


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings``: ``input`` is a string, strings, token ids or lists of them."""

    input: Prompt
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: PositiveInt | None = None

    @model_validator(mode="after")
    def _consistent(self) -> EmbeddingRequest:
        if isinstance(self.input, list) and not self.input:
            raise _ParamError("input", "input must not be an empty list")
        if self.input == "":
            raise _ParamError("input", "input must not be an empty string")
        return self

    @property
    def output_limit(self) -> int | None:
        """Embeddings generate no tokens."""
        return 0


AnyRequest = ChatCompletionRequest | CompletionRequest | EmbeddingRequest


class Operation(enum.Enum):
    """The OpenAI operations the gateway serves, by path."""

    CHAT = ("/v1/chat/completions", ChatCompletionRequest)
    COMPLETIONS = ("/v1/completions", CompletionRequest)
    EMBEDDINGS = ("/v1/embeddings", EmbeddingRequest)

    def __init__(self, path: str, request_type: type[_Request]) -> None:
        self.path = path
        self.request_type = request_type


OPERATIONS_BY_PATH = {op.path: op for op in Operation}


class _ParamError(ValueError):
    """A validation failure about one named param (raised inside model validators)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated request: the typed model and the raw JSON object (kept for pass-through)."""

    operation: Operation
    model: AnyRequest
    raw: dict[str, Any]


def load_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object naming a model; raises ApiError (400) otherwise."""
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise invalid_json(str(error)) from None
    if not isinstance(raw, dict):
        raise invalid_json("expected a JSON object")
    if "model" not in raw:
        raise ApiError(400, "you must provide a model parameter", param="model", code="missing_required_parameter")
    return raw


def validate(operation: Operation, raw: dict[str, Any]) -> ParsedRequest:
    """Validate a loaded body against the operation's request model; raises ApiError (400)."""
    try:
        model = operation.request_type.model_validate(raw)
    except ValidationError as error:
        raise _api_error(error) from None
    return ParsedRequest(operation, model, raw)  # type: ignore[arg-type]


def parse_request(operation: Operation, body: bytes) -> ParsedRequest:
    """Parse and validate a request body; raises ApiError (400) naming the offending param."""
    return validate(operation, load_object(body))


def _api_error(error: ValidationError) -> ApiError:
    """Turn the most specific pydantic error into an OpenAI 400 with ``param``."""
    items = error.errors(include_url=False)
    # Prefer the error that reached deepest into the input (most informative in unions).
    item = max(items, key=lambda e: len(e["loc"]))
    ctx_error = item.get("ctx", {}).get("error")
    if isinstance(ctx_error, _ParamError):
        return ApiError(400, str(ctx_error), param=ctx_error.param, code="invalid_value")
    param = format_param(item["loc"])
    kind = item["type"]
    if kind == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'.", param=param,
                        code="missing_required_parameter")
    message = item["msg"].removeprefix("Value error, ")
    code = "invalid_type" if kind.endswith("_type") or kind.startswith("union_tag") else "invalid_value"
    return ApiError(400, f"Invalid value for '{param}': {message}", param=param or None, code=code)


def format_param(loc: tuple[int | str, ...]) -> str:
    """``('messages', 0, 'user', 'content', 'str')`` -> ``messages[0].content``.

    pydantic puts two kinds of non-fields in an error's loc: the tag of a tagged union (``user``,
    right after a ``messages`` index or after ``response_format``) and the branch of a plain union
    (``str``, ``list[...]``, a class name). Neither is part of the param a client sent.
    """
    out = ""
    field: str | None = None
    next_is_tag = False
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            next_is_tag = field in _TAGGED_LISTS
            continue
        if next_is_tag:
            next_is_tag = False
            continue
        if _is_union_branch(part):
            continue
        out += f".{part}" if out else part
        field = part
        next_is_tag = part in _TAGGED_FIELDS
    return out


_TAGGED_LISTS = frozenset({"messages", "content"})  # their items are tagged unions
_TAGGED_FIELDS = frozenset({"response_format"})  # its value is a tagged union
_SCALAR_BRANCHES = frozenset({"str", "int", "float", "bool", "none"})


def _is_union_branch(part: str) -> bool:
    return not part.isidentifier() or part[0].isupper() or part in _SCALAR_BRANCHES
