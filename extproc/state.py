"""What one request carries through its phases (one per ext_proc stream): typed, O(1) once the
body is analyzed (the parsed JSON is never kept)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from extproc.accounting import Phase
from extproc.api import ApiError, Operation
from extproc.body import BodyFacts
from extproc.config import Model, Pool, Tenant
from extproc.decisions import Headers
from extproc.quota.limits import Lease
from extproc.telemetry.tracecontext import TraceContext


@dataclass(slots=True)
class RequestState:
    """One request's facts and decisions so far."""

    id: str  # unique per request, chosen by the gateway: the lease id and the settlement key
    started: float  # monotonic
    started_ns: int  # wall clock, epoch nanoseconds (the span's start, wherever it is finished)
    path: str = ""
    request_id: str = ""
    trace: TraceContext | None = None
    sampled: bool = False  # the request's span is exported (tracing on, and sampled in)
    operation: Operation | None = None
    model: Model | None = None
    pool: Pool | None = None  # the model's own pool, or the one a routing rule chose
    endpoint: str | None = None
    facts: BodyFacts | None = None  # what the body said; the parsed JSON itself is not kept
    new_body: bytes | None = None  # the body to forward when it changed; dropped once sent
    body: bytes | None = None  # the body as received, until the request is decided (a fallback rewrites it)
    fallback_from: str = ""  # the model whose pool could not serve it (its breaker open)
    spare: tuple[Model, Pool] | None = None  # the fallback model Envoy's last attempt goes to if the pod refuses
    rejected: ApiError | None = None
    tenant: Tenant | None = None
    qos: str = ""  # the tenant's QoS class for this request
    reserved_tokens: int = 0
    reserved_cost: int = 0  # micro-dollars
    lease: Lease | None = None  # a quota admission, settled from the access log (or at a failure)
    settled: bool = False
    rate_headers: Headers = ()
    cache_key: bytes | None = None  # the response cache's key of a cacheable request
    cached: bytes | None = None  # the stored answer a hit was answered with
    cache_stale: bool = False  # ... a stale one, as no pool could serve the request
    phases: list[Phase] = field(default_factory=list)
    _origin: int = 0  # perf_counter_ns at started_ns
    _phase_start: int = 0  # perf_counter_ns at the start of the phase being timed

    def identity_headers(self) -> Headers:
        """Headers that go to the pod and back to the client: ``x-request-id`` and ``traceparent``."""
        if self.trace is None:
            return ()
        return (("x-request-id", self.request_id), ("traceparent", self.trace.traceparent))

    def begin(self) -> None:
        """Start timing a phase (``end`` names it)."""
        self._phase_start = time.perf_counter_ns()

    def end(self, name: str) -> None:
        """Record the phase begun last, on the request's wall clock."""
        now = time.perf_counter_ns()
        offset = self._phase_start - self._origin
        self.phases.append(Phase(name, self.started_ns + offset, now - self._phase_start))
        self._phase_start = now


def new_state(record_id: str) -> RequestState:
    """State for a new request, its clocks read once."""
    perf = time.perf_counter_ns()
    return RequestState(id=record_id, started=time.monotonic(), started_ns=time.time_ns(), _origin=perf,
                        _phase_start=perf)
