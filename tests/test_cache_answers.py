"""What the response cache keeps of a pod's answer and how it answers a hit: round trips from JSON
and SSE answers (n=2, streamed tool calls) back to either shape, the answers it refuses to keep,
the cache key, and the official ``openai`` types reading every rendered body."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from extproc.cache.answers import NotCacheable, cache_key, parse_answer, render, usage_of

CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"
POD_MODEL, ASKED_MODEL = "llama-3-8b-instruct", "gpt-4o-mini"  # served name vs the alias the client asked for
USAGE = {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19, "prompt_tokens_details": {"cached_tokens": 8}}
PARIS = "Paris is the capital of France."
CHAT_JSON = {
    "id": "chatcmpl-pod-0001", "object": "chat.completion", "created": 1_700_000_000, "model": POD_MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": PARIS}, "logprobs": None,
                 "finish_reason": "stop"}],
    "usage": USAGE,
}
COMPLETION_JSON = {
    "id": "cmpl-pod-0001", "object": "text_completion", "created": 1_700_000_000, "model": POD_MODEL,
    "choices": [{"index": 0, "text": " Paris.", "logprobs": None, "finish_reason": "length"}],
    "usage": USAGE,
}
# What a pod streams for a tool call (OpenAI's chat streaming format): the id and name come in the
# first delta, the arguments in pieces; a second call starts while the first is still open.
WEATHER = {"id": "call_weather", "type": "function",
           "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TIME = {"id": "call_time", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}


def sse(*chunks: dict[str, Any], done: bool = True) -> bytes:
    """A pod's SSE body: one ``data:`` event per chunk, then ``[DONE]``."""
    events = [b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks]
    return b"".join(events) + (b"data: [DONE]\n\n" if done else b"")


def chat_chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-pod-0002", "object": "chat.completion.chunk", "created": 1_700_000_000,
            "model": POD_MODEL, "choices": choices, **extra}


def completion_chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": "cmpl-pod-0002", "object": "text_completion", "created": 1_700_000_000,
            "model": POD_MODEL, "choices": choices, **extra}


def delta(index: int, finish_reason: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"index": index, "delta": fields, "logprobs": None, "finish_reason": finish_reason}


CHAT_STREAM = sse(
    chat_chunk([delta(0, role="assistant", content="")]),
    chat_chunk([delta(0, content="Paris is ")]),
    chat_chunk([delta(0, content="the capital of France.")]),
    chat_chunk([delta(0, finish_reason="stop")]),
    chat_chunk([], usage=USAGE))
COMPLETION_STREAM = sse(
    completion_chunk([{"index": 0, "text": " Par", "logprobs": None, "finish_reason": None}]),
    completion_chunk([{"index": 0, "text": "is.", "logprobs": None, "finish_reason": None}]),
    completion_chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]),
    completion_chunk([], usage=USAGE))
TWO_CHOICES_STREAM = sse(  # n=2: the pod interleaves the choices' deltas
    chat_chunk([delta(0, role="assistant", content="")]),
    chat_chunk([delta(1, role="assistant", content="")]),
    chat_chunk([delta(1, content="Hi")]),
    chat_chunk([delta(0, content="Hello")]),
    chat_chunk([delta(0, content=" world")]),
    chat_chunk([delta(1, content=" there")]),
    chat_chunk([delta(1, finish_reason="length")]),
    chat_chunk([delta(0, finish_reason="stop")]),
    chat_chunk([], usage=USAGE))
TOOL_CALLS_STREAM = sse(
    chat_chunk([delta(0, role="assistant", content=None)]),
    chat_chunk([delta(0, tool_calls=[{"index": 0, "id": "call_weather", "type": "function",
                                      "function": {"name": "get_weather", "arguments": ""}}])]),
    chat_chunk([delta(0, tool_calls=[{"index": 0, "function": {"arguments": '{"city"'}}])]),
    chat_chunk([delta(0, tool_calls=[{"index": 1, "id": "call_time", "type": "function",
                                      "function": {"name": "get_time", "arguments": '{"tz": '}}])]),
    chat_chunk([delta(0, tool_calls=[{"index": 0, "function": {"arguments": ': "Paris"}'}}])]),
    chat_chunk([delta(0, tool_calls=[{"index": 1, "function": {"arguments": '"CET"}'}}])]),
    chat_chunk([delta(0, finish_reason="tool_calls")]),
    chat_chunk([], usage=USAGE))
TOOL_CALLS_JSON = {**CHAT_JSON, "choices": [
    {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [WEATHER, TIME]},
     "logprobs": None, "finish_reason": "tool_calls"}]}


def events(body: bytes) -> list[dict[str, Any]]:
    """A rendered SSE body's chunks; checks the framing and that ``[DONE]`` ends it, once."""
    assert body.endswith(b"\n\n")
    frames = body[:-2].split(b"\n\n")
    assert all(frame.startswith(b"data: ") for frame in frames)
    assert frames[-1] == b"data: [DONE]" and frames.count(b"data: [DONE]") == 1
    return [orjson.loads(frame[6:]) for frame in frames[:-1]]


def streamed_text(chunks: list[dict[str, Any]], chat: bool) -> dict[int, str]:
    """Each choice's text, as a client concatenates it from the chunks."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            piece = (choice["delta"].get("content") if chat else choice["text"]) or ""
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


def finish_reasons(chunks: list[dict[str, Any]]) -> dict[int, str]:
    return {c["index"]: c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]}


# --- round trips ----------------------------------------------------------------------------------

ROUND_TRIPS = [  # (path, pod's body, streamed, the texts by choice, finish reasons by choice)
    pytest.param(CHAT_PATH, orjson.dumps(CHAT_JSON), False, {0: PARIS}, {0: "stop"}, id="chat-json"),
    pytest.param(CHAT_PATH, CHAT_STREAM, True, {0: PARIS}, {0: "stop"}, id="chat-sse"),
    pytest.param(CHAT_PATH, TWO_CHOICES_STREAM, True, {0: "Hello world", 1: "Hi there"}, {0: "stop", 1: "length"},
                 id="chat-sse-n2-interleaved"),
    pytest.param(COMPLETION_PATH, orjson.dumps(COMPLETION_JSON), False, {0: " Paris."}, {0: "length"},
                 id="completion-json"),
    pytest.param(COMPLETION_PATH, COMPLETION_STREAM, True, {0: " Paris."}, {0: "length"}, id="completion-sse"),
]


@pytest.mark.parametrize(("path", "body", "streamed", "texts", "reasons"), ROUND_TRIPS)
def test_hit_rendered_as_json_keeps_the_answer(path: str, body: bytes, streamed: bool, texts: dict[int, str],
                                               reasons: dict[int, str]) -> None:
    chat = path == CHAT_PATH
    stored = parse_answer(path, body, streamed)
    rendered, content_type = render(stored, ASKED_MODEL, stream=False, include_usage=False)
    answer = orjson.loads(rendered)

    assert content_type == "application/json"
    assert answer["object"] == ("chat.completion" if chat else "text_completion")
    assert answer["model"] == ASKED_MODEL  # the name the client asked for, not the served one
    assert answer["id"].startswith("chatcmpl-" if chat else "cmpl-")
    assert answer["id"] not in {"chatcmpl-pod-0001", "chatcmpl-pod-0002", "cmpl-pod-0001", "cmpl-pod-0002"}
    assert orjson.loads(render(stored, ASKED_MODEL, False, False)[0])["id"] != answer["id"]  # each hit a new id
    assert [c["index"] for c in answer["choices"]] == sorted(texts)
    got = {c["index"]: (c["message"]["content"] if chat else c["text"]) for c in answer["choices"]}
    assert got == texts
    assert {c["index"]: c["finish_reason"] for c in answer["choices"]} == reasons
    if chat:
        assert all(c["message"]["role"] == "assistant" for c in answer["choices"])
    assert answer["usage"] == USAGE  # always in a JSON answer, as the API does


@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "include-usage"])
@pytest.mark.parametrize(("path", "body", "streamed", "texts", "reasons"), ROUND_TRIPS)
def test_hit_rendered_as_sse_streams_the_answer(path: str, body: bytes, streamed: bool, texts: dict[int, str],
                                                reasons: dict[int, str], include_usage: bool) -> None:
    chat = path == CHAT_PATH
    rendered, content_type = render(parse_answer(path, body, streamed), ASKED_MODEL, stream=True,
                                    include_usage=include_usage)
    chunks = events(rendered)

    assert content_type == "text/event-stream"
    assert len({c["id"] for c in chunks}) == 1  # one id for the whole stream, as the API does
    assert chunks[0]["id"].startswith("chatcmpl-" if chat else "cmpl-")
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
    assert {c["model"] for c in chunks} == {ASKED_MODEL}
    assert streamed_text(chunks, chat) == texts
    assert finish_reasons(chunks) == reasons
    if chat:  # each choice opens with its role
        firsts = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                firsts.setdefault(choice["index"], choice["delta"])
        assert all(first.get("role") == "assistant" for first in firsts.values())
    with_usage = [c for c in chunks if c.get("usage")]
    if include_usage:  # stream_options.include_usage: one last chunk with no choices and the usage
        assert with_usage == [chunks[-1]] and chunks[-1]["choices"] == [] and chunks[-1]["usage"] == USAGE
    else:
        assert with_usage == []


@pytest.mark.parametrize(("body", "streamed"), [
    pytest.param(TOOL_CALLS_STREAM, True, id="streamed-in-pieces"),
    pytest.param(orjson.dumps(TOOL_CALLS_JSON), False, id="json"),
])
def test_tool_calls_are_kept_whole_and_rendered_in_both_shapes(body: bytes, streamed: bool) -> None:
    stored = parse_answer(CHAT_PATH, body, streamed)
    assert orjson.loads(stored)["choices"][0]["tool_calls"] == [WEATHER, TIME]

    answer = orjson.loads(render(stored, ASKED_MODEL, stream=False, include_usage=False)[0])
    assert answer["choices"][0]["message"]["tool_calls"] == [WEATHER, TIME]
    assert answer["choices"][0]["finish_reason"] == "tool_calls"

    chunks = events(render(stored, ASKED_MODEL, stream=True, include_usage=False)[0])
    calls = [call for chunk in chunks for c in chunk["choices"] for call in c["delta"].get("tool_calls") or ()]
    assert calls == [{"index": 0, **WEATHER}, {"index": 1, **TIME}]  # each call whole, in one delta
    assert [orjson.loads(call["function"]["arguments"]) for call in calls] == [{"city": "Paris"}, {"tz": "CET"}]
    assert finish_reasons(chunks) == {0: "tool_calls"}


def test_usage_of_reads_prompt_completion_and_cached_tokens() -> None:
    assert usage_of(parse_answer(CHAT_PATH, CHAT_STREAM, streamed=True)) == (12, 7, 8)
    no_usage = {k: v for k, v in CHAT_JSON.items() if k != "usage"}
    assert usage_of(parse_answer(CHAT_PATH, orjson.dumps(no_usage), streamed=False)) == (0, 0, 0)


# --- what is not kept -----------------------------------------------------------------------------

ERROR = {"error": {"message": "maximum context length is 8192 tokens", "type": "invalid_request_error",
                   "code": "context_length_exceeded", "param": "messages"}}
UNFINISHED = {**CHAT_JSON, "choices": [{**CHAT_JSON["choices"][0], "finish_reason": None}]}


@pytest.mark.parametrize(("path", "body", "streamed"), [
    pytest.param(CHAT_PATH, orjson.dumps(ERROR), False, id="error-body"),
    pytest.param(CHAT_PATH, sse(ERROR), True, id="error-event-in-a-stream"),
    pytest.param(CHAT_PATH, orjson.dumps(UNFINISHED), False, id="choice-without-finish-reason"),
    pytest.param(CHAT_PATH, orjson.dumps({**CHAT_JSON, "choices": []}), False, id="no-choices"),
    pytest.param(CHAT_PATH, CHAT_STREAM.split(b"data: [DONE]")[0], True, id="stream-cut-before-done"),
    pytest.param(CHAT_PATH, sse(chat_chunk([delta(0, role="assistant", content="Par")])), True,
                 id="stream-done-before-finish"),
    pytest.param(CHAT_PATH, TWO_CHOICES_STREAM.replace(b'"finish_reason":"length"', b'"finish_reason":null'), True,
                 id="stream-one-of-two-choices-unfinished"),
    pytest.param(CHAT_PATH, b"data: [DONE]\n\n", True, id="empty-stream"),
    pytest.param(CHAT_PATH, b"<html>502 Bad Gateway</html>", False, id="non-json-body"),
    pytest.param(CHAT_PATH, b"[1, 2]", False, id="json-not-an-object"),
    pytest.param(CHAT_PATH, b"data: {not json\n\ndata: [DONE]\n\n", True, id="non-json-event"),
    pytest.param(COMPLETION_PATH, orjson.dumps({**COMPLETION_JSON, "choices": [
        {**COMPLETION_JSON["choices"][0], "finish_reason": None}]}), False, id="completion-unfinished"),
    pytest.param("/v1/embeddings", orjson.dumps({"object": "list", "data": [], "model": POD_MODEL}), False,
                 id="embeddings-path"),
])
def test_not_cacheable(path: str, body: bytes, streamed: bool) -> None:
    with pytest.raises(NotCacheable):
        parse_answer(path, body, streamed)


# --- the key --------------------------------------------------------------------------------------

DIGEST = bytes(range(32))
BASE_KEY = (DIGEST, POD_MODEL, "v1", "team-a")


@pytest.mark.parametrize("other", [
    pytest.param((bytes(32), POD_MODEL, "v1", "team-a"), id="another-request"),
    pytest.param((DIGEST, "qwen-72b", "v1", "team-a"), id="another-model"),
    pytest.param((DIGEST, POD_MODEL, "v2", "team-a"), id="a-new-checkpoint"),
    pytest.param((DIGEST, POD_MODEL, "v1", "team-b"), id="another-tenant"),
    pytest.param((DIGEST, POD_MODEL, "v1", ""), id="the-shared-partition"),
    pytest.param((DIGEST, POD_MODEL + "v1", "", "team-a"), id="fields-do-not-run-together"),
])
def test_cache_key_differs_by_each_field(other: tuple[bytes, str, str, str]) -> None:
    key = cache_key(*BASE_KEY)
    assert len(key) == 32 and len(cache_key(*other)) == 32
    assert cache_key(*BASE_KEY) == key  # deterministic: every process computes the same key
    assert cache_key(*other) != key


# --- the official client's types ------------------------------------------------------------------


def validate_completion_chunk(chunk: dict[str, Any]) -> None:
    # The SDK types a streamed completion chunk as ``Completion`` but builds it without validation:
    # the API's own chunks carry ``finish_reason: null`` until the last, which the type does not allow.
    choices = [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]
    Completion.model_validate({**chunk, "choices": choices})


@pytest.mark.parametrize(("path", "body", "streamed"), [
    pytest.param(CHAT_PATH, CHAT_STREAM, True, id="chat"),
    pytest.param(CHAT_PATH, TWO_CHOICES_STREAM, True, id="chat-n2"),
    pytest.param(CHAT_PATH, TOOL_CALLS_STREAM, True, id="chat-tool-calls"),
    pytest.param(COMPLETION_PATH, orjson.dumps(COMPLETION_JSON), False, id="completion"),
])
def test_openai_types_parse_the_rendered_bodies(path: str, body: bytes, streamed: bool) -> None:
    stored = parse_answer(path, body, streamed)
    whole = orjson.loads(render(stored, ASKED_MODEL, stream=False, include_usage=False)[0])
    chunks = events(render(stored, ASKED_MODEL, stream=True, include_usage=True)[0])
    if path == CHAT_PATH:
        answer = ChatCompletion.model_validate(whole)
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        assert answer.usage.prompt_tokens_details.cached_tokens == 8
        parsed = [ChatCompletionChunk.model_validate(chunk) for chunk in chunks]
        assert parsed[-1].choices == [] and parsed[-1].usage is not None
    else:
        assert Completion.model_validate(whole).choices[0].text == " Paris."
        for chunk in chunks:
            validate_completion_chunk(chunk)


def official_client(path: str, rendered: tuple[bytes, str]) -> openai.OpenAI:
    """The ``openai`` client, answered by the rendered hit instead of a server."""
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == path
        return httpx.Response(200, content=rendered[0], headers={"content-type": rendered[1]})

    return openai.OpenAI(api_key="sk-test", base_url="http://gateway/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(answer)))


def test_official_client_reads_a_streamed_chat_hit() -> None:
    stored = parse_answer(CHAT_PATH, TOOL_CALLS_STREAM, streamed=True)
    client = official_client(CHAT_PATH, render(stored, ASKED_MODEL, stream=True, include_usage=True))
    chunks = list(client.chat.completions.create(model=ASKED_MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, stream_options={"include_usage": True}))
    calls = [call for chunk in chunks for c in chunk.choices for call in c.delta.tool_calls or ()]
    assert [(call.id, call.function.name if call.function else None) for call in calls] == [
        ("call_weather", "get_weather"), ("call_time", "get_time")]
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 19


def test_official_client_reads_a_completion_hit() -> None:
    stored = parse_answer(COMPLETION_PATH, COMPLETION_STREAM, streamed=True)
    streamed = official_client(COMPLETION_PATH, render(stored, ASKED_MODEL, stream=True, include_usage=False))
    pieces = [c.text for chunk in streamed.completions.create(model=ASKED_MODEL, prompt="The capital of France:",
                                                                stream=True) for c in chunk.choices]
    assert "".join(pieces) == " Paris."
    whole = official_client(COMPLETION_PATH, render(stored, ASKED_MODEL, stream=False, include_usage=False))
    answer = whole.completions.create(model=ASKED_MODEL, prompt="The capital of France:")
    assert (answer.choices[0].text, answer.choices[0].finish_reason, answer.model) == (" Paris.", "length", ASKED_MODEL)
