"""OpenTelemetry tracing: the sampling decision, and one span per finished request.

The gateway's span is known in two halves. extproc chooses its ids when the request headers arrive
(the pod's ``traceparent`` names it as the parent, ``extproc.telemetry.tracecontext``) and decides
there whether the trace is sampled (``Sampler``). The span is written only after the request ended,
from its ``RequestRecord``, maybe in another process: ``RequestTracer.export`` builds it whole, with
the ids chosen then and the real start and end times, and hands it to the SDK's span processor.

Names follow the OpenTelemetry GenAI semantic conventions (``gen_ai.*``), ``llmgw.*`` else.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util.types import AttributeValue

from extproc.accounting import RequestRecord
from extproc.config import Tracing

_TRACE_ID_LIMIT = 1 << 64  # TraceIdRatioBased compares the trace id's low 64 bits
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK, _ERROR = Status(StatusCode.UNSET), StatusCode.ERROR


class Sampler:
    """Parent-based, else trace-id-ratio-based sampling, decided as OpenTelemetry's SDK would
    (``ParentBased(TraceIdRatioBased(ratio))``): the same trace id gets the same answer everywhere."""

    __slots__ = ("_bound", "enabled", "ratio")

    def __init__(self, ratio: float = 1.0, *, enabled: bool = True) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"sampling ratio {ratio} is not within [0, 1]")
        self.enabled = enabled
        self.ratio = ratio
        self._bound = round(ratio * _TRACE_ID_LIMIT)  # TraceIdRatioBased.get_bound_for_rate

    @classmethod
    def from_config(cls, tracing: Tracing) -> Sampler:
        """The sampler of a compiled ``tracing`` section."""
        return cls(tracing.sampling_ratio, enabled=tracing.enabled)

    def sampled(self, trace_id_hex: str, parent_flags: str | None) -> bool:
        """Whether the gateway records this trace: the client's sampled flag (bit 0 of its
        traceparent's trace-flags) when it sent one, else the trace id's low 64 bits below
        ``ratio * 2**64``. Never, with tracing disabled."""
        if not self.enabled:
            return False
        if parent_flags is not None:
            return bool(int(parent_flags, 16) & 0x01)
        return int(trace_id_hex[-16:], 16) < self._bound

    def flags(self, trace_id_hex: str, parent_flags: str | None) -> str:
        """The trace-flags for the pod's traceparent: the client's own when it sent some (a
        continued trace keeps its decision), else ``01`` or ``00`` as ``sampled`` decides."""
        if parent_flags is not None:
            return parent_flags
        return "01" if self.sampled(trace_id_hex, None) else "00"


@dataclass(frozen=True, slots=True)
class BatchSpan:
    """What the coordinator knows of one merged call, for its span."""

    batch_id: str
    trace_id: str  # 32 hex: the batch's own trace
    span_id: str  # 16 hex: also the pod call's parent (its traceparent)
    model: str
    endpoint: str
    reason: str  # why the batch left (full, window, room)
    members: tuple[tuple[str, str, bool], ...]  # each member's gateway span: (trace id, span id, sampled)
    start_ns: int
    end_ns: int
    error: str | None = None


class RequestTracer:
    """Writes the gateway's span of each sampled request, from its record (``export``).

    The span is not started through a ``Tracer``, which would stamp it with new ids and the present
    time: it is built whole as the ``ReadableSpan`` exporters read. That also skips the SDK's
    per-attribute checks, typed here by construction: about 10 us a span instead of 50."""

    def __init__(self, processor: SpanProcessor, service_name: str = "llmgw") -> None:
        self._processor = processor
        self._resource = Resource.create({"service.name": service_name})
        self._scope = InstrumentationScope("llmgw")

    @classmethod
    def from_config(cls, tracing: Tracing) -> RequestTracer:
        """A tracer batching its spans to the OTLP/HTTP endpoint of a compiled ``tracing`` section."""
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as error:  # xds-protos installed last overwrites opentelemetry/proto/common
            raise ImportError(f"the OTLP exporter cannot load ({error}): reinstall opentelemetry-proto after "
                              "xds-protos (pip install --force-reinstall --no-deps opentelemetry-proto)") from error
        exporter = OTLPSpanExporter(endpoint=tracing.endpoint, headers=dict(tracing.headers),
                                    timeout=tracing.timeout_s)
        return cls(BatchSpanProcessor(exporter), tracing.service_name)

    def export(self, record: RequestRecord) -> None:
        """Write the span of one finished request (nothing when its trace is not sampled): kind
        CLIENT, the decision's trace and span ids, the client's span as its parent when there was
        one (a root span of the trace otherwise), from the request's arrival to its last byte, one
        event per decision phase.

        Raises ``ValueError`` when the decision's ids are not hexadecimal."""
        d = record.decision
        if not d.sampled:
            return
        trace_id = int(d.trace_id, 16)
        context = SpanContext(trace_id, int(d.span_id, 16), is_remote=False, trace_flags=_SAMPLED)
        parent = SpanContext(trace_id, int(d.parent_span_id, 16), is_remote=True, trace_flags=_SAMPLED) \
            if d.parent_span_id else None
        events = tuple(Event(f"llmgw.{phase.name}", {"llmgw.duration_ms": round(phase.duration_ns / 1e6, 3)},
                             phase.start_ns) for phase in d.phases)
        failed = record.status == 0 or record.status >= 500
        status = Status(_ERROR, record.error or record.flags or None) if failed else _OK
        self._processor.on_end(ReadableSpan(
            name=f"{record.operation} {d.model}" if d.model else record.operation,
            context=context, parent=parent, resource=self._resource, attributes=_attributes(record),
            events=events, kind=SpanKind.CLIENT, status=status, start_time=d.started_ns,
            end_time=max(record.end_ns, d.started_ns), instrumentation_scope=self._scope))

    def export_batch(self, batch: BatchSpan) -> None:
        """Write the span of one merged call to a pod (nothing when no member's trace is sampled):
        kind CLIENT, the root of a trace of its own (its members are in many traces), linked to
        every member's gateway span."""
        sampled = [(trace, span) for trace, span, is_sampled in batch.members if is_sampled]
        if not sampled:
            return
        context = SpanContext(int(batch.trace_id, 16), int(batch.span_id, 16), is_remote=False, trace_flags=_SAMPLED)
        links = tuple(Link(SpanContext(int(trace, 16), int(span, 16), is_remote=True, trace_flags=_SAMPLED))
                      for trace, span in sampled)
        attributes: dict[str, AttributeValue] = {
            "gen_ai.operation.name": "text_completion", "gen_ai.request.model": batch.model,
            "server.address": batch.endpoint, "llmgw.batch.id": batch.batch_id, "llmgw.batch.size": len(batch.members),
            "llmgw.batch.reason": batch.reason}
        status = _OK if batch.error is None else Status(_ERROR, batch.error)
        self._processor.on_end(ReadableSpan(
            name=f"batch {batch.model}", context=context, parent=None, resource=self._resource,
            attributes=attributes, links=links, kind=SpanKind.CLIENT, status=status, start_time=batch.start_ns,
            end_time=max(batch.end_ns, batch.start_ns), instrumentation_scope=self._scope))

    def shutdown(self) -> None:
        """Send the spans still queued, then stop the exporter."""
        self._processor.shutdown()


def _attributes(record: RequestRecord) -> dict[str, AttributeValue]:
    """The span's attributes; a fact that is unknown or empty is left out."""
    d, usage = record.decision, record.usage
    server = record.upstream or d.endpoint
    host, _, port = server.rpartition(":")
    values: dict[str, AttributeValue | None] = {
        "gen_ai.operation.name": record.operation,
        "gen_ai.request.model": d.model,
        "gen_ai.response.model": d.served_model,
        "gen_ai.request.max_tokens": d.max_tokens,
        # server.address is the host alone, its port apart (OTel general attributes)
        "server.address": host.strip("[]") if port.isdigit() else server,
        "server.port": int(port) if port.isdigit() else None,
        "http.response.status_code": record.status or None,
        "llmgw.id": d.id,
        "llmgw.request_id": d.request_id,
        "llmgw.kind": record.kind,
        "llmgw.tenant": d.tenant,
        "llmgw.qos": d.qos,
        "llmgw.pool": d.pool,
        "llmgw.endpoint": d.endpoint,
        "llmgw.model.version": d.model_version,
        "llmgw.response_flags": record.flags,
        "llmgw.time_to_first_token_ms": record.ttft_ms,
        "error.type": _error_type(record),
    }
    if usage is not None:
        values["gen_ai.usage.input_tokens"] = usage.input_tokens
        values["gen_ai.usage.output_tokens"] = usage.output_tokens
        values["llmgw.usage.estimated"] = record.usage_estimated
        values["llmgw.cost_usd"] = record.cost_usd
    return {key: value for key, value in values.items() if value is not None and value != ""}


def _error_type(record: RequestRecord) -> str | None:
    """The gateway's OpenAI error code; else the status of a failed response (``503``), or
    Envoy's response flags when none reached the client (OTel: ``_OTHER`` when nothing says more)."""
    if record.error:
        return record.error
    if record.status >= 500:
        return str(record.status)
    if record.status == 0:
        return record.flags or "_OTHER"
    return None
