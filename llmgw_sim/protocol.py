"""Parsing and validating OpenAI ``/v1/chat/completions`` and ``/v1/completions`` bodies.

Pure: a JSON object in, a typed ``GenerationRequest`` (or ``EmbeddingRequest`` for
``/v1/embeddings``) out, or ``InvalidRequest`` naming the parameter (vLLM answers those with 400
``BadRequestError``). Unknown fields are ignored, as vLLM does. Parameters follow the OpenAI API
reference plus vLLM's extra sampling parameters ``ignore_eos`` and ``min_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmgw_sim.template import Segment, TemplateError, render_chat

Endpoint = Literal["chat", "completion"]
EncodingFormat = Literal["float", "base64"]


class InvalidRequest(ValueError):
    """A body the API rejects with 400; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat prompt rendered by the template into text and media segments."""

    segments: list[Segment]


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """A completions prompt given as text."""

    text: str


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """A completions prompt given as token ids."""

    token_ids: list[int]


Prompt = ChatPrompt | TextPrompt | TokenPrompt


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated generation request (chat or legacy completions)."""

    endpoint: Endpoint
    model: str | None
    prompts: list[Prompt]
    n: int
    max_tokens: int | None
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    min_tokens: int


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """A validated ``/v1/embeddings`` request."""

    model: str | None
    inputs: list[TextPrompt | TokenPrompt]
    encoding_format: EncodingFormat
    dimensions: int | None


def _int(body: dict[str, object], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer", name)
    if value < minimum:
        raise InvalidRequest(f"{name} must be at least {minimum}, got {value}", name)
    return value


def _bool(body: dict[str, object], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a boolean", name)
    return value


def _stop(body: dict[str, object]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidRequest("stop must be a string or a list of strings", "stop")
    return tuple(s for s in value if s)


def _text_or_tokens(value: object, param: str) -> list[TextPrompt | TokenPrompt]:
    """OpenAI ``prompt``/``input``: a string, a list of strings, a list of token ids, or a list
    of token-id lists."""
    if isinstance(value, str):
        return [TextPrompt(value)]
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"{param} must be a string, a list of strings, a list of token ids "
                             "or a list of token-id lists, and not empty", param)
    if all(isinstance(p, str) for p in value):
        return [TextPrompt(p) for p in value]
    if all(_is_token_list(p) for p in value):
        return [TokenPrompt(list(p)) for p in value]
    if _is_token_list(value):
        return [TokenPrompt(list(value))]
    raise InvalidRequest(f"{param}: mixed or invalid element types", param)


def _is_token_list(value: object) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def parse_generation(endpoint: Endpoint, body: object) -> GenerationRequest:
    """Validate a request body for ``endpoint``."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", "model")
    if endpoint == "chat":
        try:
            prompts: list[Prompt] = [ChatPrompt(render_chat(body.get("messages"), body.get("tools")))]
        except TemplateError as err:
            raise InvalidRequest(str(err), err.param) from err
        # OpenAI: max_completion_tokens supersedes the deprecated max_tokens.
        max_tokens = _int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", 1)
    else:
        if "prompt" not in body:
            raise InvalidRequest("prompt is required", "prompt")
        prompts = list(_text_or_tokens(body["prompt"], "prompt"))
        max_tokens = _int(body, "max_tokens", 1)
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise InvalidRequest("temperature must be a number", "temperature")
    if temperature < 0:
        raise InvalidRequest(f"temperature must be non-negative, got {temperature}", "temperature")
    stream = _bool(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise InvalidRequest("Stream options can only be defined when `stream=True`.",
                                 "stream_options")
        if not isinstance(stream_options, dict):
            raise InvalidRequest("stream_options must be an object", "stream_options")
        include_usage = bool(stream_options.get("include_usage"))
    return GenerationRequest(
        endpoint=endpoint,
        model=model,
        prompts=prompts,
        n=_int(body, "n", 1) or 1,
        max_tokens=max_tokens,
        temperature=float(temperature),
        seed=_int(body, "seed", -(2**63)),
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
        ignore_eos=_bool(body, "ignore_eos"),
        min_tokens=_int(body, "min_tokens", 0) or 0,
    )


def parse_embedding(body: object) -> EmbeddingRequest:
    """Validate a ``/v1/embeddings`` body (OpenAI: ``input``, ``encoding_format``, ``dimensions``)."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", "model")
    if "input" not in body:
        raise InvalidRequest("input is required", "input")
    inputs = _text_or_tokens(body["input"], "input")
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ("float", "base64"):
        raise InvalidRequest("encoding_format must be 'float' or 'base64'", "encoding_format")
    return EmbeddingRequest(model=model, inputs=inputs, encoding_format="base64" if encoding == "base64" else "float",
                            dimensions=_int(body, "dimensions", 1))
