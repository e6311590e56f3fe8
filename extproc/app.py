"""Wiring: one extproc worker process. Builds the stores, the ledger, metrics, tracing, the gateway
and both gRPC services (ext_proc and the access-log service, on one port), then runs the
background loops (config and key reloads, pod probes, stats) until SIGTERM.

    python -m extproc.app --config llmgw.yaml [--port 50051]   (``llmgw serve`` starts several)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from extproc.accesslog import AccessLogReceiver
from extproc.cache.filters import BloomFilter
from extproc.cache.semantic import SemanticIndexes, index_key
from extproc.cache.store import CACHE_PATH_ENV, HotKeys, RedisBackend, ResponseCache, SqliteBackend
from extproc.config import LEDGER_PATH_ENV, QUOTA_PATH_ENV, ConfigError, GatewayConfig, load_config
from extproc.gateway import Gateway
from extproc.keys import NO_VERSION, KeySnapshot, RedisKeyTable
from extproc.ledger import FileLedger, LedgerSink, RedisLedger
from extproc.memory import HeapTrim
from extproc.offload import BodyAnalyzer
from extproc.quota import FallbackStore, MemoryStore, OnStoreError, QuotaStore
from extproc.quota.redis_store import RedisStore
from extproc.routing.classifier import IntentClassifier
from extproc.routing.engines import scrape_targets
from extproc.routing.picker import Picker
from extproc.routing.podstate import PodStates, default_state_path, gather_forever
from extproc.routing.probe import probe_forever
from extproc.server import ExternalProcessor
from extproc.sinks import Settlement
from extproc.telemetry.metrics import MULTIPROC_ENV, GatewayMetrics, serve_metrics

if TYPE_CHECKING:
    from extproc.telemetry.tracing import RequestTracer, Sampler

log = logging.getLogger("llmgw.extproc")
ENVOY_BUFFER_LIMIT = 32 * 1024 * 1024
RELOAD_INTERVAL_S = 2.0
HOUSEKEEPING_S = 5.0
FIRST_KEYS_TIMEOUT_S = 10.0  # a starting worker waits this long for Redis's key table, then serves without it


def build_store(config: GatewayConfig) -> QuotaStore:
    """Redis (with the node's SQLite store behind it when Redis is away), or the SQLite store alone.

    The SQLite file (``quota.local_path``, else ``$LLMGW_QUOTA_PATH``) is shared by the node's
    worker processes, so limits hold across them without Redis; with neither, each process counts
    alone (one worker then, or limits multiply).
    """
    quota = config.quota
    path = quota.local_path or os.environ.get(QUOTA_PATH_ENV)
    if path is None and (config.server.workers or os.cpu_count() or 1) > 1 and config.auth_required:
        log.warning("no quota.local_path nor %s: each extproc process enforces limits alone", QUOTA_PATH_ENV)
    local = MemoryStore(path, lease_ttl_s=quota.lease_ttl_s)
    if config.redis_url is None:
        return local
    primary = RedisStore.from_url(config.redis_url, lease_ttl_s=quota.lease_ttl_s)
    return FallbackStore(primary, local, OnStoreError(quota.on_store_error), replicas=quota.replicas)


def build_cache(config: GatewayConfig) -> ResponseCache | None:
    """The response cache when some model or rule caches answers: in Redis with ``redis_url``,
    else in the node's SQLite file (``response_cache.local_path``, else ``$LLMGW_CACHE_PATH``)."""
    if not config.caches:
        return None
    spec = config.response_cache
    bloom = BloomFilter(spec.bloom_bits, spec.bloom_hashes)
    hot = HotKeys(spec.hot_keys, spec.hot_min_hits)
    if config.redis_url is not None:
        return ResponseCache(RedisBackend(config.redis_url), bloom, guard=spec.guard, hot=hot)
    path = spec.local_path or os.environ.get(CACHE_PATH_ENV)
    if path is None:
        log.warning("no response_cache.local_path nor %s: each extproc process caches alone", CACHE_PATH_ENV)
    return ResponseCache(SqliteBackend(path), bloom, guard=spec.guard, hot=hot)


def build_ledger(config: GatewayConfig) -> LedgerSink | None:
    """The Redis Stream ledger with ``redis_url``, else the node's JSON-lines file, else none (said loudly)."""
    if config.redis_url is not None:
        return RedisLedger.from_url(config.redis_url, replicas=config.ledger.replicas, wait_ms=config.ledger.wait_ms)
    path = os.environ.get(LEDGER_PATH_ENV)
    if path is None:
        log.warning("no redis_url nor %s: the usage ledger is off", LEDGER_PATH_ENV)
        return None
    return FileLedger(path)


def build_tracing(config: GatewayConfig) -> tuple[RequestTracer | None, Sampler | None]:
    """The span exporter and the sampler extproc decides with (None, None when tracing is off)."""
    if not config.tracing.enabled:
        return None, None
    from extproc.telemetry.tracing import RequestTracer, Sampler  # the SDK is imported only when used

    return RequestTracer.from_config(config.tracing), Sampler.from_config(config.tracing)


async def build_server(config: GatewayConfig, gateway: Gateway, store: QuotaStore, settlement: Settlement,
                 analyzer: BodyAnalyzer | None = None, classifier: IntentClassifier | None = None,
                 cache: ResponseCache | None = None
                 ) -> tuple[grpc.aio.Server, ExternalProcessor, health_aio.HealthServicer]:
    """A grpc.aio server carrying both services, the gRPC health service (every service SERVING
    until shutdown begins) and reflection; messages as large as Envoy may buffer."""
    # At least what Envoy may buffer (per_connection_buffer_limit_bytes in envoy.yaml), so that an
    # oversize chunked body reaches the gateway and gets an OpenAI-style 413, not a gRPC error.
    limit = max(config.max_body_bytes, ENVOY_BUFFER_LIMIT) + (1 << 20)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 1),  # one process per core shares the port
            ("grpc.max_concurrent_streams", 10000),
        ]
    )
    processor = ExternalProcessor(gateway, store, settlement, analyzer, classifier, cache)
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogReceiver(settlement), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    services = (pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name,
                als_pb2.DESCRIPTOR.services_by_name["AccessLogService"].full_name)
    for name in ("", *services):  # "": the server as a whole (Kubernetes' grpc probe asks for it)
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                         reflection.SERVICE_NAME), server)
    return server, processor, health


async def prepare_semantic_cache(indexes: SemanticIndexes, config: GatewayConfig) -> None:
    """Build the semantic cache's indexes (load their embedders) before serving: a request never
    waits for an embedder to load. One that fails is logged; its caches match exact keys only."""
    caches = [*(model.cache for model in config.models), *config.route_caches.values()]
    specs = {index_key(s): s for c in caches if c is not None and (s := c.semantic)}
    for spec in specs.values():
        try:
            await indexes.index(spec)
        except Exception as error:  # noqa: BLE001 (logged; exact lookups still work)
            log.error("semantic cache unavailable (%s embedder): %s", spec.embedder, error)


async def configure_intents(classifier: IntentClassifier, config: GatewayConfig) -> None:
    """Build semantic routing's index for ``config``; on failure (the embedder cannot load) log it
    and keep the previous one: requests for intents then take the default route."""
    try:
        await classifier.configure(config.intents)
    except Exception as error:  # noqa: BLE001 (an embedder's load error: logged, traffic goes on)
        log.error("semantic routing unavailable, requests take the default route: %s", error)


async def watch_config(path: Path, gateway: Gateway, interval: float = RELOAD_INTERVAL_S,
                       classifier: IntentClassifier | None = None, wake: asyncio.Event | None = None,
                       metrics: GatewayMetrics | None = None) -> None:
    """Reload the config when its file changes (a revoked key stops working within ``interval``),
    and at once whenever ``wake`` is set (SIGHUP), changed or not. A reload swaps one immutable
    snapshot for another between two requests: none is dropped or sees half of each.

    A file that no longer validates is refused with an error and the running snapshot is kept.
    """
    seen = path.stat().st_mtime_ns  # noqa: ASYNC240 (a stat of a local file, once a second)
    wake = wake or asyncio.Event()
    while True:
        try:
            await asyncio.wait_for(wake.wait(), interval)
        except TimeoutError:
            pass
        forced = wake.is_set()
        wake.clear()
        try:
            mtime = path.stat().st_mtime_ns  # noqa: ASYNC240
            if mtime == seen and not forced:
                continue
            seen = mtime
            gateway.reload(load_config(path))
            if metrics is not None:
                metrics.declare(gateway.config)
            log.info("config reloaded from %s", path)
            if classifier is not None:
                await configure_intents(classifier, gateway.config)
        except (OSError, ConfigError) as error:
            log.error("config reload refused, keeping the running config: %s", error)


async def housekeeping(gateway: Gateway, settlement: Settlement, metrics: GatewayMetrics, store: QuotaStore,
                       ledger: LedgerSink | None, classifier: IntentClassifier | None = None,
                       states: PodStates | None = None, cache: ResponseCache | None = None) -> None:
    """Once a second: copy the quota store's and the ledger's counters into the metrics, and give
    the large bodies' freed memory back to the system; every few seconds, report the requests
    decided here whose access-log entries never came."""
    stats = store.stats if isinstance(store, FallbackStore) else None
    trim = HeapTrim()
    last_sweep = time.monotonic()
    while True:
        buffering = ledger if isinstance(ledger, RedisLedger) else None
        metrics.sync(stats, buffering, classifier.stats if classifier is not None else None,
                     len(states.snapshot()) if states is not None else None,
                     cache.counters if cache is not None else None)
        trim()
        if time.monotonic() - last_sweep >= HOUSEKEEPING_S:
            settlement.unsettled(gateway.feedback.forget_stale())
            last_sweep = time.monotonic()
        await asyncio.sleep(1.0)


async def gather_pod_states(gateway: Gateway, states: PodStates) -> None:
    """The pods' vLLM metrics, scraped by one worker of the node and read by all (the picker's
    queue, KV-cache and LoRA scorers, and QoS shedding)."""
    scrape = gateway.config.endpoint_picker.scrape
    path = Path(scrape.path) if scrape.path else default_state_path(scrape_targets(gateway.config))
    await gather_forever(lambda: scrape_targets(gateway.config), path, scrape.interval_s, states, scrape.timeout_s)


async def serve(config: GatewayConfig, host: str, port: int, ready: Callable[[int], None],
                config_path: Path | None = None, metrics_port: int | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain streams for up to 5 s; reload ``config_path`` on change.

    Metrics go to ``$PROMETHEUS_MULTIPROC_DIR`` (the launcher serves the node's sum), or are
    served here on ``metrics_port``.
    """
    tracer, sampler = build_tracing(config)
    scrape = config.endpoint_picker.scrape
    metrics = GatewayMetrics()
    # The pool gauges (queue depth, running, KV-cache use: what autoscalers read) follow each scrape;
    # the gateway is read only then, once it exists.
    states = PodStates(stale_after_s=scrape.interval_s * scrape.stale_after_intervals, on_update=metrics.pool_feed(
        lambda: {name: pool.endpoints for name, pool in gateway.config.pools.items()}))
    picker = Picker(states=states, prefix_capacity=config.endpoint_picker.prefix.index_blocks)
    gateway = Gateway(config, picker, sampler=sampler)
    metrics.declare(config)
    store, ledger = build_store(config), build_ledger(config)
    if metrics_port is not None and not os.environ.get(MULTIPROC_ENV):
        serve_metrics(metrics_port, host, registry=metrics.registry)
    cache = build_cache(config)
    settlement = Settlement(gateway.feedback, lambda: gateway.config, store, ledger, metrics, tracer, cache)
    analyzer, classifier = BodyAnalyzer(), IntentClassifier()
    await configure_intents(classifier, config)  # before serving: "auto" is routed from the first request
    server, processor, health = await build_server(config, gateway, store, settlement, analyzer, classifier, cache)
    await prepare_semantic_cache(processor.semantic, config)
    # Keys stored in Redis: each process polls the table's version (1 s) and swaps in a snapshot,
    # so lookups never wait on Redis and a revoked key stops working within about a second. The
    # first load comes before the port opens: a valid key is never refused by a worker just started.
    key_table = RedisKeyTable.from_url(config.redis_url) if config.redis_url else None

    def use_keys(snapshot: KeySnapshot) -> None:
        gateway.set_redis_keys(snapshot)
        metrics.keys_version.set(snapshot.version)

    first_keys = None
    if key_table is not None:
        metrics.keys_version.set(NO_VERSION)
        first_keys = await key_table.load_first(FIRST_KEYS_TIMEOUT_S)
        if first_keys is not None:
            use_keys(first_keys)
    bound = server.add_insecure_port(f"{host}:{port}")
    # What is loaded by now (config, tokenizers, schemas, metrics) lives as long as the process:
    # the cyclic collector need not walk it again at each full collection.
    gc.collect()
    gc.freeze()
    # Loading the models freed as much as it keeps (weights read, then folded and transposed into
    # new arrays): the heap holds that free space until trimmed. A worker with the semantic cache,
    # measured once ready: 453 MB resident without this trim, 370 MB with it.
    HeapTrim(slack_bytes=0)()
    await server.start()
    ready(bound)
    # The helper process for large bodies starts (~1 s of imports) while small ones are served.
    warming = asyncio.create_task(analyzer.start())
    prober = asyncio.create_task(probe_forever(lambda: gateway.config, gateway.router.health, metrics.pods_healthy))
    gatherer = asyncio.create_task(gather_pod_states(gateway, states)) if scrape.enabled else None
    reload_now = asyncio.Event()  # SIGHUP: reload the config file now
    watcher = asyncio.create_task(watch_config(config_path, gateway, classifier=classifier, wake=reload_now,
                                               metrics=metrics)
                                  ) if config_path else None
    key_watcher = asyncio.create_task(key_table.watch(
        use_keys, config.keys.poll_s, max_stale_s=config.keys.max_stale_s, current=first_keys)) if key_table else None
    keeper = asyncio.create_task(housekeeping(gateway, settlement, metrics, store, ledger, classifier,
                                              states if scrape.enabled else None, cache))
    follower = asyncio.create_task(cache.follow()) if cache is not None else None
    sharer = asyncio.create_task(processor.sharing.follow()) if processor.sharing is not None else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload_now.set)
    await stop.wait()
    # Graceful shutdown: health checks see NOT_SERVING first (Envoy and Kubernetes stop sending
    # new streams), then in-flight streams get ``grace_s`` to end, then what was taken is settled
    # and the ledger flushed.
    await health.enter_graceful_shutdown()
    for task in (watcher, key_watcher, keeper, prober, warming, gatherer, follower, sharer):
        if task is not None:
            task.cancel()
    await server.stop(grace=config.server.grace_s)  # Envoy's access-log streams end: their last entries settle
    await settlement.drain()
    analyzer.close()
    classifier.close()
    if tracer is not None:
        tracer.shutdown()
    if key_table is not None:
        await key_table.aclose()
    if ledger is not None:
        await ledger.close()  # flush what Redis can still take
    await store.close()
    if cache is not None:
        await cache.backend.close()


def configure_logging(level: str = "INFO") -> None:
    """One line per record on stderr; access records are JSON."""
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")


def main(argv: list[str] | None = None) -> None:
    """``python -m extproc.app``: one worker process (``llmgw serve`` starts several)."""
    parser = argparse.ArgumentParser(prog="python -m extproc.app", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--log-level", default=os.environ.get("LLMGW_LOG_LEVEL", "INFO"))
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus /metrics here (one worker; `llmgw serve` sums several)")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    config = load_config(args.config)
    host = args.host or config.server.host
    port = config.server.port if args.port is None else args.port

    def ready(bound: int) -> None:
        print(f"READY {host}:{bound}", flush=True)

    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config, host, port, ready, Path(args.config), args.metrics_port))
    else:
        uvloop.run(serve(config, host, port, ready, Path(args.config), args.metrics_port))


if __name__ == "__main__":
    main()
