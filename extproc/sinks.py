"""Where a request's one record goes: quota settlement, the usage ledger, Prometheus metrics, the
JSON access log and the trace span. Each sink takes the ``RequestRecord`` as it is.

Settlement is idempotent: a record id seen before (a duplicated access-log entry) is dropped here,
and across processes the quota store's release of a lease is a no-op the second time and ledger
readers count a record id once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from extproc.accounting import CACHE_MISS, CACHED, Decision, RequestRecord, ResponseFacts, build_record, micro_dollars
from extproc.cache.answers import NotCacheable, parse_answer
from extproc.config import GatewayConfig
from extproc.ledger import LedgerSink, ledger_record, unsettled_record
from extproc.quota import QuotaStore, StoreUnavailable
from extproc.quota.limits import Lease
from extproc.routing.feedback import RoutingFeedback

if TYPE_CHECKING:
    from extproc.cache.store import ResponseCache
    from extproc.telemetry.metrics import GatewayMetrics

log = logging.getLogger("llmgw.settlement")
access_log = logging.getLogger("llmgw.access")
SEEN_LIMIT = 65536  # record ids remembered for deduplication (~5 MB at most)


class SpanSink(Protocol):
    """Exports a record as a trace span (``extproc.telemetry.tracing.RequestTracer``)."""

    def export(self, record: RequestRecord) -> None:
        """Export ``record``'s span if it was sampled."""
        ...


class Settlement:
    """Gives each request's one record to every sink. Records come in two ways: ``finished`` builds
    a forwarded request's from its access-log entry (whichever worker it reaches); ``answered``
    takes the one the director built for a request it answered itself (a refusal, a cache hit)."""

    def __init__(self, feedback: RoutingFeedback, config: Callable[[], GatewayConfig], store: QuotaStore,
                 ledger: LedgerSink | None = None, metrics: GatewayMetrics | None = None,
                 tracer: SpanSink | None = None, cache: ResponseCache | None = None) -> None:
        self.feedback = feedback  # routing hears of each finished request here, and only here
        self._config = config  # the gateway's current config snapshot (prices, caches, fallback chains)
        self.cache = cache
        self.store = store
        self.ledger = ledger
        self.metrics = metrics
        self.tracer = tracer
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self.settled = 0
        self.duplicates = 0
        self.missed = 0

    def finished(self, decision: Decision, response: ResponseFacts) -> RequestRecord | None:
        """A forwarded request ended (Envoy's final access-log entry): settle it, once."""
        if not self._first(decision.id):
            self.duplicates += 1
            return None
        # Priced as the model that answered: the fallback's when Envoy's last attempt went to it (the
        # pod that answered is one of its pool's; an upstream filter's metadata never reaches the log).
        spare = self._spare_model(decision, response.upstream)
        model = self._config().lookup(spare or decision.served_model)
        record = build_record(decision, response, model.prices if model is not None else None)
        for scope, name, state in self.feedback.finished(record, response.retry_after_s, spare is not None):
            log.warning("circuit breaker of %s %s: %s", scope, name, state)
            if self.metrics is not None:
                self.metrics.breaker(scope, name, state)
        if decision.lease is not None:
            tokens, cost = record.charge()
            self._spawn(self.store.release(decision.lease, tokens, cost))
        if decision.cache == CACHE_MISS and response.body is not None and self.cache is not None:
            self._keep(record, response.body)
        self._sinks(record, ledger=True)
        self.settled += 1
        return record

    def _spare_model(self, decision: Decision, upstream: str) -> str | None:
        """The fallback model whose pod answered (Envoy's last attempt), if one of its chain did."""
        config = self._config()
        pool, model = config.pools.get(decision.pool), config.lookup(decision.served_model)
        if not upstream or pool is None or model is None or upstream in pool.endpoints:
            return None
        return next((name for name in model.fallback if upstream in config.models_by_name[name].pool.endpoints), None)

    def answered(self, record: RequestRecord, charged: bool = False) -> None:
        """A request the gateway answered itself (the director built its record when it replied):
        a refusal goes to the metrics, the access log and, for a known tenant, the ledger (an
        unauthenticated request has nobody to bill); a cache hit's lease settles with no tokens and
        no cost (unless the cache ``charged`` its hits), so it counts against request limits only."""
        if record.kind == CACHED:
            self._cached(record, charged)
        else:
            self._sinks(record, ledger=bool(record.decision.tenant))

    def _cached(self, record: RequestRecord, charged: bool) -> None:
        if not self._first(record.id):
            return
        lease = record.decision.lease
        if lease is not None:
            usage = record.usage
            tokens = usage.total if charged and usage is not None else 0
            self._spawn(self.store.release(lease, tokens, micro_dollars(record.cost_usd) if charged else 0))
        self._sinks(record, ledger=bool(record.decision.tenant))

    def _keep(self, record: RequestRecord, body: bytes) -> None:
        """Store a miss's complete answer under its key (a cut or failed one is not kept)."""
        decision = record.decision
        config = self._config()
        model = config.lookup(decision.served_model)
        spec = config.cache_for(decision.rule, model) if model is not None else None
        if spec is None or record.status != 200 or not record.complete or len(body) > spec.max_entry_bytes:
            return
        try:
            value = parse_answer(decision.path, body, record.streamed)
        except NotCacheable as error:
            log.debug("answer of %s not cached: %s", decision.request_id, error)
            return
        assert self.cache is not None
        self._spawn(self._store(bytes.fromhex(decision.cache_key), value, spec.ttl_s, spec.stale_ttl_s))

    async def _store(self, key: bytes, value: bytes, ttl_s: float, stale_ttl_s: float) -> None:
        assert self.cache is not None
        try:
            await self.cache.store(key, value, ttl_s, stale_ttl_s)
        except Exception as error:  # noqa: BLE001 (an answer not kept is a later miss, not an error)
            log.warning("response cache store failed: %s", str(error) or type(error).__name__)

    def unsettled(self, decisions: list[Decision]) -> None:
        """Requests decided here whose access-log entry never came here: each gets a ledger mark
        (readers drop it if another worker settled the request) and the count is logged once."""
        if not decisions:
            return
        self.missed += len(decisions)
        if self.metrics is not None:
            self.metrics.unsettled.inc(len(decisions))
        log.error("%d requests decided here got no access-log entry (Envoy's access-log stream to extproc "
                  "may be down): their leases come back by TTL; the ledger marks them unsettled (first: %s)",
                  len(decisions), decisions[0].request_id)
        if self.ledger is not None:
            for decision in decisions:
                self._spawn(self.ledger.append(unsettled_record(decision)))

    def release(self, lease: Lease) -> None:
        """Give back a lease whose request failed inside the gateway (it never reached a pod)."""
        self._spawn(self.store.release(lease))

    def running(self, decision: Decision) -> None:
        """A periodic entry: the request still runs; its lease is renewed for another TTL."""
        self.feedback.running(decision.id)
        if decision.lease is not None and decision.id not in self._seen:
            self._spawn(self._renew(decision))

    async def _renew(self, decision: Decision) -> None:
        assert decision.lease is not None
        try:
            renewed = await self.store.renew(decision.lease)
        except StoreUnavailable:
            return  # the lease may lapse while the store is away; settling is still attempted
        if renewed is None:
            log.warning("lease of request %s expired before renewal", decision.request_id)

    def _sinks(self, record: RequestRecord, ledger: bool) -> None:
        if self.metrics is not None:
            self.metrics.record(record)
        if self.ledger is not None and ledger:
            self._spawn(self.ledger.append(ledger_record(record)))
        _log(record)
        if self.tracer is not None:
            self.tracer.export(record)

    def _first(self, record_id: str) -> bool:
        if record_id in self._seen:
            return False
        self._seen[record_id] = None
        if len(self._seen) > SEEN_LIMIT:
            self._seen.popitem(last=False)
        return True

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)  # keep a reference until done (asyncio holds tasks weakly)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the sinks' writes in flight (at shutdown)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _log(record: RequestRecord) -> None:
    if access_log.isEnabledFor(logging.INFO):
        access_log.info("%s", orjson.dumps(record.log_fields()).decode())
