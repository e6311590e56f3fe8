"""The extproc process's Prometheus metrics, named after the OpenTelemetry GenAI semantic conventions
where one exists (``gen_ai.client.token.usage`` -> ``gen_ai_client_token_usage``), ``llmgw_*`` else.

Each request is recorded once, from its ``RequestRecord`` (``record``): when its access-log entry
is settled, or when the gateway answers it itself. Quota-store and ledger health is copied
from their counters once a second (``sync``), so neither needs to know about Prometheus. Each
pool's load as last scraped from its pods (``llmgw_pool_*``, what autoscalers read) is set
whenever pod state lands (``pool_feed``, given to ``PodStates(on_update=...)``).

Several worker processes: the launcher points ``PROMETHEUS_MULTIPROC_DIR`` at a directory of the
node and serves the sum of every worker's files on one ``/metrics`` port (``serve_metrics``).
"""

from __future__ import annotations

import math
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess, start_http_server

from extproc.accounting import CACHED, REJECTED, RequestRecord
from extproc.config import GatewayConfig
from extproc.routing.breaker import STATE_VALUES
from extproc.routing.podstate import PodState, PoolLoad, pool_loads

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# The semantic conventions' advisory bucket boundaries.
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)



class StoreStats(Protocol):
    """The quota store's fallback counters (``extproc.quota.FallbackStats``)."""

    outages: int
    local_admissions: int
    lost_settlements: int
    in_outage: bool


class LedgerStats(Protocol):
    """A buffering ledger's counters (``extproc.ledger.RedisLedger``)."""

    @property
    def buffered(self) -> int: ...

    dropped: int
    unreplicated: int


class ClassifierCounts(Protocol):
    """Semantic routing's counters (``extproc.routing.classifier.ClassifierStats``)."""

    @property
    def outcomes(self) -> Mapping[str, int]: ...

    @property
    def embed_seconds(self) -> float: ...


class CacheCounts(Protocol):
    """The response cache's counters (``extproc.cache.store.CacheCounters``)."""

    hits: int
    hot: int
    misses: int
    filtered: int
    errors: int
    warmed: int
    shadow: int
    stored: int

# llmgw_cache_lookups_total's outcomes (CacheCounts' fields, less "stored": a counter of its own)
CACHE_OUTCOMES = ("hit", "hot", "miss", "filtered", "error", "warmed", "shadow")


class GatewayMetrics:
    """Every metric of one extproc process, in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ("gen_ai_operation_name", "gen_ai_request_model", "llmgw_tenant")
        self.token_usage = Histogram(
            "gen_ai_client_token_usage", "Tokens per request (gen_ai.client.token.usage), input and output",
            (*labels, "gen_ai_token_type"), buckets=TOKEN_BUCKETS, registry=self.registry)
        self.duration = Histogram(
            "gen_ai_client_operation_duration_seconds",
            "Request duration from the gateway to the end of the response (gen_ai.client.operation.duration)",
            (*labels, "http_response_status_code"), buckets=DURATION_BUCKETS, registry=self.registry)
        self.time_to_first_token = Histogram(
            "llmgw_time_to_first_token_seconds", "Time to the first generated content of a streamed response",
            labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.cost = Counter("llmgw_usage_cost_usd", "Cost of the usage at the models' prices (US dollars)",
                            ("gen_ai_request_model", "llmgw_tenant"), registry=self.registry)
        self.estimated = Counter("llmgw_usage_estimated", "Responses whose usage the gateway counted itself "
                                 "(the pod reported none)", ("gen_ai_request_model",), registry=self.registry)
        self.rejections = Counter("llmgw_rejections", "Requests the gateway answered itself, by status and code",
                                  ("http_response_status_code", "error_code"), registry=self.registry)
        self.store_outages = Counter("llmgw_quota_store_outages", "Times the shared quota store (Redis) "
                                     "became unreachable", registry=self.registry)
        self.local_admissions = Counter("llmgw_quota_local_admissions", "Admissions decided by this node's "
                                        "store while Redis was unreachable", registry=self.registry)
        self.lost_settlements = Counter("llmgw_quota_lost_settlements", "Settlements that could not reach "
                                        "Redis (their leases expire by TTL)", registry=self.registry)
        self.store_degraded = Gauge("llmgw_quota_store_degraded", "1 while quotas are enforced locally "
                                    "(Redis unreachable)", registry=self.registry, multiprocess_mode="max")
        self.ledger_buffered = Gauge("llmgw_ledger_buffered_records", "Usage records waiting for Redis",
                                     registry=self.registry, multiprocess_mode="livesum")
        self.unsettled = Counter("llmgw_requests_unsettled", "Forwarded requests whose access-log entry never "
                                 "reached this worker (settled elsewhere, or missed: leases expire by TTL)",
                                 registry=self.registry)
        self.ledger_dropped = Counter("llmgw_ledger_dropped_records", "Usage records lost to a full buffer",
                                      registry=self.registry)
        self.ledger_unreplicated = Counter("llmgw_ledger_unreplicated_appends", "Usage record appends that fewer "
                                           "than ledger.replicas replicas acknowledged within ledger.wait_ms (kept "
                                           "buffered and sent again)", registry=self.registry)
        self.routing = Counter("llmgw_routing_decisions", "Requests forwarded, by pool and what chose it (rule; "
                               "intent for semantic routing, 'default' when none matched)",
                               ("llmgw_pool", "llmgw_rule", "llmgw_intent"), registry=self.registry)
        self.intents = Counter("llmgw_intent_classifications", "Semantic routing outcomes: matched, default (no "
                               "intent sure enough), busy or failed (the embedder; the default route taken)",
                               ("outcome",), registry=self.registry)
        self.embed_seconds = Counter("llmgw_intent_embedding_seconds", "Time the embedding thread spent",
                                     registry=self.registry)
        self.keys_version = Gauge(
            "llmgw_api_keys_version", "Version of the key table in Redis (llmgw keys) that this worker answers "
            "from: -1 before its first load and after keys.max_stale_s without Redis, 0 with no Redis; the node "
            "shows its worker most behind", registry=self.registry, multiprocess_mode="livemin")
        self.pods_known = Gauge("llmgw_picker_pods_known", "Pods whose scraped state is fresh (the rest count "
                                "as unknown to the picker)", registry=self.registry, multiprocess_mode="max")
        self.cache = Counter("llmgw_cache_lookups", "Response cache lookups: hit, hot (of the hits, those the "
                             "hot-key allow-list answered without a round trip), miss (the store had no fresh "
                             "entry), filtered (the Bloom filter knew the key does not exist: no round trip), "
                             "error (the store failed: a miss), warmed (a hot key fetched once for the requests "
                             "waiting on it), shadow (a paraphrase a shadow-mode semantic cache would have "
                             "served)", ("outcome",), registry=self.registry)
        self.cache_stored = Counter("llmgw_cache_stored", "Answers stored in the response cache",
                                    registry=self.registry)
        self._cache_seen: dict[str, int] = {}
        self._breakers_seen: set[tuple[str, str]] = set()  # (scope, name) set once: declare() leaves them be
        self.breaker_state = Gauge("llmgw_circuit_breaker_state", "Circuit breakers as this worker sees them: 0 "
                                   "closed, 1 half-open, 2 open", ("scope", "name"), registry=self.registry,
                                   multiprocess_mode="max")
        self.fallbacks = Counter("llmgw_fallbacks", "Requests served by a fallback model because the pool of the "
                                 "model asked for had its breaker open", ("from_model", "to_model"),
                                 registry=self.registry)
        # The per-tenant heat map (tenant by latency bucket, coloured by error rate) and its
        # drill-down to pods. Cardinality: tenants x 2 outcomes x 15 buckets, and tenants x pods x 2.
        self.tenant_duration = Histogram(
            "llmgw_tenant_request_duration_seconds", "Every request of a tenant, the ones the gateway refused "
            "included, by outcome: ok, or error (a 4xx or 5xx answer)", ("llmgw_tenant", "outcome"),
            buckets=DURATION_BUCKETS, registry=self.registry)
        self.pod_requests = Counter(
            "llmgw_pod_requests", "Forwarded requests by tenant and pod (the one picked, or the one Envoy's "
            "retry reached): ok, or error (a 5xx, or no answer)",
            ("llmgw_tenant", "llmgw_pool", "llmgw_pod", "outcome"), registry=self.registry)
        # Pool load from the pods' own metrics (no GenAI convention exists for these): every
        # worker of a node reads the same snapshot, so the node's value is the most recent one set.
        pool = ("llmgw_pool",)
        self.pool_queue_depth = Gauge(
            "llmgw_pool_queue_depth", "Requests waiting on the pool's pods (vllm:num_requests_waiting, or its "
            "engine's own name) summed over the pods with fresh scraped state (NaN while none is known)", pool,
            registry=self.registry, multiprocess_mode="mostrecent")
        self.pool_running = Gauge(
            "llmgw_pool_requests_running", "Requests running on the pool's pods (vllm:num_requests_running, or "
            "its engine's own name) summed over the pods with fresh scraped state (NaN while none is known)", pool,
            registry=self.registry, multiprocess_mode="mostrecent")
        self.pool_kv_usage = Gauge(
            "llmgw_pool_kv_cache_usage_ratio", "Mean KV-cache usage (0..1) of the pool's pods with fresh scraped "
            "state that report it (vllm:kv_cache_usage_perc, or its engine's own; NaN while none is known)", pool,
            registry=self.registry, multiprocess_mode="mostrecent")
        self.pool_pods_known = Gauge(
            "llmgw_pool_pods_known", "Pods of the pool with fresh scraped state (the others are left out of "
            "the pool's load)", pool, registry=self.registry, multiprocess_mode="mostrecent")
        self.pool_pods_healthy = Gauge(
            "llmgw_pool_pods_healthy", "Pods of the pool that answered their last health probe (the others get "
            "no traffic)", pool, registry=self.registry, multiprocess_mode="mostrecent")
        self._pools_seen: set[str] = set()
        self._probed_pools: set[str] = set()
        self._seen = (0, 0, 0)  # the store's outages, local admissions and lost settlements, as last synced
        self._dropped = 0
        self._unreplicated = 0
        self._outcomes: dict[str, int] = {}
        self._embed_seconds = 0.0

    def declare(self, config: GatewayConfig) -> None:
        """Export the series that only an event would create, at zero (closed, for the breakers),
        so that dashboards and alerts read 0, not nothing, on a fresh gateway: the cache's
        outcomes, each pool's and pod's breaker, each fallback pair, each model's estimated usage,
        each tenant's heat-map row and its drill-down to each pod.
        Called at start and after each reload (series of what a reload dropped stay as they were)."""
        for outcome in CACHE_OUTCOMES:
            self.cache.labels(outcome)
        for name, pool in config.pools.items():
            for scope, key in (("pool", name), *(("pod", endpoint) for endpoint in pool.endpoints)):
                if (scope, key) not in self._breakers_seen:
                    self._breakers_seen.add((scope, key))
                    self.breaker_state.labels(scope, key).set(STATE_VALUES["closed"])
        for tenant in config.tenants_by_name:
            for outcome in ("ok", "error"):
                self.tenant_duration.labels(tenant, outcome)
                for name, pool in config.pools.items():
                    for endpoint in pool.endpoints:
                        self.pod_requests.labels(tenant, name, endpoint, outcome)
        for model in config.models:
            self.estimated.labels(model.name)
            for spare in model.fallback:
                self.fallbacks.labels(model.name, spare)

    def record(self, record: RequestRecord) -> None:
        """One finished request: served (duration, TTFT, tokens, cost) or answered by the gateway."""
        d = record.decision
        if d.tenant:
            self.tenant_duration.labels(d.tenant, "error" if record.status >= 400 else "ok").observe(
                record.duration_ms / 1000)
        if record.kind == REJECTED:
            self.rejections.labels(str(record.status), record.error or "").inc()
            return
        # The pod: the one extproc picked, or the one Envoy's retry reached (a batched request's
        # upstream is the coordinator, which sends it to the pod picked).
        pod = record.upstream if record.attempts > 1 else d.endpoint or record.upstream
        if record.kind != CACHED and pod and d.tenant:
            failed = record.status >= 500 or record.status == 0
            self.pod_requests.labels(d.tenant, d.pool, pod, "error" if failed else "ok").inc()
        if record.kind != CACHED:  # a hit was never forwarded
            self.routing.labels(d.pool, d.rule, d.intent).inc()
        if d.fallback_from:
            self.fallbacks.labels(d.fallback_from, d.served_model).inc()
        labels = (record.operation, d.served_model or "unknown", d.tenant)
        self.duration.labels(*labels, str(record.status)).observe(record.duration_ms / 1000)
        if record.ttft_ms is not None and d.stream:
            self.time_to_first_token.labels(*labels).observe(record.ttft_ms / 1000)
        usage = record.usage
        if usage is not None:
            self.token_usage.labels(*labels, "input").observe(usage.input_tokens)
            self.token_usage.labels(*labels, "output").observe(usage.output_tokens)
            if record.cost_usd:
                self.cost.labels(labels[1], labels[2]).inc(record.cost_usd)
            if record.usage_estimated:
                self.estimated.labels(labels[1]).inc()

    def pools(self, loads: Mapping[str, PoolLoad]) -> None:
        """Each pool's load (``extproc.routing.podstate.pool_loads``); a pool no longer among them
        (dropped by a config reload) reads as unknown from then on."""
        unknown = PoolLoad(0, 0, math.nan, math.nan, math.nan)
        for name in self._pools_seen - loads.keys():
            self._set_pool(name, unknown)
        for name, load in loads.items():
            self._set_pool(name, load)
        self._pools_seen = set(loads)

    def pods_healthy(self, pools: Mapping[str, int]) -> None:
        """Each pool's pods that answered the last round of health probes (``probe_forever``); a
        pool dropped by a reload reads as unknown (NaN) from then on."""
        for name in self._probed_pools - pools.keys():
            self.pool_pods_healthy.labels(name).set(math.nan)
        for name, healthy in pools.items():
            self.pool_pods_healthy.labels(name).set(healthy)
        self._probed_pools = set(pools)

    def _set_pool(self, name: str, load: PoolLoad) -> None:
        self.pool_queue_depth.labels(name).set(load.waiting)
        self.pool_running.labels(name).set(load.running)
        self.pool_kv_usage.labels(name).set(load.kv_usage_mean)
        self.pool_pods_known.labels(name).set(load.pods_known)

    def pool_feed(self, pools: Callable[[], Mapping[str, Iterable[str]]]
                  ) -> Callable[[Mapping[str, PodState]], None]:
        """The ``PodStates(on_update=...)`` hook that sets the pool gauges each time pod state lands;
        ``pools()`` gives each pool's endpoints (read at each update: a config reload is followed)."""
        def update(states: Mapping[str, PodState]) -> None:
            self.pools(pool_loads(states, pools()))
        return update

    def breaker(self, scope: str, name: str, state: str) -> None:
        """A circuit breaker changed state."""
        self._breakers_seen.add((scope, name))
        self.breaker_state.labels(scope, name).set(STATE_VALUES[state])

    def sync(self, stats: StoreStats | None, ledger: LedgerStats | None,
             classifier: ClassifierCounts | None = None, pods_known: int | None = None,
             cache: CacheCounts | None = None) -> None:
        """Copy the quota store's, the ledger's, semantic routing's and the response cache's own
        counters, and how many pods the picker knows (called once a second)."""
        if cache is not None:
            for outcome, count in (("hit", cache.hits), ("hot", cache.hot), ("miss", cache.misses),
                                   ("filtered", cache.filtered), ("error", cache.errors), ("warmed", cache.warmed),
                                   ("stored", cache.stored), ("shadow", cache.shadow)):
                metric = self.cache_stored if outcome == "stored" else self.cache.labels(outcome)
                metric.inc(count - self._cache_seen.get(outcome, 0))
                self._cache_seen[outcome] = count
        if classifier is not None:
            for outcome, count in classifier.outcomes.items():
                self.intents.labels(outcome).inc(count - self._outcomes.get(outcome, 0))
                self._outcomes[outcome] = count
            self.embed_seconds.inc(classifier.embed_seconds - self._embed_seconds)
            self._embed_seconds = classifier.embed_seconds
        if pods_known is not None:
            self.pods_known.set(pods_known)
        if stats is not None:
            outages, local, lost = self._seen
            self.store_outages.inc(stats.outages - outages)
            self.local_admissions.inc(stats.local_admissions - local)
            self.lost_settlements.inc(stats.lost_settlements - lost)
            self.store_degraded.set(1 if stats.in_outage else 0)
            self._seen = (stats.outages, stats.local_admissions, stats.lost_settlements)
        if ledger is not None:
            self.ledger_buffered.set(ledger.buffered)
            self.ledger_dropped.inc(ledger.dropped - self._dropped)
            self.ledger_unreplicated.inc(ledger.unreplicated - self._unreplicated)
            self._dropped, self._unreplicated = ledger.dropped, ledger.unreplicated


def prepare_multiprocess_dir(path: Path) -> Path:
    """An empty directory for the workers' metric files (stale files of a past run would add up)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def serve_metrics(port: int, host: str = "127.0.0.1", *, registry: CollectorRegistry | None = None,
                  multiproc_dir: Path | None = None) -> MetricsServer:
    """Serve ``/metrics`` from a background thread: ``registry``, or the sum of the workers' files
    in ``multiproc_dir`` (``port`` 0 picks a free one)."""
    if registry is None:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(multiproc_dir or os.environ[MULTIPROC_ENV]))
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)


class MetricsServer:
    """A running ``/metrics`` endpoint."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread
        self.port = int(server.server_port)

    def stop(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
