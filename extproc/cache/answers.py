"""What the response cache keeps of an answer, and how a hit is answered. Pure: no I/O.

Envoy's Lua filter hands over the pod's response body for a request marked cacheable (a JSON
body, or the SSE events of a stream). ``parse_answer`` keeps what any later client may ask for,
whatever shape it asks in: each choice's text (or chat message, tool calls included) and finish
reason, and the usage. ``render`` answers a hit as a fresh ``chat.completion`` /
``text_completion`` body, or as SSE chunks when the client streams: one chunk with the role, one
with each choice's whole text, one with its finish reason, the usage chunk when
``stream_options.include_usage`` asks for it, then ``[DONE]``.

A stored answer is compact JSON: ``{"kind", "model", "choices": [{"index", "content",
"finish_reason", "tool_calls"?}], "usage": {...}}``.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any

import orjson

CHAT, COMPLETION = "chat", "completion"
KINDS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}


def cache_key(answer_digest: bytes, served_model: str, version: str, partition: str) -> bytes:
    """The response cache's key: the request's answer-defining fields (``body.answer_digest``),
    the served model and its version (a new checkpoint answers anew), and the partition (the
    tenant's name, or "" for a cache shared by all)."""
    return hashlib.sha256(b"\0".join((answer_digest, served_model.encode(), version.encode(),
                                       partition.encode()))).digest()


class NotCacheable(ValueError):
    """A response the cache does not keep (an error, a cut stream, refusals to parse)."""


def parse_answer(path: str, body: bytes, streamed: bool) -> bytes:
    """The stored form of a complete 200 response body; ``NotCacheable`` otherwise."""
    kind = KINDS.get(path)
    if kind is None:
        raise NotCacheable(f"{path} answers are not cached")
    choices: dict[int, dict[str, Any]] = {}
    usage: dict[str, Any] | None = None
    model = ""
    if streamed:
        done = False
        for line in body.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            chunk = _json(data)
            model = chunk.get("model") or model
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                _merge_delta(choices.setdefault(int(choice.get("index", 0)), {"content": "", "finish_reason": None}),
                             choice, kind)
        if not done:
            raise NotCacheable("the stream did not end with [DONE]")
    else:
        whole = _json(body)
        model, usage = whole.get("model") or "", whole.get("usage")
        for choice in whole.get("choices") or ():
            entry: dict[str, Any] = {"finish_reason": choice.get("finish_reason")}
            if kind == CHAT:
                message = choice.get("message") or {}
                entry["content"] = message.get("content") or ""
                if message.get("tool_calls"):
                    entry["tool_calls"] = message["tool_calls"]
            else:
                entry["content"] = choice.get("text") or ""
            choices[int(choice.get("index", 0))] = entry
    if not choices or any(c["finish_reason"] is None for c in choices.values()):
        raise NotCacheable("an answer without a finished choice")
    stored = [{"index": i, **choices[i]} for i in sorted(choices)]
    return orjson.dumps({"kind": kind, "model": model, "choices": stored, "usage": usage or {}})


def _json(data: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as error:
        raise NotCacheable(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise NotCacheable("not a JSON object")
    return value


def _merge_delta(entry: dict[str, Any], choice: dict[str, Any], kind: str) -> None:
    if kind == CHAT:
        delta = choice.get("delta") or {}
        entry["content"] += delta.get("content") or ""
        for call in delta.get("tool_calls") or ():  # streamed tool calls: arguments arrive in pieces
            calls = entry.setdefault("tool_calls", [])
            at = int(call.get("index", len(calls)))
            while len(calls) <= at:
                calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            target, function = calls[at], call.get("function") or {}
            target["id"] = call.get("id") or target["id"]
            target["function"]["name"] += function.get("name") or ""
            target["function"]["arguments"] += function.get("arguments") or ""
    else:
        entry["content"] += choice.get("text") or ""
    if choice.get("finish_reason"):
        entry["finish_reason"] = choice["finish_reason"]


def usage_of(stored: bytes) -> tuple[int, int, int]:
    """A stored answer's (prompt, completion, cached) tokens."""
    usage = orjson.loads(stored).get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return (int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
            int(details.get("cached_tokens") or 0))


def render(stored: bytes, model: str, stream: bool, include_usage: bool) -> tuple[bytes, str]:
    """A hit's body and content type, in the shape the client asked for (``model``: the name it
    asked for, as a direct answer would echo the served one's alias)."""
    answer = orjson.loads(stored)
    chat = answer["kind"] == CHAT
    prefix = "chatcmpl-" if chat else "cmpl-"
    base = {"id": prefix + secrets.token_hex(12), "created": int(time.time()), "model": model}
    usage = answer.get("usage") or None
    if not stream:
        choices = []
        for c in answer["choices"]:
            if chat:
                # OpenAI sends null content beside tool calls
                message: dict[str, Any] = {"role": "assistant",
                                           "content": c["content"] or (None if c.get("tool_calls") else "")}
                if c.get("tool_calls"):
                    message["tool_calls"] = c["tool_calls"]
                choices.append({"index": c["index"], "message": message, "logprobs": None,
                                "finish_reason": c["finish_reason"]})
            else:
                choices.append({"index": c["index"], "text": c["content"], "logprobs": None,
                                "finish_reason": c["finish_reason"]})
        body = {**base, "object": "chat.completion" if chat else "text_completion", "choices": choices}
        if usage:
            body["usage"] = usage
        return orjson.dumps(body), "application/json"
    obj = "chat.completion.chunk" if chat else "text_completion"
    events = []

    def event(choices: list[dict[str, Any]], **extra: Any) -> None:
        events.append(b"data: " + orjson.dumps({**base, "object": obj, "choices": choices, **extra}) + b"\n\n")

    for c in answer["choices"]:
        index = c["index"]
        if chat:
            event([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}])
            delta: dict[str, Any] = {"content": c["content"]}
            if c.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(c["tool_calls"])]
            event([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
            event([{"index": index, "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]}])
        else:
            event([{"index": index, "text": c["content"], "logprobs": None, "finish_reason": None}])
            event([{"index": index, "text": "", "logprobs": None, "finish_reason": c["finish_reason"]}])
    if include_usage and usage:
        event([], usage=usage)
    events.append(b"data: [DONE]\n\n")
    return b"".join(events), "text/event-stream"
