"""What the batching coordinator does with bodies: one client request -> one prompt of a merged
completion call, and the pod's merged answer -> each client's own answer. Pure: no I/O.

A merged call is vLLM's ``POST /v1/completions`` with ``prompt`` a list: every prompt shares the
call's sampling parameters, so requests are merged only when theirs are equal (``BatchKey``).
Chat requests are rendered with the model's chat template ending with the assistant's generation
prompt, which is what a chat endpoint does before generating: the model's own Jinja template when
the config gives one (``models[].chat_template``, compiled by ``extproc.chat_template``, or
``chatml``: the simulated pod's), else the engine's own (llama.cpp's ``/apply-template``, asked by
the coordinator). With neither, a chat is not merged (``NoTemplate``): it goes to its pod alone.

The pod streams (``stream_options.include_usage``): each chunk carries one choice whose ``index``
is the prompt's position in the list. vLLM sends usage once, for the whole call; each client's
share is split from it (``split``), in proportion to the gateway's exact count of its prompt and to
the content events of its answer (vLLM sends about one token per event), so the shares add up to
exactly what the pod reported. llama.cpp ends each prompt with its own usage (``own_usage``), and
marks each further prompt's start with a ``data: null`` event, which carries nothing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import orjson

from extproc.accounting import Usage
from extproc.templates import TemplateError

# Fields a client sends for itself, not shared by the merged call.
_OWN_FIELDS = frozenset({"model", "messages", "prompt", "stream", "stream_options", "user", "n", "metadata",
                         "store", "service_tier", "max_tokens", "max_completion_tokens"})
CHAT = "chat"
COMPLETION = "completion"


class MergeError(ValueError):
    """A body the coordinator cannot turn into one prompt (extproc should not have sent it)."""


class NoTemplate(MergeError):
    """A chat whose model has no known chat template: it is sent alone, never in a guessed one."""



class PromptRenderer(Protocol):
    """A model's chat template: OpenAI ``messages`` (and ``tools``) -> the prompt text, ending with
    the generation prompt; raises ``TemplateError`` for what it cannot render."""

    def __call__(self, messages: object, tools: object = None) -> str: ...


NO_TEMPLATES: Mapping[str, PromptRenderer] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class BatchKey:
    """Requests merge only with the same pod, model, output limit and sampling parameters."""

    endpoint: str
    model: str
    max_tokens: int | None
    sampling: bytes  # the shared fields as canonical JSON


@dataclass(frozen=True, slots=True)
class Member:
    """One client's request, as the merged call needs it."""

    kind: str  # CHAT or COMPLETION
    prompt: str
    stream: bool
    include_usage: bool
    input_tokens: int  # the gateway's count (x-llmgw-input-tokens)
    params: tuple[tuple[str, Any], ...] = ()  # its own sampling parameters (the batch protocol carries them)


def parse(body: bytes, endpoint: str, input_tokens: int,
          templates: Mapping[str, PromptRenderer] = NO_TEMPLATES) -> tuple[BatchKey, Member]:
    """A client's body -> its batch key and member; ``MergeError`` when it cannot be merged.
    ``templates``: the chat template of each model (by the name in the body) that has its own."""
    return parse_object(load(body), endpoint, input_tokens, templates)


def load(body: bytes) -> dict[str, Any]:
    """A client's body as a JSON object naming its model; ``MergeError`` otherwise."""
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise MergeError(f"not JSON: {error}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), str):
        raise MergeError("no model")
    return raw


def parse_object(raw: dict[str, Any], endpoint: str, input_tokens: int,
                 templates: Mapping[str, PromptRenderer] = NO_TEMPLATES) -> tuple[BatchKey, Member]:
    """``parse`` of a body already ``load``-ed."""
    if "messages" in raw:
        kind = CHAT
        prompt = _chat_prompt(raw, templates.get(raw["model"]))
    elif isinstance(raw.get("prompt"), str):
        kind, prompt = COMPLETION, raw["prompt"]
    else:
        raise MergeError("one text prompt or chat messages are needed")
    if (raw.get("n") or 1) != 1:
        raise MergeError("n > 1 cannot share a merged call")
    limit = raw.get("max_completion_tokens", raw.get("max_tokens"))
    shared = {k: v for k, v in raw.items() if k not in _OWN_FIELDS}
    options = raw.get("stream_options") or {}
    key = BatchKey(endpoint, raw["model"], limit if isinstance(limit, int) else None,
                   orjson.dumps(shared, option=orjson.OPT_SORT_KEYS))
    params = {name: raw[name] for name in PROTOCOL_PARAMS if raw.get(name) is not None}
    if isinstance(limit, int):
        params["max_tokens"] = limit
    return key, Member(kind, prompt, bool(raw.get("stream")), bool(options.get("include_usage")), input_tokens,
                       tuple(sorted(params.items())))


def _chat_prompt(raw: dict[str, Any], template: PromptRenderer | None) -> str:
    if template is None:
        raise NoTemplate(f"no chat template is known for model {raw['model']!r}")
    try:
        return template(raw["messages"], raw.get("tools"))
    except TemplateError as error:
        raise MergeError(f"{error.param}: {error}") from None


# What the batch protocol carries per prompt (protos/llmgw/v1/batch.proto SamplingParams).
PROTOCOL_PARAMS = ("temperature", "top_p", "stop", "seed", "ignore_eos", "min_tokens")
PROTOCOL = b"llmgw.v1"  # the sampling part of a key whose members go over the batch protocol


def protocol_key(key: BatchKey, member: Member) -> BatchKey | None:
    """For a pod that speaks the batch protocol: one queue per pod and model, whatever the sampling
    parameters, when the protocol carries all of the member's (else None: the HTTP key)."""
    shared = orjson.loads(key.sampling)
    if any(name not in PROTOCOL_PARAMS for name in shared):
        return None
    return BatchKey(key.endpoint, key.model, None, PROTOCOL)


def pod_body(key: BatchKey, prompts: Sequence[str]) -> bytes:
    """The merged call: one streamed completion over every member's prompt."""
    body: dict[str, Any] = {**orjson.loads(key.sampling), "model": key.model, "prompt": list(prompts),
                            "stream": True, "stream_options": {"include_usage": True}}
    if key.max_tokens is not None:
        body["max_tokens"] = key.max_tokens
    return orjson.dumps(body)


def split(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` in whole shares proportional to ``weights`` (largest remainders), summing to it."""
    if not weights:
        return []
    weight_sum = sum(weights)
    if weight_sum <= 0:
        base = [total // len(weights)] * len(weights)
        for i in range(total - sum(base)):
            base[i] += 1
        return base
    exact = [total * w / weight_sum for w in weights]
    shares = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: exact[i] - shares[i], reverse=True)
    for i in order[:total - sum(shares)]:
        shares[i] += 1
    return shares


def shares(pod_usage: dict[str, Any] | None, members: Sequence[Member], events: Sequence[int]) -> list[Usage]:
    """Each member's usage: the pod's totals split by prompt counts and content events. Without
    the pod's usage (the call was cut), each member's own counts."""
    if not pod_usage:
        return [Usage(m.input_tokens, n, 0) for m, n in zip(members, events, strict=True)]
    prompt = split(int(pod_usage.get("prompt_tokens") or 0), [m.input_tokens for m in members])
    completion = split(int(pod_usage.get("completion_tokens") or 0), list(events))
    details = pod_usage.get("prompt_tokens_details") or {}
    cached = split(int(details.get("cached_tokens") or 0), prompt)
    return [Usage(p, c, k) for p, c, k in zip(prompt, completion, cached, strict=True)]


def own_usage(usage: dict[str, Any]) -> Usage:
    """A usage object that is one prompt's own (llama.cpp ends each prompt of a merged stream
    with its own ``usage``, where vLLM sends one for the whole call)."""
    details = usage.get("prompt_tokens_details") or {}
    return Usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                 int(details.get("cached_tokens") or 0))


class Answer:
    """One client's answer, built as the pod's chunks for its prompt arrive."""

    def __init__(self, member: Member, answer_id: str, model: str) -> None:
        self.member = member
        self.id = answer_id
        self.model = model
        self.created = int(time.time())
        self.parts: list[str] = []
        self.events = 0
        self.finish_reason: str | None = None
        self.started = False

    def delta(self, text: str, finish_reason: str | None) -> bytes:
        """Record a chunk; for a streaming client, the SSE event(s) to send it now (else b"")."""
        if text:
            self.parts.append(text)
            self.events += 1
        if finish_reason is not None:
            self.finish_reason = finish_reason
        if not self.member.stream:
            return b""
        out = b""
        if self.member.kind == CHAT and not self.started:
            out += self._event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None})
        self.started = True
        if self.member.kind == CHAT:
            return out + self._event({"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                                      "finish_reason": finish_reason})
        return out + self._event({"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason})

    def end(self, usage: Usage) -> bytes:
        """The rest of the answer: a streaming client's usage event (if asked) and ``[DONE]``; a
        plain client's whole JSON body."""
        if self.member.stream:
            tail = b""
            if self.member.include_usage:
                tail += b"data: " + orjson.dumps({"id": self.id, "object": self._chunk_object(),
                                                   "created": self.created, "model": self.model, "choices": [],
                                                   "usage": usage.body()}) + b"\n\n"
            return tail + b"data: [DONE]\n\n"
        text = "".join(self.parts)
        if self.member.kind == CHAT:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": self.finish_reason or "stop"}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason or "stop"}
            obj = "text_completion"
        return orjson.dumps({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                             "choices": [choice], "usage": usage.body()})

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.member.kind == CHAT else "text_completion"

    def _event(self, choice: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps({"id": self.id, "object": self._chunk_object(), "created": self.created,
                                         "model": self.model, "choices": [choice]}) + b"\n\n"
