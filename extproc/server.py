"""The ext_proc gRPC server (grpc.aio): a tiny stream loop around the pure core.

    recv -> check the phase table -> gateway decides -> wire -> send

Both Envoy filters talk to this one service. A stream whose messages carry ``observability_mode``
comes from the observer filter: Envoy does not wait for answers there, and none is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any
from pathlib import Path

import grpc
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.api import ApiError
from extproc.config import LEDGER_PATH_ENV, QUOTA_PATH_ENV, ConfigError, GatewayConfig, load_config
from extproc.decisions import PASS_THROUGH, Admit, Analyze, Decision, Reply
from extproc.gateway import Gateway, RequestState
from extproc.keys import RedisKeyTable
from extproc.ledger import FileLedger, LedgerSink, RedisLedger, rejection_record, usage_record
from extproc.observer import ResponseObservation, Usage
from extproc.offload import BodyAnalyzer
from extproc.phases import Phase, ProtocolError, Stage, advance, check
from extproc.quota import FallbackStore, MemoryStore, OnStoreError, QuotaStore, StoreUnavailable
from extproc.quota.redis_store import RedisStore
from extproc.routing.picker import LeastInFlight
from extproc.routing.probe import probe_forever
from extproc.telemetry.metrics import MULTIPROC_ENV, GatewayMetrics, serve_metrics
from extproc.wire import headers_to_dict, to_response

log = logging.getLogger("llmgw.extproc")
ENVOY_BUFFER_LIMIT = 32 * 1024 * 1024
RELOAD_INTERVAL_S = 2.0
ATTEMPT_COUNT_HEADER = "x-envoy-attempt-count"
SETTLE_GRACE_S = 0.5  # how long a finished stream waits for the observer's usage before settling
HOUSEKEEPING_S = 0.1
access_log = logging.getLogger("llmgw.access")

_INTERNAL_ERROR = ApiError(500, "The gateway failed to process the request; it was not forwarded.",
                           type="server_error", code="internal_error")


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """The servicer: one ``Process`` stream per HTTP request and filter."""

    def __init__(self, gateway: Gateway, store: QuotaStore | None = None, ledger: LedgerSink | None = None,
                 metrics: GatewayMetrics | None = None, analyzer: BodyAnalyzer | None = None) -> None:
        self.gateway = gateway
        self.store = store or MemoryStore()
        self.ledger = ledger
        self.metrics = metrics
        self.analyzer = analyzer or BodyAnalyzer()
        self._tasks: set[asyncio.Task[None]] = set()
        # Admitted requests whose lease is not settled yet, by span id, and (for those whose stream
        # has ended) when to settle them without usage. One housekeeping loop serves them all:
        # no task per request.
        self._leased: dict[str, RequestState] = {}
        self._settle_due: dict[str, float] = {}
        self._housekeeper: asyncio.Task[None] | None = None

    async def Process(  # noqa: N802 (the gRPC method name)
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        """Answer each message of a main-filter stream; only watch an observer stream."""
        state: RequestState | None = None
        observation: ResponseObservation | None = None
        stage = Stage.START
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind is None:
                    raise ProtocolError("a ProcessingRequest without a request message")
                phase = Phase(kind)
                if message.observability_mode:
                    if observation is None:
                        observation = ResponseObservation()
                    self._observe(observation, phase, message)
                    if observation.complete:
                        self._finished(observation)  # now, not at Envoy's deferred stream close
                        observation = None
                    continue
                if state is None:
                    state = self.gateway.new_request()
                check(stage, phase)
                decision, end_of_stream = await self._decide(state, phase, message)
                stage = advance(stage, phase, answered=isinstance(decision, Reply), end_of_stream=end_of_stream)
                if isinstance(decision, Reply) and state.rejected is not None:
                    self._rejected(state, state.rejected)
                yield to_response(phase, decision)
        except ProtocolError as error:
            log.error("ext_proc protocol error: %s (request_id=%s)", error, state.request_id if state else "-")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        finally:
            if state is not None:
                self.gateway.finish(state)
                if state.lease is not None and not state.settled and state.trace is not None:
                    # Give the observer a moment to settle with the real usage; else the reservation.
                    self._settle_due[state.trace.span_id] = time.monotonic() + SETTLE_GRACE_S
            if observation is not None:
                self._finished(observation)  # the stream ended first: the client went away

    def _rejected(self, state: RequestState, error: ApiError) -> None:
        """Count a refusal; a known tenant's goes to the ledger too, as a rejection."""
        if self.metrics is not None:
            self.metrics.record_rejection(error.status, error.code)
        if self.ledger is not None and state.tenant is not None:
            facts = state.facts
            model = state.model.name if state.model is not None else (facts.model if facts is not None else "")
            self._spawn(self.ledger.append(rejection_record(
                state.request_id, state.tenant.name, model, error.status, error.code,
                facts.stream if facts is not None else False, state.trace.span_id if state.trace else "")))

    def _passive_health(self, endpoint: str, attempts: str | None) -> None:
        """Envoy needed a second attempt (virtual host include_attempt_count_in_response): the pod
        extproc picked failed this request, so it gets no traffic for a backoff."""
        health = self.gateway.health
        if attempts is None or attempts == "1":
            health.attempt_succeeded(endpoint)
        else:
            backoff = health.attempt_failed(endpoint)
            log.warning("pod %s failed an attempt (retried elsewhere): no traffic for %.0f s", endpoint, backoff)

    async def _decide(self, state: RequestState, phase: Phase, message: pb.ProcessingRequest
                      ) -> tuple[Decision, bool]:
        """The gateway's answer to one message, after the body analysis and the quota round trip it
        may ask for. A bug fails this request closed with a 500 (never the server), and gives back
        whatever admission took."""
        try:
            decision, end_of_stream = self._phase(state, phase, message)
            if isinstance(decision, Analyze):
                decision = self.gateway.body_analyzed(state, await self.analyzer.analyze(decision))
            if isinstance(decision, Admit):
                decision = await self._admit(state, decision)
            return decision, end_of_stream
        except Exception:  # noqa: BLE001 (logged with its traceback; the request fails closed)
            log.exception("failed to process %s (request_id=%s)", phase.value, state.request_id)
            lease = self.gateway.settle(state)
            if lease is not None:
                self._spawn(self.store.release(lease))
            state.rejected = _INTERNAL_ERROR
            return Reply.error(_INTERNAL_ERROR, state.identity_headers()), True

    async def _admit(self, state: RequestState, ask: Admit) -> Decision:
        """One quota-store round trip; the gateway turns the verdict into the answer."""
        try:
            verdict = await self.store.admit(ask.admission, ask.quota)
        except StoreUnavailable:
            return self.gateway.store_unavailable(state)
        decision = self.gateway.admitted(state, verdict)
        if state.lease is not None and state.trace is not None:
            self._leased[state.trace.span_id] = state
            if self._housekeeper is None or self._housekeeper.done():
                self._housekeeper = asyncio.get_running_loop().create_task(self._housekeeping())
        return decision

    async def _housekeeping(self) -> None:
        """While leases are held: settle ended requests whose grace ran out (no usage came: the
        client went away, or the pod sent none), and renew leases older than a third of their TTL
        so a long generation's slot expires only if this process dies."""
        while self._leased:
            await asyncio.sleep(HOUSEKEEPING_S)
            now = time.monotonic()
            for span_id, due in list(self._settle_due.items()):
                if due <= now:
                    del self._settle_due[span_id]
                    state = self._leased.get(span_id)
                    lease = self.gateway.settle(state) if state is not None else None
                    if lease is not None:
                        self._spawn(self.store.release(lease))
            for span_id, state in list(self._leased.items()):
                if state.settled or state.lease is None:
                    del self._leased[span_id]
                    self._settle_due.pop(span_id, None)
                elif now - state.lease_renewed > self.gateway.config.quota.lease_ttl_s / 3:
                    state.lease_renewed = now
                    self._spawn(self._renew(state))

    async def _renew(self, state: RequestState) -> None:
        assert state.lease is not None
        try:
            renewed = await self.store.renew(state.lease)
        except StoreUnavailable:
            return  # the lease may lapse while the store is away; settling is still attempted
        if renewed is None:
            log.warning("lease of request %s expired before renewal", state.request_id)
        elif not state.settled:
            state.lease = renewed

    def _finished(self, observation: ResponseObservation) -> None:
        """The response ended (or the client left): settle the lease with the usage, write one
        access-log line and, for a request that reached a pod, one ledger record."""
        state = self.gateway.active(observation.span_id) if observation.span_id else None
        usage, estimated = self.gateway.usage_of(state, observation) if state else (observation.usage(), False)
        if state is not None:
            lease = self.gateway.settle(state, usage)
            if lease is not None:
                self._spawn(self.store.release(lease, *self.gateway.charge_of(state, usage)))
        _log_access(observation, usage, estimated)
        if self.metrics is not None:
            self.metrics.record_response(observation, usage, estimated)
        if self.ledger is not None and observation.prices is not None:
            record = usage_record(observation, observation.tenant, observation.prices, usage, estimated)
            self._spawn(self.ledger.append(record))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)  # keep a reference until done (asyncio holds tasks weakly)
        task.add_done_callback(self._tasks.discard)

    def _observe(self, observation: ResponseObservation, phase: Phase, message: pb.ProcessingRequest) -> None:
        if phase is Phase.RESPONSE_HEADERS:
            headers = message.response_headers
            response_headers = headers_to_dict(headers.headers)
            observation.on_response_headers(response_headers, headers.end_of_stream)
            state = self.gateway.active(observation.span_id)
            # Only a request that was forwarded has a response to account for; the gateway's own
            # replies were counted (and ledgered as rejections) when it made them.
            if state is not None and state.endpoint is not None:
                self._passive_health(state.endpoint, response_headers.get(ATTEMPT_COUNT_HEADER))
                model = state.model
                observation.attach(state.started, state.path, model.name if model else "",
                                   model.pool.name if model else "", state.endpoint or "",
                                   state.tenant.name if state.tenant else "", model.prices if model else None)
        elif phase is Phase.RESPONSE_BODY:
            observation.on_response_body(message.response_body.body, message.response_body.end_of_stream)

    def _phase(self, state: RequestState, phase: Phase, message: pb.ProcessingRequest
               ) -> tuple[Decision | Admit | Analyze, bool]:
        if phase is Phase.REQUEST_HEADERS:
            headers = message.request_headers
            eos = headers.end_of_stream
            return self.gateway.request_headers(state, headers_to_dict(headers.headers), eos), eos
        if phase is Phase.REQUEST_BODY:
            body = message.request_body
            return self.gateway.request_body(state, body.body), body.end_of_stream
        if phase is Phase.REQUEST_TRAILERS:
            return self.gateway.request_trailers(state), True
        return PASS_THROUGH, True  # response phases, if an operator turns them on


def _log_access(observation: ResponseObservation, usage: Usage | None, estimated: bool) -> None:
    if access_log.isEnabledFor(logging.INFO):
        access_log.info("%s", orjson.dumps(observation.record(usage, estimated)).decode())


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


def build_ledger(config: GatewayConfig) -> LedgerSink | None:
    """The Redis Stream ledger with ``redis_url``, else the node's JSON-lines file, else none (said loudly)."""
    if config.redis_url is not None:
        return RedisLedger.from_url(config.redis_url)
    path = os.environ.get(LEDGER_PATH_ENV)
    if path is None:
        log.warning("no redis_url nor %s: the usage ledger is off", LEDGER_PATH_ENV)
        return None
    return FileLedger(path)


def build_server(config: GatewayConfig, gateway: Gateway | None = None, store: QuotaStore | None = None,
                 ledger: LedgerSink | None = None, metrics: GatewayMetrics | None = None,
                 analyzer: BodyAnalyzer | None = None) -> grpc.aio.Server:
    """A grpc.aio server carrying the servicer; messages as large as Envoy may buffer."""
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
    servicer = ExternalProcessor(gateway or Gateway(config, LeastInFlight()), store or build_store(config), ledger,
                                 metrics, analyzer)
    pb_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    return server


async def watch_config(path: Path, gateway: Gateway, interval: float = RELOAD_INTERVAL_S) -> None:
    """Reload the config when its file changes (a revoked key stops working within ``interval``).

    A file that no longer validates is refused with an error and the running snapshot is kept.
    """
    seen = path.stat().st_mtime_ns
    while True:
        await asyncio.sleep(interval)
        try:
            mtime = path.stat().st_mtime_ns
            if mtime == seen:
                continue
            seen = mtime
            gateway.reload(load_config(path))
            log.info("config reloaded from %s", path)
        except (OSError, ConfigError) as error:
            log.error("config reload refused, keeping the running config: %s", error)


async def export_stats(metrics: GatewayMetrics, store: QuotaStore, ledger: LedgerSink | None) -> None:
    """Copy the quota store's and the ledger's counters into the metrics, once a second."""
    stats = store.stats if isinstance(store, FallbackStore) else None
    while True:
        metrics.sync(stats, ledger)
        await asyncio.sleep(1.0)


async def serve(config: GatewayConfig, host: str, port: int, ready: Callable[[int], None],
                config_path: Path | None = None, metrics_port: int | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain streams for up to 5 s; reload ``config_path`` on change.

    Metrics go to ``$PROMETHEUS_MULTIPROC_DIR`` (the launcher serves the node's sum), or are
    served here on ``metrics_port``.
    """
    gateway = Gateway(config, LeastInFlight())
    store, ledger, metrics = build_store(config), build_ledger(config), GatewayMetrics()
    if metrics_port is not None and not os.environ.get(MULTIPROC_ENV):
        serve_metrics(metrics_port, host, registry=metrics.registry)
    analyzer = BodyAnalyzer()
    server = build_server(config, gateway, store, ledger, metrics, analyzer)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    ready(bound)
    # The helper process for large bodies starts (~1 s of imports) while small ones are served.
    warming = asyncio.create_task(analyzer.start())
    prober = asyncio.create_task(probe_forever(lambda: gateway.config, gateway.health))
    watcher = asyncio.create_task(watch_config(config_path, gateway)) if config_path else None
    # Keys stored in Redis: each process polls the table's version (1 s) and swaps in a snapshot,
    # so lookups never wait on Redis and a revoked key stops working within about a second.
    key_table = RedisKeyTable.from_url(config.redis_url) if config.redis_url else None
    key_watcher = asyncio.create_task(key_table.watch(
        gateway.set_redis_keys, config.keys.poll_s, max_stale_s=config.keys.max_stale_s)) if key_table else None
    exporter = asyncio.create_task(export_stats(metrics, store, ledger))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for task in (watcher, key_watcher, exporter, prober, warming):
        if task is not None:
            task.cancel()
    await server.stop(grace=5)
    analyzer.close()
    if key_table is not None:
        await key_table.aclose()
    if ledger is not None:
        await ledger.close()  # flush what Redis can still take
    await store.close()


def configure_logging(level: str = "INFO") -> None:
    """One line per record on stderr; access records are JSON."""
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")


def main(argv: list[str] | None = None) -> None:
    """``python -m extproc.server``: one worker process (``llmgw serve`` starts several)."""
    parser = argparse.ArgumentParser(prog="python -m extproc.server", description=__doc__)
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
