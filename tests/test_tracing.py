"""Tracing: the sampling decision, the span written after the fact, baggage, and the config section."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode

from extproc.accounting import Decision, PhaseTiming, RequestRecord, ResponseFacts, Usage, build_record, rejection
from extproc.config import ConfigError, GatewaySpec, parse_config
from extproc.pricing import Prices
from extproc.telemetry.tracecontext import (
    BAGGAGE_MAX_BYTES,
    BAGGAGE_MAX_MEMBERS,
    baggage,
)
from extproc.telemetry.tracing import RequestTracer, Sampler

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"  # the gateway's span: the pod's parent
CLIENT_SPAN_ID = "b7ad6b7169203331"
T0 = 1_700_000_000_000_000_000  # epoch ns, when the request headers reached extproc


# ---------------------------------------------------------------------------------------------
# Sampler


def _trace_id(low64: int) -> str:
    return "0123456789abcdef" + f"{low64:016x}"


@pytest.mark.parametrize(("ratio", "low64", "expected"), [
    pytest.param(0.0, 0, False, id="ratio 0 samples nothing, not even the lowest id"),
    pytest.param(1.0, 2**64 - 1, True, id="ratio 1 samples everything, even the highest id"),
    pytest.param(0.5, 2**63 - 1, True, id="ratio 0.5: just below the bound"),
    pytest.param(0.5, 2**63, False, id="ratio 0.5: at the bound is out"),
    pytest.param(0.25, 2**62 - 1, True, id="ratio 0.25: just below the bound"),
    pytest.param(0.25, 2**62, False, id="ratio 0.25: at the bound is out"),
])
def test_sampler_ratio_on_the_trace_ids_low_64_bits(ratio: float, low64: int, expected: bool) -> None:
    assert Sampler(ratio).sampled(_trace_id(low64), None) is expected


@pytest.mark.parametrize("ratio", [0.0, 0.001, 0.1, 0.5, 0.9, 1.0])
def test_sampler_agrees_with_the_sdks_trace_id_ratio_based(ratio: float) -> None:
    ours, sdk = Sampler(ratio), TraceIdRatioBased(ratio)
    trace_ids = [f"{(n * 0x9E3779B97F4A7C15_9E3779B97F4A7C15) % 2**128:032x}" for n in range(1, 2000)]
    for trace_id in trace_ids:
        expected = sdk.should_sample(None, int(trace_id, 16), "x").decision.is_sampled()
        assert ours.sampled(trace_id, None) is expected, trace_id


@pytest.mark.parametrize(("ratio", "parent_flags", "expected"), [
    pytest.param(0.0, "01", True, id="client sampled: followed even at ratio 0"),
    pytest.param(1.0, "00", False, id="client not sampled: followed even at ratio 1"),
    pytest.param(0.0, "03", True, id="sampled bit among others (random flag)"),
    pytest.param(1.0, "02", False, id="random flag alone is not sampled"),
])
def test_sampler_follows_the_clients_flag(ratio: float, parent_flags: str, expected: bool) -> None:
    assert Sampler(ratio).sampled(_trace_id(0), parent_flags) is expected


@pytest.mark.parametrize(("parent_flags", "ratio", "expected"), [
    pytest.param(None, 1.0, "00", id="new trace: not sampled"),
    pytest.param("01", 1.0, "01", id="continued trace: the client's flags kept"),
])
def test_sampler_disabled_samples_nothing(parent_flags: str | None, ratio: float, expected: str) -> None:
    sampler = Sampler(ratio, enabled=False)
    assert sampler.sampled(_trace_id(0), parent_flags) is False
    assert sampler.flags(_trace_id(0), parent_flags) == expected


@pytest.mark.parametrize(("ratio", "parent_flags", "expected"), [
    pytest.param(1.0, None, "01", id="new trace sampled"),
    pytest.param(0.0, None, "00", id="new trace not sampled"),
    pytest.param(1.0, "00", "00", id="client's flags kept"),
    pytest.param(0.0, "03", "03", id="client's other flags kept too"),
])
def test_sampler_flags_for_the_pods_traceparent(ratio: float, parent_flags: str | None, expected: str) -> None:
    assert Sampler(ratio).flags(_trace_id(0), parent_flags) == expected


def test_sampler_refuses_a_ratio_outside_0_1() -> None:
    with pytest.raises(ValueError, match="1.5"):
        Sampler(1.5)


# ---------------------------------------------------------------------------------------------
# RequestTracer


def _decision(**changes: object) -> Decision:
    decision = Decision(
        id="lease-1", request_id="req-1", started_ns=T0, path="/v1/chat/completions", model="llama-3",
        served_model="meta-llama/Llama-3-8B", model_version="2024-06", pool="gpu-a", endpoint="10.0.0.7:8000",
        rule="model", stream=True, input_tokens=12, max_tokens=256, tenant="acme", qos="interactive",
        trace_id=TRACE_ID, span_id=SPAN_ID, parent_span_id=CLIENT_SPAN_ID, sampled=True,
        phases=(PhaseTiming("auth", T0 + 10_000, 20_000), PhaseTiming("route", T0 + 40_000, 1_500_000)))
    return replace(decision, **changes)


def _served(decision: Decision, **facts: object) -> RequestRecord:
    response = ResponseFacts(**{"status": 200, "end_ns": T0 + 900_000_000, "upstream": "10.0.0.8:8000",
                                "usage": Usage(12, 34), "first_event_ns": T0 + 50_000_000, **facts})
    return build_record(decision, response, Prices(input=1.0, output=2.0))


@pytest.fixture
def exported() -> Iterator[tuple[RequestTracer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(SimpleSpanProcessor(exporter), service_name="llmgw-test")
    yield tracer, exporter
    tracer.shutdown()


def _one_span(exporter: InMemorySpanExporter) -> ReadableSpan:
    spans = exporter.get_finished_spans()
    assert len(spans) == 1
    return spans[0]


def test_span_of_a_served_request(exported: tuple[RequestTracer, InMemorySpanExporter]) -> None:
    tracer, exporter = exported
    tracer.export(_served(_decision()))
    span = _one_span(exporter)
    assert span.name == "chat llama-3"  # GenAI: "{operation} {request model}"
    assert span.kind is SpanKind.CLIENT
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert f"{span.context.span_id:016x}" == SPAN_ID  # the id the pod's traceparent named
    assert span.parent is not None and span.parent.is_remote
    assert f"{span.parent.span_id:016x}" == CLIENT_SPAN_ID
    assert span.context.trace_flags.sampled
    assert (span.start_time, span.end_time) == (T0, T0 + 900_000_000)  # real times, not export time
    assert span.status.status_code is StatusCode.UNSET
    assert span.resource.attributes["service.name"] == "llmgw-test"
    assert dict(span.attributes or {}) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "llama-3",
        "gen_ai.response.model": "meta-llama/Llama-3-8B",
        "gen_ai.request.max_tokens": 256,
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 34,
        "server.address": "10.0.0.8",  # the pod Envoy reached, not the one extproc picked
        "server.port": 8000,
        "http.response.status_code": 200,
        "llmgw.id": "lease-1",
        "llmgw.request_id": "req-1",
        "llmgw.kind": "served",
        "llmgw.tenant": "acme",
        "llmgw.qos": "interactive",
        "llmgw.pool": "gpu-a",
        "llmgw.endpoint": "10.0.0.7:8000",
        "llmgw.model.version": "2024-06",
        "llmgw.usage.estimated": False,
        "llmgw.cost_usd": 0.00008,  # 12 * $1/M + 34 * $2/M
        "llmgw.time_to_first_token_ms": 50.0,
    }
    assert [(e.name, e.timestamp, dict(e.attributes or {})) for e in span.events] == [
        ("llmgw.auth", T0 + 10_000, {"llmgw.duration_ms": 0.02}),
        ("llmgw.route", T0 + 40_000, {"llmgw.duration_ms": 1.5}),
    ]


def test_root_span_without_a_client_parent(exported: tuple[RequestTracer, InMemorySpanExporter]) -> None:
    tracer, exporter = exported
    tracer.export(_served(_decision(parent_span_id="")))
    span = _one_span(exporter)
    assert span.parent is None
    assert f"{span.context.trace_id:032x}" == TRACE_ID  # the trace extproc started, not a new one
    assert f"{span.context.span_id:016x}" == SPAN_ID


def test_not_sampled_exports_nothing(exported: tuple[RequestTracer, InMemorySpanExporter]) -> None:
    tracer, exporter = exported
    tracer.export(_served(_decision(sampled=False)))
    assert exporter.get_finished_spans() == ()


def test_ids_are_per_span(exported: tuple[RequestTracer, InMemorySpanExporter]) -> None:
    tracer, exporter = exported
    tracer.export(_served(_decision()))
    tracer.export(_served(_decision(trace_id="0af7651916cd43dd8448eb211c80319c", span_id="b9c7c989f97918e1",
                                    parent_span_id="")))
    assert [(f"{s.context.trace_id:032x}", f"{s.context.span_id:016x}") for s in exporter.get_finished_spans()] == [
        (TRACE_ID, SPAN_ID), ("0af7651916cd43dd8448eb211c80319c", "b9c7c989f97918e1")]


@pytest.mark.parametrize(("record", "status", "error_type", "present"), [
    pytest.param(lambda d: _served(d, status=503), StatusCode.ERROR, "503", {"http.response.status_code": 503},
                 id="5xx from the pod is an error"),
    pytest.param(lambda d: _served(d, status=0, flags="UF", usage=None), StatusCode.ERROR, "UF", {},
                 id="no response: status 0, Envoy's flags say why"),
    pytest.param(lambda d: _served(d, status=0, usage=None), StatusCode.ERROR, "_OTHER", {},
                 id="no response and no flags"),
    pytest.param(lambda d: rejection(d, 429, "rate_limit_exceeded", T0 + 1_000_000), StatusCode.UNSET,
                 "rate_limit_exceeded", {"http.response.status_code": 429, "llmgw.kind": "rejected"},
                 id="the gateway's own 429 names its code but is not a gateway error"),
    pytest.param(lambda d: _served(d, status=404), StatusCode.UNSET, None, {"http.response.status_code": 404},
                 id="4xx from the pod is the client's problem"),
])
def test_error_status(exported: tuple[RequestTracer, InMemorySpanExporter],
                      record: Callable[[Decision], RequestRecord], status: StatusCode, error_type: str | None,
                      present: dict[str, object]) -> None:
    tracer, exporter = exported
    tracer.export(record(_decision()))
    span = _one_span(exporter)
    attributes = dict(span.attributes or {})
    assert span.status.status_code is status
    assert attributes.get("error.type") == error_type
    assert present.items() <= attributes.items()
    if "http.response.status_code" not in present:
        assert "http.response.status_code" not in attributes  # 0 is no HTTP status


def test_unknown_facts_are_left_out(exported: tuple[RequestTracer, InMemorySpanExporter]) -> None:
    tracer, exporter = exported
    decision = _decision(tenant="", qos="", model_version="", max_tokens=None, phases=())
    tracer.export(_served(decision, usage=None, first_event_ns=None, upstream=""))
    span = _one_span(exporter)
    attributes = dict(span.attributes or {})
    for key in ("llmgw.tenant", "llmgw.qos", "llmgw.model.version", "gen_ai.request.max_tokens",
                "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "llmgw.usage.estimated",
                "llmgw.cost_usd", "llmgw.time_to_first_token_ms", "llmgw.response_flags", "error.type"):
        assert key not in attributes, key
    assert (attributes["server.address"], attributes["server.port"]) == ("10.0.0.7", 8000)  # extproc's pick
    assert span.events == ()


def test_estimated_usage_is_marked(exported: tuple[RequestTracer, InMemorySpanExporter]) -> None:
    tracer, exporter = exported
    tracer.export(_served(_decision(), usage=None, content_events=7))
    attributes = dict(_one_span(exporter).attributes or {})
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (12, 7)
    assert attributes["llmgw.usage.estimated"] is True


def test_span_survives_the_metadata_round_trip(exported: tuple[RequestTracer, InMemorySpanExporter]) -> None:
    tracer, exporter = exported
    decision = Decision.from_metadata(_decision().metadata())  # as the access-log worker sees it
    tracer.export(_served(decision))
    span = _one_span(exporter)
    assert (f"{span.context.span_id:016x}", span.start_time) == (SPAN_ID, T0)
    assert [e.timestamp for e in span.events] == [T0 + 10_000, T0 + 40_000]


# ---------------------------------------------------------------------------------------------
# Baggage


@pytest.mark.parametrize(("items", "expected"), [
    pytest.param([("llmgw.request_id", "req-1"), ("llmgw.model.version", "2024-06"), ("llmgw.tenant", "acme")],
                 "llmgw.request_id=req-1,llmgw.model.version=2024-06,llmgw.tenant=acme", id="plain values as they are"),
    pytest.param([("k", "a b")], "k=a%20b", id="space"),
    pytest.param([("k", "a,b;c=d")], "k=a%2Cb%3Bc%3Dd", id="the header's own delimiters"),
    pytest.param([("k", "50%")], "k=50%25", id="percent itself"),
    pytest.param([("k", "a+b")], "k=a%2Bb", id="plus: some decoders read it as a space"),
    pytest.param([("k", 'q"\\')], "k=q%22%5C", id="quote and backslash"),
    pytest.param([("k", "café")], "k=caf%C3%A9", id="UTF-8 bytes of non-ASCII"),
    pytest.param([("k", "org/team:x@y")], "k=org/team:x@y", id="readable separators kept"),
    pytest.param([("k", "")], "k=", id="empty value"),
    pytest.param([], "", id="no members"),
])
def test_baggage_encoding(items: list[tuple[str, str]], expected: str) -> None:
    assert baggage(items) == expected


@pytest.mark.parametrize("value", ["a b+c,d;e=f%g\"h\\i", "ünïcødé ☃", "x" * 100])
def test_baggage_value_decodes_back(value: str) -> None:
    (member,) = baggage([("k", value)]).split(",")
    key, _, encoded = member.partition("=")
    assert (key, unquote(encoded)) == ("k", value)


@pytest.mark.parametrize("key", ["", "a b", "a,b", "a=b", "ключ"])
def test_baggage_refuses_a_key_that_is_not_a_token(key: str) -> None:
    with pytest.raises(ValueError, match="not a token"):
        baggage([(key, "v")])


def test_baggage_leaves_out_whole_members_past_the_limits() -> None:
    many = baggage((f"k{i}", "v") for i in range(BAGGAGE_MAX_MEMBERS + 5))
    assert many.count(",") == BAGGAGE_MAX_MEMBERS - 1
    big = baggage([("a", "x" * (BAGGAGE_MAX_BYTES - 10)), ("b", "y" * 20), ("c", "z")])
    assert big.split(",")[1:] == ["c=z"]  # b would not fit; it is dropped, never cut
    assert len(big) <= BAGGAGE_MAX_BYTES


# ---------------------------------------------------------------------------------------------
# The config section

BASE = {"pools": [{"name": "p", "endpoints": ["127.0.0.1:8000"]}], "models": [{"name": "m", "pool": "p"}]}


@pytest.mark.parametrize(("tracing", "message"), [
    pytest.param({"sample_ratio": 0.5}, "tracing.sample_ratio: unknown field", id="unknown key"),
    pytest.param({"sampling_ratio": 1.5}, "tracing.sampling_ratio: Input should be less than or equal to 1",
                 id="ratio above 1"),
    pytest.param({"sampling_ratio": -0.1}, "tracing.sampling_ratio: Input should be greater than or equal to 0",
                 id="negative ratio"),
    pytest.param({"endpoint": "collector:4318"}, "tracing.endpoint: 'collector:4318' is not an http:// or https:// URL",
                 id="endpoint without a scheme"),
    pytest.param({"headers": {"x-key": "a\nb"}}, "tracing.headers.x-key: a header value cannot hold a line break",
                 id="header value with a newline, not echoed"),
    pytest.param({"headers_env": {"x key": "KEY"}}, "'x key' is not an HTTP header name", id="bad header name"),
    pytest.param({"headers": {"X-Key": "a"}, "headers_env": {"x-key": "KEY"}},
                 "tracing: headers_env.x-key: also given in headers", id="one header from two places"),
    pytest.param({"enabled": True, "headers_env": {"x-key": "LLMGW_TEST_UNSET"}},
                 "tracing.headers_env.x-key: environment variable LLMGW_TEST_UNSET is not set", id="env var unset"),
])
def test_tracing_config_errors_name_the_field(tracing: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config({**BASE, "tracing": tracing}, env={})
    assert message in str(error.value)


def test_tracing_config_compiles_with_secrets_redacted() -> None:
    config = parse_config({**BASE, "tracing": {
        "enabled": True, "endpoint": "https://otel.example/v1/traces", "sampling_ratio": 0.25,
        "headers": {"x-tenant": "ops"}, "headers_env": {"authorization": "OTEL_TOKEN"}, "timeout_s": 2}},
        env={"OTEL_TOKEN": "Bearer s3cret"})
    tracing = config.tracing
    assert (tracing.enabled, tracing.endpoint, tracing.sampling_ratio, tracing.timeout_s) == (
        True, "https://otel.example/v1/traces", 0.25, 2.0)
    assert dict(tracing.headers) == {"x-tenant": "ops", "authorization": "Bearer s3cret"}
    assert "s3cret" not in repr(config) and "ops" not in repr(tracing)
    assert "ops" not in repr(GatewaySpec.model_validate({**BASE, "tracing": {"headers": {"x-tenant": "ops"}}}))
    assert Sampler.from_config(tracing).ratio == 0.25


def test_tracing_is_off_by_default_and_needs_no_environment() -> None:
    config = parse_config({**BASE, "tracing": {"headers_env": {"authorization": "OTEL_TOKEN"}}}, env={})
    assert config.tracing.enabled is False and config.tracing.headers == ()
    assert Sampler.from_config(config.tracing).sampled(TRACE_ID, "01") is False
    assert parse_config(BASE, env={}).tracing.endpoint == "http://127.0.0.1:4318/v1/traces"


def test_otel_sdk_disabled_turns_tracing_off_whatever_the_file_says() -> None:
    # OpenTelemetry's own switch: the compose stack runs without its tracing profile this way.
    enabled = {**BASE, "tracing": {"enabled": True, "headers_env": {"authorization": "OTEL_TOKEN"}}}
    assert parse_config(enabled, env={"OTEL_SDK_DISABLED": "true"}).tracing.enabled is False  # no token needed
    assert parse_config(enabled, env={"OTEL_SDK_DISABLED": "false", "OTEL_TOKEN": "t"}).tracing.enabled is True


Received = list[tuple[str, dict[str, str], bytes]]  # path, headers, body of each POST


@pytest.fixture
def collector() -> Iterator[tuple[str, Received]]:
    """An OTLP/HTTP receiver on the loopback: its traces URL and what it was sent."""
    received: Received = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            received.append((self.path, dict(self.headers.items()), body))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass  # keep the test output clean

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1/traces", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_tracer_from_config_sends_otlp_http(collector: tuple[str, Received]) -> None:
    url, received = collector
    config = parse_config({**BASE, "tracing": {
        "enabled": True, "endpoint": url, "timeout_s": 5, "service_name": "gw-1",
        "headers_env": {"x-api-key": "COLLECTOR_KEY"}}}, env={"COLLECTOR_KEY": "k1"})
    tracer = RequestTracer.from_config(config.tracing)
    tracer.export(_served(_decision()))
    tracer.export(_served(_decision(sampled=False)))
    tracer.shutdown()  # sends the batch
    (path, headers, body), = received
    assert path == "/v1/traces"
    assert headers["x-api-key"] == "k1"
    (resource_spans,) = ExportTraceServiceRequest.FromString(body).resource_spans
    assert {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"] == "gw-1"
    (span,) = [s for scope in resource_spans.scope_spans for s in scope.spans]
    assert (span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex()) == (TRACE_ID, SPAN_ID, CLIENT_SPAN_ID)
    assert (span.start_time_unix_nano, span.end_time_unix_nano) == (T0, T0 + 900_000_000)
