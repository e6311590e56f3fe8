"""What one request carries through its phases (one per ext_proc stream): typed, O(1) once the
body is analyzed (the parsed JSON is never kept)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from extproc.accounting import CACHE_HIT, CACHE_MISS, CACHE_STALE, Decision, PhaseTiming
from extproc.api import ApiError, Operation
from extproc.body import BodyFacts
from extproc.config import Model, Pool, Tenant
from extproc.quota.limits import Lease
from extproc.steps import Headers, Reply
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
    # The client's Cache-Control: no-cache (answered by a pod, not from the cache; the answer is
    # still stored), no-store (the cache is bypassed: nothing read, nothing stored).
    cache_read: bool = True
    cache_write: bool = True
    cached: bytes | None = None  # the stored answer a hit was answered with
    cache_stale: bool = False  # ... a stale one, as no pool could serve the request
    phases: list[PhaseTiming] = field(default_factory=list)
    _origin: int = 0  # perf_counter_ns at started_ns
    _phase_start: int = 0  # perf_counter_ns at the start of the phase being timed

    def identity_headers(self) -> Headers:
        """Headers that go to the pod and back to the client: ``x-request-id`` and ``traceparent``."""
        if self.trace is None:
            return ()
        return (("x-request-id", self.request_id), ("traceparent", self.trace.traceparent))

    def reject(self, error: ApiError, extra: Headers = ()) -> Reply:
        """Answer the request with ``error`` (it is then a rejection, recorded as such)."""
        self.rejected = error
        return Reply.error(error, (*self.identity_headers(), *extra))

    def decision(self, endpoint: str = "") -> Decision:
        """The request's decision so far (a refused request has no pool nor endpoint): what travels
        with it as Envoy metadata, and what its record is built from."""
        facts, model, trace = self.facts, self.model, self.trace
        pool = self.pool or (model.pool if model is not None else None)
        cache = "" if self.cache_key is None else (CACHE_STALE if self.cache_stale else CACHE_HIT) \
            if self.cached is not None else CACHE_MISS
        return Decision(
            id=self.id, request_id=self.request_id, started_ns=self.started_ns, path=self.path,
            model=facts.model if facts is not None else "", served_model=model.name if model is not None else "",
            model_version=model.version if model is not None else "", pool=pool.name if pool is not None else "",
            endpoint=endpoint, rule=facts.chosen_by if model is not None and facts is not None else "",
            stream=facts.stream if facts is not None else False,
            input_tokens=facts.input_tokens if facts is not None else 0,
            max_tokens=facts.output_limit if facts is not None else None, n=facts.n if facts is not None else 1,
            tenant=self.tenant.name if self.tenant is not None else "", qos=self.qos,
            trace_id=trace.trace_id if trace else "", span_id=trace.span_id if trace else "",
            parent_span_id=(trace.parent_span_id or "") if trace else "", sampled=self.sampled,
            lease=self.lease, phases=tuple(self.phases), intent=facts.intent if facts is not None else "",
            score=facts.score if facts is not None else None, cache=cache, fallback_from=self.fallback_from,
            cache_key=self.cache_key.hex() if self.cache_key is not None and self.cached is None else "")

    def begin(self) -> None:
        """Start timing a phase (``end`` names it)."""
        self._phase_start = time.perf_counter_ns()

    def end(self, name: str) -> None:
        """Record the phase begun last, on the request's wall clock."""
        now = time.perf_counter_ns()
        offset = self._phase_start - self._origin
        self.phases.append(PhaseTiming(name, self.started_ns + offset, now - self._phase_start))
        self._phase_start = now


def new_state(record_id: str) -> RequestState:
    """State for a new request, its clocks read once."""
    perf = time.perf_counter_ns()
    return RequestState(id=record_id, started=time.monotonic(), started_ns=time.time_ns(), _origin=perf,
                        _phase_start=perf)
