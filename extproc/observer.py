"""What the observability-mode filter learns about a response, without ever delaying it. Pure.

Envoy streams the response body to the observer as it reaches the client. The usage a pod reports
is at the end: the ``usage`` object of a JSON body, or of the last SSE chunk when the client asked
``stream_options.include_usage``. Keeping a bounded tail of the body is enough to find it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import orjson

from extproc.pricing import Prices

TAIL_BYTES = 16 * 1024
_USAGE_KEY = b'"usage":'


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage as the pod reported it (OpenAI ``usage``)."""

    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0

    @property
    def total(self) -> int:
        """Input plus output tokens: what a tokens-per-minute limit counts."""
        return self.input_tokens + self.output_tokens


def find_usage(tail: bytes) -> Usage | None:
    """The last non-null ``usage`` object in ``tail`` (JSON or SSE text), or None."""
    at = tail.rfind(_USAGE_KEY)
    while at >= 0:
        start = at + len(_USAGE_KEY)
        while start < len(tail) and tail[start] in b" \t":
            start += 1
        end = _object_end(tail, start)
        if end is not None:
            try:
                usage = orjson.loads(tail[start:end])
            except orjson.JSONDecodeError:
                usage = None
            if isinstance(usage, dict):
                return _usage(usage)
        at = tail.rfind(_USAGE_KEY, 0, at)
    return None


def _usage(raw: dict[str, object]) -> Usage | None:
    prompt, completion = raw.get("prompt_tokens"), raw.get("completion_tokens", 0)
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    details = raw.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return Usage(prompt, completion, cached if isinstance(cached, int) else 0)


def _object_end(data: bytes, start: int) -> int | None:
    """Index just past the JSON object starting at ``start`` (strings respected), or None."""
    if start >= len(data) or data[start] != ord("{"):
        return None
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(data)):
        c = data[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c == 0x7B:
            depth += 1
        elif c == 0x7D:
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _span_id(traceparent: str) -> str:
    parts = traceparent.split("-")
    return parts[2] if len(parts) >= 4 else ""


@dataclass(slots=True)
class ResponseObservation:
    """One request seen from the observer filter, which is sent response headers and body only.

    The gateway's own span id (in the ``traceparent`` Envoy copies onto the response) is unique per
    request, so it finds the main filter's state for the same request: both filters' streams share
    the Envoy worker's gRPC connection and so reach the same extproc process.
    """

    started: float = field(default_factory=time.monotonic)
    request_id: str = ""
    span_id: str = ""
    tenant: str = ""
    prices: Prices | None = None  # set when the request was routed to a pod: it goes in the ledger
    model: str = ""
    pool: str = ""
    endpoint: str = ""
    path: str = ""
    status: int = 0
    streamed: bool = False
    first_byte_at: float | None = None
    finished_at: float | None = None
    body_bytes: int = 0
    chunks: int = 0
    tail: bytearray = field(default_factory=bytearray, repr=False)
    deltas: list[str] = field(default_factory=list, repr=False)  # generated text of a stream
    _partial: bytearray = field(default_factory=bytearray, repr=False)  # an SSE line cut by a chunk

    def on_response_headers(self, headers: Mapping[str, str], end_of_stream: bool) -> None:
        """Status, identity (Envoy copies x-request-id and traceparent onto the response) and body kind."""
        self.request_id = headers.get("x-request-id", "")
        self.span_id = _span_id(headers.get("traceparent", ""))
        status = headers.get(":status", "0")
        self.status = int(status) if status.isdigit() else 0
        self.streamed = headers.get("content-type", "").startswith("text/event-stream")
        if end_of_stream:
            self.finished_at = time.monotonic()

    def attach(self, started: float, path: str, model: str, pool: str, endpoint: str, tenant: str = "",
               prices: Prices | None = None) -> None:
        """What the main filter's stream of the same request decided (found by span id)."""
        self.started = started
        self.path, self.model, self.pool, self.endpoint = path, model, pool, endpoint
        self.tenant, self.prices = tenant, prices

    def on_response_body(self, chunk: bytes, end_of_stream: bool) -> None:
        """Count the chunk and keep the tail where the usage will be."""
        now = time.monotonic()
        if chunk:
            if self.first_byte_at is None:
                self.first_byte_at = now
            self.body_bytes += len(chunk)
            self.chunks += 1
            self.tail += chunk
            if len(self.tail) > TAIL_BYTES:
                del self.tail[: len(self.tail) - TAIL_BYTES]
            if self.streamed:
                self._collect_deltas(chunk)
        if end_of_stream:
            self.finished_at = now

    def _collect_deltas(self, chunk: bytes) -> None:
        """Keep the generated text of an SSE stream, for counting when the pod reports no usage."""
        self._partial += chunk
        *lines, rest = bytes(self._partial).split(b"\n")
        self._partial = bytearray(rest)
        for line in lines:
            if not line.startswith(b"data: {"):
                continue
            try:
                event = orjson.loads(line[6:])
            except orjson.JSONDecodeError:
                continue
            for choice in event.get("choices") or ():
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta")
                text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                if isinstance(text, str) and text:
                    self.deltas.append(text)

    def final_usage(self, count_text: Callable[[str], int], input_estimate: Callable[[], int]
                    ) -> tuple[Usage | None, bool]:
        """The pod's usage; else, for a stream without a usage chunk, the streamed text counted with
        ``count_text`` and the gateway's input estimate (asked for only then). The flag says whether
        it was estimated."""
        reported = self.usage()
        if reported is not None or not self.deltas:
            return reported, False
        return Usage(input_estimate(), count_text("".join(self.deltas))), True

    @property
    def complete(self) -> bool:
        """True once the response's end was seen (not when the client went away first)."""
        return self.finished_at is not None

    def usage(self) -> Usage | None:
        """The usage the pod reported, if the body carried one."""
        return find_usage(bytes(self.tail))

    def record(self, usage: Usage | None = None, estimated: bool = False) -> dict[str, object]:
        """A flat record for the access log (GenAI semantic-convention names where they exist);
        ``usage`` defaults to what the pod reported."""
        usage = usage if usage is not None else self.usage()
        end = self.finished_at or time.monotonic()
        return {
            "request_id": self.request_id,
            "llmgw.tenant": self.tenant,
            "gen_ai.request.model": self.model,
            "llmgw.pool": self.pool,
            "server.address": self.endpoint,
            "url.path": self.path,
            "http.response.status_code": self.status,
            "llmgw.stream": self.streamed,
            "llmgw.complete": self.complete,
            "gen_ai.usage.input_tokens": usage.input_tokens if usage else None,
            "gen_ai.usage.output_tokens": usage.output_tokens if usage else None,
            "llmgw.usage.cached_tokens": usage.cached_tokens if usage else None,
            "llmgw.usage.estimated": estimated,
            "llmgw.time_to_first_byte_ms": round((self.first_byte_at - self.started) * 1000, 2)
            if self.first_byte_at else None,
            "llmgw.duration_ms": round((end - self.started) * 1000, 2),
            "llmgw.response_bytes": self.body_bytes,
        }
