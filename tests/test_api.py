"""Parsing and validating the OpenAI request shapes: what is accepted, and the 400 for what is not."""

from __future__ import annotations

import orjson
import pytest

from extproc.api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    Operation,
    format_param,
    parse_request,
)

USER = {"role": "user", "content": "hi"}


def chat(**fields: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": [USER], **fields})


FULL_CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": [{"type": "text", "text": "rules"}]},
        {"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "high"}},
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        ]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"role": "function", "name": "f", "content": "old style"},
    ],
    "tools": [{"type": "function", "function": {"name": "f", "description": "d",
                                                "parameters": {"type": "object"}, "strict": True}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}},
    "stream": True, "stream_options": {"include_usage": True},
    "n": 2, "max_tokens": 10, "max_completion_tokens": 20, "temperature": 0.5, "top_p": 0.9,
    "stop": ["\n", "END"], "seed": 7, "user": "u-1", "presence_penalty": 0.1, "frequency_penalty": -0.1,
    "logprobs": True, "top_logprobs": 3, "top_k": 40,  # top_k: a vLLM extension, passed through
}


def test_full_chat_shape_is_accepted() -> None:
    parsed = parse_request(Operation.CHAT, orjson.dumps(FULL_CHAT))
    request = parsed.model
    assert isinstance(request, ChatCompletionRequest)
    assert request.output_limit == 20  # max_completion_tokens supersedes max_tokens
    assert request.response_format is not None and request.response_format.type == "json_schema"
    assert request.stream_options is not None and request.stream_options.include_usage
    assert parsed.raw["top_k"] == 40  # unknown fields are kept for the pod


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        pytest.param(b"{", None, "invalid_json", id="truncated-json"),
        pytest.param(b"[1, 2]", None, "invalid_json", id="json-array"),
        pytest.param(b"\xff\xfe", None, "invalid_json", id="not-utf8"),
        pytest.param(b'{"messages": []}', "model", "missing_required_parameter", id="no-model"),
        pytest.param(b'{"model": 5, "messages": []}', "model", "invalid_type", id="model-not-string"),
        pytest.param(b'{"model": "m"}', "messages", "missing_required_parameter", id="no-messages"),
        pytest.param(b'{"model": "m", "messages": []}', "messages", "invalid_value", id="empty-messages"),
        pytest.param(b'{"model": "m", "messages": [{"role": "bot", "content": "x"}]}', "messages[0]",
                     "invalid_type", id="unknown-role"),
        pytest.param(b'{"model": "m", "messages": [{"role": "user", "content": 1}]}', "messages[0].content",
                     "invalid_type", id="content-not-string"),
        pytest.param(b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", '
                     b'"image_url": {}}]}]}', "messages[0].content[0].image_url.url",
                     "missing_required_parameter", id="image-without-url"),
        pytest.param(b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "video"}]}]}',
                     "messages[0].content[0]", "invalid_type", id="unknown-part-type"),
        pytest.param(b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio", '
                     b'"input_audio": {"data": "x", "format": "ogg"}}]}]}',
                     "messages[0].content[0].input_audio.format", "invalid_value", id="audio-format"),
        pytest.param(b'{"model": "m", "messages": [{"role": "assistant"}]}', "messages[0]", "invalid_value",
                     id="assistant-empty"),
        pytest.param(b'{"model": "m", "messages": [{"role": "tool", "content": "x"}]}',
                     "messages[0].tool_call_id", "missing_required_parameter", id="tool-without-call-id"),
        pytest.param(chat(temperature=2.5), "temperature", "invalid_value", id="temperature-range"),
        pytest.param(chat(temperature="hot"), "temperature", "invalid_type", id="temperature-type"),
        pytest.param(chat(top_p=1.5), "top_p", "invalid_value", id="top-p-range"),
        pytest.param(chat(n=0), "n", "invalid_value", id="n-zero"),
        pytest.param(chat(max_tokens=0), "max_tokens", "invalid_value", id="max-tokens-zero"),
        pytest.param(chat(max_tokens="10"), "max_tokens", "invalid_type", id="max-tokens-string"),
        pytest.param(chat(stream="yes"), "stream", "invalid_type", id="stream-not-bool"),
        pytest.param(chat(stream_options={"include_usage": True}), "stream_options", "invalid_value",
                     id="stream-options-without-stream"),
        pytest.param(chat(stop=[1]), "stop[0]", "invalid_type", id="stop-not-string"),
        pytest.param(chat(seed=1.5), "seed", "invalid_type", id="seed-float"),
        pytest.param(chat(user=3), "user", "invalid_type", id="user-not-string"),
        pytest.param(chat(response_format={"type": "yaml"}), "response_format", "invalid_type",
                     id="response-format-type"),
        pytest.param(chat(response_format={"type": "json_schema", "json_schema": {}}),
                     "response_format.json_schema.name", "missing_required_parameter", id="json-schema-name"),
        pytest.param(chat(tools=[{"type": "function", "function": {}}]), "tools[0].function.name",
                     "missing_required_parameter", id="tool-without-name"),
        pytest.param(chat(tool_choice="auto"), "tool_choice", "invalid_value", id="tool-choice-without-tools"),
    ],
)
def test_bad_chat_bodies_name_the_param(body: bytes, param: str | None, code: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_request(Operation.CHAT, body)
    error = caught.value
    assert (error.status, error.param, error.code) == (400, param, code)
    assert orjson.loads(error.body())["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "prompt",
    ["one", ["a", "b"], [1, 2, 3], [[1, 2], [3]]],
    ids=["string", "strings", "token-ids", "token-id-lists"],
)
def test_completion_prompt_forms(prompt: object) -> None:
    parsed = parse_request(Operation.COMPLETIONS, orjson.dumps({"model": "m", "prompt": prompt}))
    assert isinstance(parsed.model, CompletionRequest) and parsed.model.prompt == prompt


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt[0]"),
        ({"prompt": "x", "logprobs": 9}, "logprobs"),
    ],
)
def test_bad_completion_bodies(fields: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_request(Operation.COMPLETIONS, orjson.dumps({"model": "m", **fields}))
    assert caught.value.param == param


def test_embedding_request() -> None:
    parsed = parse_request(Operation.EMBEDDINGS, b'{"model": "e", "input": ["a", "b"], "encoding_format": "float"}')
    assert isinstance(parsed.model, EmbeddingRequest) and parsed.model.input == ["a", "b"]
    with pytest.raises(ApiError) as caught:
        parse_request(Operation.EMBEDDINGS, b'{"model": "e", "input": ""}')
    assert caught.value.param == "input"


@pytest.mark.parametrize(
    ("loc", "param"),
    [
        (("messages", 0, "user", "content", "str"), "messages[0].content"),  # tag and branch dropped
        (("messages", 1, "assistant", "tool_calls", 0, "function", "name"),
         "messages[1].tool_calls[0].function.name"),  # 'function' after tool_calls[0] is a real field
        (("response_format", "json_schema", "json_schema", "name"), "response_format.json_schema.name"),
        (("tool_choice", "NamedToolChoice", "function"), "tool_choice.function"),  # class-name branch
        (("stop", "list[str]", 0), "stop[0]"),
    ],
)
def test_format_param(loc: tuple[int | str, ...], param: str) -> None:
    assert format_param(loc) == param
