"""End to end: OpenTelemetry spans through the real stack, exported over OTLP/HTTP to a collector
this test runs. The span is finished from the access-log entry, with the request's real times."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from extproc.launcher import StackInfo
from extproc.ledger import read_file
from tests.e2e.conftest import MODEL, small_stack
from tests.e2e.test_cli_up import STARTUP_S
from tests.e2e.test_gateway_e2e import pod_request_with_id
from tests.helpers import wait_for

KEY = "sk-trace-tenant"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP traces receiver on the loopback."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                request = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["content-length"])))
                collector.spans += [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def span_of(self, trace_id: str) -> Span | None:
        return next((s for s in self.spans if s.trace_id.hex() == trace_id), None)


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StackInfo, Collector]]:
    collector = Collector()
    collector.thread.start()
    extra = {"tracing": {"enabled": True, "endpoint": collector.url, "sampling_ratio": 1.0},
             "models": [{"name": MODEL, "pool": "local", "version": "2026-11-rc1"}],
             "tenants": [{"name": "team-t", "keys": [{"env": "TRACE_KEY"}], "limits": {"rpm": 1000}}]}
    stack = small_stack(tmp_path_factory, "traced", pods=1, extra_config=extra, sim_args=("--record", "50"),
                        env={"TRACE_KEY": KEY, "OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        with stack as info:
            yield info, collector
    finally:
        collector.server.shutdown()
        collector.server.server_close()


def _chat(info: StackInfo, request_id: str, traceparent: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEY}", "x-request-id": request_id}
    if traceparent:
        headers["traceparent"] = traceparent
    response = httpx.post(f"{info.base_url}/v1/chat/completions", headers=headers, timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 5})
    assert response.status_code == 200
    return response


def _attributes(span: Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        out[a.key] = getattr(a.value, kind)
    return out


def test_the_span_continues_the_clients_trace_and_parents_the_pods(traced: tuple[StackInfo, Collector]) -> None:
    info, collector = traced
    request_id = f"trace-{uuid.uuid4()}"
    started = time.time_ns()
    usage = _chat(info, request_id, f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01").json()["usage"]
    ended = time.time_ns()
    seen = pod_request_with_id(info, request_id)["headers"]
    pod_traceparent = seen["traceparent"]  # type: ignore[index]
    _, trace_id, gateway_span, flags = pod_traceparent.split("-")
    assert (trace_id, flags) == (CLIENT_TRACE, "01") and gateway_span != CLIENT_SPAN
    # The seeds' trace colouring reaches the pod as W3C baggage.
    assert seen["baggage"] == (f"llmgw.request_id={request_id},llmgw.model.version=2026-11-rc1,"  # type: ignore[index]
                               "llmgw.tenant=team-t")
    span = wait_for("the span at the collector", lambda: next(
        (s for s in collector.spans if s.span_id.hex() == gateway_span), None), STARTUP_S)
    # One trace: the client's span is the gateway's parent, the gateway's is the pod's.
    assert (span.trace_id.hex(), span.parent_span_id.hex()) == (CLIENT_TRACE, CLIENT_SPAN)
    assert span.kind == Span.SPAN_KIND_CLIENT and span.name == f"chat {MODEL}"
    assert started <= span.start_time_unix_nano < span.end_time_unix_nano <= ended  # its real times
    attributes = _attributes(span)
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert (attributes["gen_ai.request.model"], attributes["gen_ai.response.model"]) == (MODEL, MODEL)
    assert (attributes["llmgw.tenant"], attributes["llmgw.pool"], attributes["llmgw.model.version"]) == (
        "team-t", "local", "2026-11-rc1")
    assert attributes["gen_ai.request.max_tokens"] == 5
    assert {e.name for e in span.events} >= {"llmgw.auth", "llmgw.tokens", "llmgw.quota", "llmgw.route"}


def test_a_sampled_out_request_is_still_accounted(traced: tuple[StackInfo, Collector]) -> None:
    info, collector = traced
    request_id = f"unsampled-{uuid.uuid4()}"
    trace_id = uuid.uuid4().hex
    _chat(info, request_id, f"00-{trace_id}-{CLIENT_SPAN}-00")  # the client did not sample this trace
    ledger = info.log_dir.parent / "usage.jsonl"
    (record,) = wait_for("the ledger record", lambda: [r for r in read_file(ledger) if r.request_id == request_id]
                         if ledger.exists() else [], STARTUP_S)
    assert record.output_tokens == 5 and record.tenant == "team-t"
    sampled_id = f"sampled-{uuid.uuid4()}"  # a later sampled request's span arrives: the batch was sent
    _chat(info, sampled_id, f"00-{uuid.uuid4().hex}-{CLIENT_SPAN}-01")
    wait_for("a later span", lambda: len(collector.spans) > 0 and any(
        _attributes(s).get("llmgw.request_id") == sampled_id for s in collector.spans), STARTUP_S)
    assert collector.span_of(trace_id) is None
