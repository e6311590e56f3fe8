"""The batching coordinator: merges the requests extproc sends it into one call to a pod, and
streams each client its own answer.

Envoy routes a request here (``x-llmgw-route: batch``) when extproc decided it may be batched; the
headers carry the decision (the pod picked, then a fallback, in ``x-gateway-destination-endpoint``;
the pool's window in ``x-llmgw-batch``; the prompt's token count), trusted because Envoy is the one
way in. Requests wait in a queue per ``BatchKey`` (pod, model, sampling parameters); a batch leaves

- when the pod has room (work-conserving: no call of ours in flight to it, or its scraped queue is
  empty): waiting would only add latency;
- when its oldest request has waited its class's ``wait_ms``;
- when it holds ``size`` requests or ``tokens`` prompt tokens.

A merged call that fails before answering is retried once, each member alone, on the fallback
pod; a member the pod stopped mid-answer is resumed there from its prompt plus the text it already
got, so its client's stream simply continues. A client that goes away loses only its own answer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import numpy as np
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client import Counter as MetricCounter
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from extproc.accounting import Usage
from extproc.coordinator.grouping import choose
from extproc.coordinator.merge import (
    NO_TEMPLATES,
    PROTOCOL,
    Answer,
    BatchKey,
    Member,
    MergeError,
    NoTemplate,
    PromptRenderer,
    load,
    own_usage,
    parse_object,
    pod_body,
    protocol_key,
    shares,
)
from extproc.coordinator.window import FULL, ROOM, WINDOW, AdaptiveWindow
from extproc.protos.llmgw.v1 import batch_pb2, batch_pb2_grpc
from extproc.routing.embedders import HashingEmbedder
from extproc.routing.engines import EngineProfile
from extproc.telemetry.tracecontext import random_hex
from extproc.telemetry.tracing import BatchSpan, RequestTracer

log = logging.getLogger("llmgw.coordinator")
DESTINATION_HEADER = "x-gateway-destination-endpoint"
BATCH_HEADER = "x-llmgw-batch"
INPUT_TOKENS_HEADER = "x-llmgw-input-tokens"
DEFAULTS = {"wait_ms": 50.0, "size": 32.0, "tokens": 4096.0, "group": -1.0}  # group < 0: rank order only
QOS_HEADER = "x-llmgw-qos"
# How much later than its arrival a request of the class ranks: a batch-class request joins a batch
# ahead of one that arrived this much after it (aging: nothing starves), realtime ahead of all.
QOS_HANDICAP_S = {"batch": 1.0, "realtime": -1.0}
MAX_WINDOWS = 4096  # queues' adaptive windows remembered
POD_SILENCE_S = 120.0  # the longest a pod may stay silent before the call counts as failed
PROTOCOL_RECHECK_S = 30.0  # how often a pod is asked again whether it speaks the batch protocol
HELD_RECHECK_S = 1.0  # a batch held for a busy pod looks again at least this often
# A call whose first token came only after the calls ahead of it ended says the pod runs one call
# at a time only if it was kept waiting this long (a continuous engine at low load ends the call
# ahead before starting the next one's tokens: that is no evidence).
SERIAL_EVIDENCE_S = 0.05
ENDED_KEPT = 4096  # ended calls' times remembered


@dataclass(eq=False)
class Pending:
    """A client's request from its arrival to its answer's end."""

    key: BatchKey
    member: Member
    answer: Answer
    fallback: str | None
    wait_s: float
    size: int
    tokens: int
    qos: str = ""
    group: float | None = None  # the cosine that groups a request with the batch's oldest (None: off)
    vector: np.ndarray | None = None  # its prompt's embedding, once grouping needed it
    trace: tuple[str, str, bool] | None = None  # the member's gateway span (its traceparent): trace, span, sampled
    arrived: float = field(default_factory=time.monotonic)
    out: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)  # None: the end
    dispatched: asyncio.Event = field(default_factory=asyncio.Event)
    batch_id: str = ""
    batch_size: int = 0
    ended: bool = False  # its answer's end was handed to the client's handler
    status: int = 200  # of a plain answer: the pod's refusal, or 502 when the pod and the retry failed
    carried: int = 0  # content events it had before it was resumed: now part of the retry's prompt

    def end(self) -> None:
        """Nothing more comes for this client."""
        self.out.put_nowait(None)
        self.ended = True
    gone: bool = False  # the client went away


def _settings(header: str | None) -> dict[str, float]:
    settings = dict(DEFAULTS)
    for part in (header or "").split(";"):
        name, _, value = part.strip().partition("=")
        if name in settings:
            try:
                settings[name] = float(value)
            except ValueError:
                pass
    return settings


class CoordinatorMetrics:
    """The coordinator's Prometheus metrics (``GET /metrics``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.size = Histogram("llmgw_batch_size", "Requests merged into one call to a pod, by the pod's protocol "
                              "(http: vLLM's /v1/completions; llmgw.v1: the batch protocol)",
                              ("gen_ai_request_model", "protocol"), buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                              registry=self.registry)
        self.departures = MetricCounter("llmgw_batch_departures", "Batches sent, by why they left: full (size or "
                                        "tokens), window (the wait ended), room (the pod could start it at once)",
                                        ("reason",), registry=self.registry)
        self.window = Gauge("llmgw_batch_window_seconds", "The adapted wait of the last batch formed, per model",
                            ("gen_ai_request_model",), registry=self.registry)
        self.grouped = MetricCounter("llmgw_batch_grouped", "Requests sent with their batch's oldest ahead of "
                                     "older ones because they are close to it: the same prefix block, or "
                                     "semantically (embedding cosine)", ("affinity",), registry=self.registry)
        self.retries = MetricCounter("llmgw_batch_retries", "Members retried alone after their merged call failed "
                                     "or was cut: resumed (answered) or failed (error to the client)", ("outcome",),
                                     registry=self.registry)
        # At zero from the start: a dashboard reads 0, not nothing, before the first event.
        for reason in ("full", "window", "room"):
            self.departures.labels(reason)
        for outcome in ("resumed", "failed"):
            self.retries.labels(outcome)


class Coordinator:
    """The queues, the calls in flight per pod, and the HTTP session to the pods."""

    def __init__(self, states: object | None = None, tracer: RequestTracer | None = None,
                 templates: Mapping[str, PromptRenderer] = NO_TEMPLATES,
                 engines: Mapping[str, EngineProfile] | None = None) -> None:
        self.tracer = tracer  # None: tracing off
        self.engines = engines or {}  # each pod's engine profile (by endpoint): whether it interleaves calls
        self.serial_evidence_s = SERIAL_EVIDENCE_S
        self.templates = templates  # each model's own chat template (by name); the others ChatML
        self.queues: dict[BatchKey, list[Pending]] = {}
        self._wakeups: dict[BatchKey, asyncio.Event] = {}
        self._dispatchers: dict[BatchKey, asyncio.Task[None]] = {}
        self.windows: dict[BatchKey, AdaptiveWindow] = {}  # kept while the queue lives, and a while after
        self.in_flight: Counter[str] = Counter()
        # pod -> (its batch-protocol address, or None for vLLM's HTTP API; when it was asked)
        self._protocols: dict[str, tuple[str | None, float]] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._sent_at: dict[str, float] = {}  # wall-clock time of the last call to each pod
        self._open: dict[str, set[int]] = {}  # pod -> our calls to it in flight
        self._call_ids = itertools.count(1)
        # pod -> EWMA of "a call started while an earlier one still ran" (1) or "only after" (0),
        # from the engine's profile first (vLLM and llama.cpp interleave calls); a server without a
        # batcher shows it runs them one after another, and only waits that were real count.
        self.interleaves: dict[str, float] = {}
        self._ended_at: dict[int, float] = {}  # recently ended calls: when (monotonic)
        self._sent: dict[int, float] = {}  # calls in flight: when they went out (monotonic)
        self._embedder = HashingEmbedder()  # grouping's (extproc.coordinator.grouping says why lexical)
        self.states = states  # the node's pod states (extproc.routing.podstate.PodStates), if read
        self.session: aiohttp.ClientSession | None = None
        self.metrics = CoordinatorMetrics()

    # -- the HTTP side --------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """One client request: queue it, then answer it as its batch's call goes."""
        picks = [e.strip() for e in request.headers.get(DESTINATION_HEADER, "").split(",") if e.strip()]
        if not picks:
            return _error(503, "no pod was picked for this request", "no_route")
        try:
            tokens = int(request.headers.get(INPUT_TOKENS_HEADER, "0"))
        except ValueError:
            tokens = 0
        body = await request.read()
        try:
            raw = load(body)
            key, member = parse_object(raw, picks[0], tokens, await self._templates(raw, picks[0]))
        except NoTemplate as why:
            log.debug("sent alone to %s: %s", picks[0], why)
            return await self._alone(request, body, picks)
        except MergeError as error:
            return _error(400, f"this request cannot be batched: {error}", "invalid_request_error")
        if self._protocol_address(key.endpoint) is not None and (shared := protocol_key(key, member)) is not None:
            key = shared  # the batch protocol carries each prompt's own sampling parameters
        settings = _settings(request.headers.get(BATCH_HEADER))
        answer_id = ("chatcmpl-" if member.kind == "chat" else "cmpl-") + secrets.token_hex(16)
        pending = Pending(key, member, Answer(member, answer_id, key.model), picks[1] if len(picks) > 1 else None,
                          settings["wait_ms"] / 1000, int(settings["size"]), int(settings["tokens"]),
                          request.headers.get(QOS_HEADER, ""), settings["group"] if settings["group"] >= 0 else None,
                          trace=_member_trace(request.headers.get("traceparent")))
        self._enqueue(pending)
        try:
            await pending.dispatched.wait()
            headers = {"x-llmgw-batch-id": pending.batch_id, "x-llmgw-batch-size": str(pending.batch_size)}
            if not member.stream:
                answer = await pending.out.get()
                return web.Response(body=answer, status=pending.status, content_type="application/json",
                                    headers=headers)
            response = web.StreamResponse(headers={**headers, "content-type": "text/event-stream",
                                                   "cache-control": "no-cache"})
            try:
                await response.prepare(request)
                while (chunk := await pending.out.get()) is not None:
                    await response.write(chunk)
                await response.write_eof()
            except ConnectionResetError:  # aiohttp's ClientConnectionResetError too: the client left
                log.debug("client of batch %s left mid-answer", pending.batch_id)
            return response
        finally:
            pending.gone = True  # answered, or the client went away: nothing more is sent to it
            queue = self.queues.get(key)
            if queue is not None and pending in queue:
                queue.remove(pending)

    async def _templates(self, raw: dict[str, Any], endpoint: str) -> Mapping[str, PromptRenderer]:
        """The chat templates to render the body ``raw`` with: the config's, else, for a chat on an
        engine that renders its own (llama.cpp's ``POST /apply-template``, whose answer has no BOS:
        the engine adds its one), that rendering; else the config's alone (the chat is then sent alone)."""
        profile = self.engines.get(endpoint)
        model = raw["model"]
        if profile is None or profile.template_path is None or model in self.templates \
                or not isinstance(raw.get("messages"), list):
            return self.templates
        assert self.session is not None
        try:
            async with self.session.post(f"http://{endpoint}{profile.template_path}",
                                         data=orjson.dumps({"messages": raw["messages"]}),
                                         headers={"content-type": "application/json"},
                                         timeout=aiohttp.ClientTimeout(total=5)) as response:
                rendered = (await response.json()).get("prompt") if response.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as error:
            log.debug("pod %s could not render a chat: %s", endpoint, str(error) or type(error).__name__)
            return self.templates
        if not isinstance(rendered, str):
            return self.templates
        return {**self.templates, model: _Rendered(rendered)}

    async def _alone(self, request: web.Request, body: bytes, picks: list[str]) -> web.StreamResponse:
        """Forward a request that cannot share a call to its pod as it came (then to the fallback
        pod if the first cannot be reached), and stream the answer back unchanged."""
        assert self.session is not None
        headers = {"content-type": "application/json"}
        for name in ("traceparent", "baggage", "authorization"):
            if name in request.headers:
                headers[name] = request.headers[name]
        for endpoint in picks[:2]:
            try:
                async with self.session.post(f"http://{endpoint}{request.path}", data=body, headers=headers,
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=5,
                                                                           sock_read=POD_SILENCE_S)) as upstream:
                    response = web.StreamResponse(status=upstream.status, headers={
                        "content-type": upstream.headers.get("content-type", "application/json"),
                        "x-llmgw-batch-size": "1"})
                    try:
                        await response.prepare(request)
                        async for chunk in upstream.content.iter_any():
                            await response.write(chunk)
                        await response.write_eof()
                    except ConnectionResetError:  # the client (or the pod) left mid-answer: nothing to retry
                        log.debug("a request sent alone to %s was cut mid-answer", endpoint)
                    return response
            except aiohttp.ClientConnectionError as error:  # before any answer: the fallback pod may take it
                log.warning("pod %s could not take a request sent alone: %s", endpoint,
                            str(error) or type(error).__name__)
        return _error(502, "no pod could be reached for this request", "upstream_failed")

    # -- batching -------------------------------------------------------------------------------

    def _enqueue(self, pending: Pending) -> None:
        window = self.windows.get(pending.key)
        if window is None:
            if len(self.windows) >= MAX_WINDOWS:  # forget the windows of queues long gone
                for key in [k for k in self.windows if k not in self.queues][:MAX_WINDOWS // 2]:
                    del self.windows[key]
            window = self.windows[pending.key] = AdaptiveWindow()
        window.arrived(time.monotonic())
        self.queues.setdefault(pending.key, []).append(pending)
        wakeup = self._wakeups.setdefault(pending.key, asyncio.Event())
        wakeup.set()
        task = self._dispatchers.get(pending.key)
        if task is None or task.done():
            self._dispatchers[pending.key] = asyncio.create_task(self._dispatch(pending.key))

    def _protocol_address(self, endpoint: str) -> str | None:
        """The pod's batch-protocol address if it declared one (``GET /llmgw/v1/batch``), asked
        again every ``PROTOCOL_RECHECK_S``; until the first answer, None (vLLM's HTTP API)."""
        known = self._protocols.get(endpoint)
        if known is None or time.monotonic() - known[1] > PROTOCOL_RECHECK_S:
            self._protocols[endpoint] = (known[0] if known else None, time.monotonic())
            asyncio.create_task(self._discover(endpoint))
        return self._protocols[endpoint][0]

    async def _discover(self, endpoint: str) -> None:
        address = None
        try:
            assert self.session is not None
            async with self.session.get(f"http://{endpoint}/llmgw/v1/batch",
                                        timeout=aiohttp.ClientTimeout(total=1.0)) as response:
                if response.status == 200:
                    port = (await response.json()).get("grpc_port")
                    if isinstance(port, int):
                        address = f"{endpoint.rpartition(':')[0]}:{port}"
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            pass
        if address != self._protocols.get(endpoint, (None, 0.0))[0]:
            log.info("pod %s: %s", endpoint, f"batch protocol at {address}" if address else "vLLM's HTTP API")
        self._protocols[endpoint] = (address, time.monotonic())

    def has_room(self, endpoint: str) -> bool:
        """Work-conserving: send now when the pod would start at once. It would with no call of
        ours in flight (unless its scraped queue says others keep it busy), or when its state,
        scraped since our last call went out, shows nothing waiting and KV cache to spare."""
        state = self.states.get(endpoint) if self.states is not None else None  # type: ignore[attr-defined]
        if self.in_flight[endpoint] == 0:
            return state is None or state.waiting == 0
        if self.serializes(endpoint):
            return False  # ours in flight keeps it busy
        return (state is not None and state.scraped_at > self._sent_at.get(endpoint, 0.0)
                and state.waiting == 0 and state.kv_usage < 0.9)

    def _vectors(self, queue: list[Pending]) -> np.ndarray:
        """The queued prompts' embeddings (unit rows, in queue order), each computed once."""
        missing = [p for p in queue if p.vector is None]
        if missing:
            for pending, vector in zip(missing, self._embedder.embed([p.member.prompt for p in missing]),
                                       strict=True):
                pending.vector = vector
        return np.stack([p.vector for p in queue])  # type: ignore[misc]

    def serializes(self, endpoint: str) -> bool:
        """The pod runs one call at a time (its engine's profile, refined by ``_started``) and one
        of ours runs now."""
        learned = self.interleaves.get(endpoint, self._prior(endpoint))
        return self.in_flight[endpoint] > 0 and learned is not None and learned < 0.5

    def _prior(self, endpoint: str) -> float | None:
        """What the pod's engine profile says (1.0: it interleaves calls); None for a pod of no
        known engine, learned from its first calls alone."""
        profile = self.engines.get(endpoint)
        return None if profile is None else 1.0 if profile.continuous else 0.0

    async def _dispatch(self, key: BatchKey) -> None:
        """Form and send this key's batches until its queue is empty."""
        queue, wakeup, window = self.queues[key], self._wakeups[key], self.windows[key]
        while queue:
            first = queue[0]
            while True:
                tokens = sum(p.member.input_tokens for p in queue)
                waited = time.monotonic() - first.arrived
                wait = window.wait_s(first.wait_s, len(queue), first.size)
                # A pod that runs one call at a time would only queue this batch behind ours: it
                # waits here, where later requests can still join, until that call ends.
                held = waited >= wait and self.serializes(key.endpoint)
                reason = FULL if len(queue) >= first.size or tokens >= first.tokens else \
                    ROOM if self.has_room(key.endpoint) else WINDOW if waited >= wait and not held else None
                if reason is not None:
                    break
                wakeup.clear()
                try:
                    await asyncio.wait_for(wakeup.wait(), HELD_RECHECK_S if held else wait - waited)
                except TimeoutError:
                    pass
                if not queue or queue[0] is not first:
                    break
            if not queue or queue[0] is not first:
                continue  # the oldest went away: the next one's window starts from its own arrival
            assert reason is not None  # the wait above ends on a reason, or the loop starts over
            window.departed(reason)
            self.metrics.departures.labels(reason).inc()
            self.metrics.window.labels(key.model).set(wait)
            queue.sort(key=_rank)  # by class, with aging: a waiting batch-class request catches up
            lead = queue[0]
            picked, joined = choose([p.member.prompt for p in queue], [p.member.input_tokens for p in queue],
                                    lead.size, lead.tokens, lead.group, lambda: self._vectors(queue))
            batch = [queue[i] for i in picked]
            for i in reversed(picked):
                del queue[i]
            for affinity, count in joined.items():
                self.metrics.grouped.labels(affinity).inc(count)
            asyncio.create_task(self._send(key, batch, reason))
        self.queues.pop(key, None)
        self._wakeups.pop(key, None)

    async def _send(self, key: BatchKey, batch: list[Pending], reason: str = WINDOW) -> None:
        """Send one batch and see every member answered; a bug fails its members with a 500, never
        leaves one waiting."""
        try:
            await self._send_batch(key, batch, reason)
        except Exception:  # logged with its traceback; every member still gets an answer
            log.exception("batch to pod %s failed inside the coordinator", key.endpoint)
            for pending in batch:
                pending.dispatched.set()
                if not pending.ended:
                    pending.status = 500
                    pending.out.put_nowait(_failure(pending, "the batching coordinator failed on this request",
                                                    "internal_error"))
                    pending.end()

    async def _send_batch(self, key: BatchKey, batch: list[Pending], reason: str) -> None:
        batch_id = secrets.token_hex(8)
        trace_id, span_id, start_ns = random_hex(16), random_hex(8), time.time_ns()
        for pending in batch:
            pending.batch_id, pending.batch_size = batch_id, len(batch)
            pending.dispatched.set()
        started = time.monotonic()
        traceparent = f"00-{trace_id}-{span_id}-01"
        address = self._protocols.get(key.endpoint, (None, 0.0))[0] if key.sampling == PROTOCOL else None
        self.metrics.size.labels(key.model, "llmgw.v1" if address is not None else "http").observe(len(batch))
        if address is not None:
            unfinished = await self._call_protocol(address, key, batch, batch_id, traceparent)
        else:
            if key.sampling == PROTOCOL:  # the pod stopped declaring it: HTTP, one prompt's parameters each
                unfinished = batch
            else:
                unfinished = await self._call(key.endpoint, key, batch, batch_id, [p.member.prompt for p in batch],
                                              traceparent)
        if key in self.windows and not unfinished:
            self.windows[key].answered(time.monotonic() - started)
        if self.tracer is not None:
            self.tracer.export_batch(BatchSpan(
                batch_id, trace_id, span_id, key.model, key.endpoint, reason,
                tuple(p.trace for p in batch if p.trace is not None), start_ns, time.time_ns(),
                f"{len(unfinished)} of {len(batch)} answers cut" if unfinished else None))
        # Each member alone, all at once: none waits for the others' retries.
        await asyncio.gather(*(self._resume(key, p, batch_id) for p in unfinished if not p.gone))

    async def _resume(self, key: BatchKey, pending: Pending, batch_id: str) -> None:
        """Retry a member the pod did not finish, alone on the fallback, resumed after what its client
        already has (its prompt plus that text, for the tokens left); a 502 if that fails too."""
        params = dict(pending.member.params)
        limit = params.pop("max_tokens", None) if key.sampling == PROTOCOL else key.max_tokens
        had = pending.answer.events  # about one token each (vLLM streams a token per event)
        if limit is not None and had >= limit:  # cut after its last token, before the end: complete
            if (event := pending.answer.delta("", "length")) and not pending.gone:
                pending.out.put_nowait(event)
            if not pending.gone:
                pending.out.put_nowait(pending.answer.end(Usage(pending.member.input_tokens, had, 0)))
                pending.end()
            return
        target = pending.fallback or key.endpoint
        resumed = pending.member.prompt + "".join(pending.answer.parts)
        sampling = orjson.dumps(params, option=orjson.OPT_SORT_KEYS) if key.sampling == PROTOCOL else key.sampling
        retry_key = BatchKey(target, key.model, None if limit is None else limit - had, sampling)
        pending.carried = had
        failed = await self._call(target, retry_key, [pending], batch_id, [resumed])
        self.metrics.retries.labels("failed" if failed else "resumed").inc()
        if failed:
            pending.status = 502
            pending.out.put_nowait(_failure(pending, "the pod failed while generating this answer, and so did "
                                            "the retry", "upstream_failed"))
            pending.end()

    def _calling(self, endpoint: str) -> tuple[int, frozenset[int]]:
        """A call to ``endpoint`` goes out (``has_room`` counts it): its id, and the calls ahead of it."""
        self.in_flight[endpoint] += 1
        self._sent_at[endpoint] = time.time()
        calls = self._open.setdefault(endpoint, set())
        ahead = frozenset(calls)
        call = next(self._call_ids)
        calls.add(call)
        self._sent[call] = time.monotonic()
        return call, ahead

    def _started(self, endpoint: str, ahead: frozenset[int], call: int) -> None:
        """A call's first token came back. If calls were ahead of it, learn whether the pod started
        it while one of them still ran (it interleaves calls) or only once they had all ended, and
        kept it waiting for them: calls ahead that ended within ``SERIAL_EVIDENCE_S`` of this one's
        sending say nothing (at low load every call ends before the next one starts)."""
        if not ahead:
            return
        if ahead & self._open.get(endpoint, set()):
            interleaved = 1.0
        else:
            last_end = max((self._ended_at.get(c, 0.0) for c in ahead), default=0.0)
            if last_end - self._sent.get(call, last_end) < self.serial_evidence_s:
                return
            interleaved = 0.0
        before = self.interleaves.get(endpoint, self._prior(endpoint))
        now = self.interleaves[endpoint] = interleaved if before is None else 0.2 * interleaved + 0.8 * before
        if before is None or (before < 0.5) != (now < 0.5):
            log.info("pod %s %s", endpoint, "runs one call at a time: batches wait while it is busy"
                     if now < 0.5 else "interleaves calls")

    def _called(self, endpoint: str, call: int) -> None:
        """A call to ``endpoint`` ended: the pod may have room again for the queues waiting on it."""
        self.in_flight[endpoint] -= 1
        self._open.get(endpoint, set()).discard(call)
        self._sent.pop(call, None)
        self._ended_at[call] = time.monotonic()
        if len(self._ended_at) > ENDED_KEPT:  # only calls that were ahead of one still in flight matter
            for old in list(self._ended_at)[:ENDED_KEPT // 2]:
                del self._ended_at[old]
        for waiting_key, wakeup in self._wakeups.items():
            if waiting_key.endpoint == endpoint:
                wakeup.set()

    async def _call_protocol(self, address: str, key: BatchKey, batch: list[Pending], batch_id: str,
                             traceparent: str) -> list[Pending]:
        """One call of the batch protocol: each member with its own sampling parameters, and its
        own exact usage in its last delta. Returns the members not finished (cut, or refused)."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        request = batch_pb2.GenerateRequest(model=key.model, batch_id=batch_id, items=[
            batch_pb2.BatchItem(index=i, text=p.member.prompt, params=_sampling(p.member))
            for i, p in enumerate(batch)])
        finished: set[int] = set()
        call_id, ahead = self._calling(key.endpoint)
        call = batch_pb2_grpc.BatchGenerationStub(channel).Generate(
            request, metadata=(("traceparent", traceparent), ("baggage", f"llmgw.batch_id={batch_id}")))
        try:
            # Each read bounded as the HTTP call's socket reads are (sock_read): a hung pod fails the call.
            while (response := await asyncio.wait_for(call.read(), POD_SILENCE_S)) is not grpc.aio.EOF:
                if ahead:
                    self._started(key.endpoint, ahead, call_id)
                    ahead = frozenset()
                for delta in response.deltas:
                    if not 0 <= delta.index < len(batch):
                        continue
                    pending = batch[delta.index]
                    if delta.HasField("error"):
                        finished.add(delta.index)
                        if not pending.gone:
                            pending.out.put_nowait(_item_error(pending, delta.error))
                            pending.end()
                        continue
                    event = pending.answer.delta(delta.text, delta.finish_reason or None)
                    if event and not pending.gone:
                        pending.out.put_nowait(event)
                    if delta.HasField("usage"):
                        finished.add(delta.index)
                        usage = Usage(delta.usage.prompt_tokens, delta.usage.completion_tokens,
                                      delta.usage.cached_tokens)
                        if not pending.gone:
                            pending.out.put_nowait(pending.answer.end(usage))
                            pending.end()
        except grpc.aio.AioRpcError as error:
            log.warning("batch %s to pod %s (batch protocol) failed: %s", batch_id, address, error.code().name)
            if error.code() == grpc.StatusCode.UNAVAILABLE and self._protocols.get(key.endpoint, (None,))[0] == address:
                # The pod went away; started again, it may serve the protocol on another port, or not at
                # all: ask it again (vLLM's HTTP API meanwhile) rather than trust this address for long.
                del self._protocols[key.endpoint]
        except TimeoutError:
            call.cancel()
            log.warning("batch %s to pod %s (batch protocol) failed: silent for %.0f s", batch_id, address,
                        POD_SILENCE_S)
        finally:
            self._called(key.endpoint, call_id)
        return [p for i, p in enumerate(batch) if i not in finished]

    async def _call(self, endpoint: str, key: BatchKey, batch: list[Pending], batch_id: str,
                    prompts: list[str], traceparent: str | None = None) -> list[Pending]:
        """One merged call; its members' answers are streamed and ended. Returns the members the
        pod did not finish (the call failed or was cut)."""
        assert self.session is not None
        call_id, ahead = self._calling(endpoint)
        finished: set[int] = set()
        usage = None  # the whole call's (vLLM: a last chunk with no choices)
        own: dict[int, Usage] = {}  # each prompt's own (llama.cpp: in that prompt's last chunk)
        try:
            async with self.session.post(
                    f"http://{endpoint}/v1/completions", data=pod_body(key, prompts),
                    headers={"content-type": "application/json", "baggage": f"llmgw.batch_id={batch_id}",
                             **({"traceparent": traceparent} if traceparent else {})},
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=POD_SILENCE_S)) as response:
                if response.status != 200:
                    log.warning("pod %s answered %d to batch %s", endpoint, response.status, batch_id)
                    return batch
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = orjson.loads(line[6:])
                    if not isinstance(chunk, dict):  # llama.cpp marks each further prompt's start `data: null`
                        continue
                    if ahead:
                        self._started(endpoint, ahead, call_id)
                        ahead = frozenset()
                    choices: list[dict[str, Any]] = chunk.get("choices") or []
                    if chunk.get("usage"):
                        index = choices[0].get("index", 0) if len(choices) == 1 else None
                        if index is not None and 0 <= index < len(batch):
                            own[index] = own_usage(chunk["usage"])
                        else:
                            usage = chunk["usage"]
                    for choice in choices:
                        index = choice.get("index", 0)
                        if not 0 <= index < len(batch):
                            continue
                        pending = batch[index]
                        reason = choice.get("finish_reason")
                        event = pending.answer.delta(choice.get("text") or "", reason)
                        if event and not pending.gone:
                            pending.out.put_nowait(event)
                        if reason is not None:
                            finished.add(index)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as error:
            log.warning("batch %s to pod %s failed: %s", batch_id, endpoint, str(error) or type(error).__name__)
        finally:
            self._called(endpoint, call_id)
        done = [p for i, p in enumerate(batch) if i in finished]
        pod_usage = usage if len(done) == len(batch) else None
        split = shares(pod_usage, [p.member for p in batch], [p.answer.events for p in batch])
        for index, (pending, share) in enumerate(zip(batch, split, strict=True)):
            if index in own:
                share = own[index]
            if pending in done and not pending.gone:
                if (pod_usage is not None or index in own) and pending.carried:
                    share = _resumed_usage(share, pending.carried)
                pending.out.put_nowait(pending.answer.end(share))
                pending.end()
        return [p for i, p in enumerate(batch) if i not in finished]


class _Rendered:
    """A chat the engine already rendered: the prompt, whatever the messages."""

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt

    def __call__(self, messages: object, tools: object = None) -> str:
        return self.prompt


def _resumed_usage(usage: Usage, carried: int) -> Usage:
    """A resumed member's usage from its retry's: the ``carried`` tokens it had before were part of
    the retry's prompt, and count as its completion again (as OpenAI counts one request)."""
    moved = min(carried, usage.input_tokens)
    prompt = usage.input_tokens - moved
    return Usage(prompt, usage.output_tokens + moved, min(usage.cached_tokens, prompt))


def _member_trace(header: str | None) -> tuple[str, str, bool] | None:
    """A member's gateway span from the traceparent extproc sent (its span is the pod call's parent)."""
    parts = (header or "").strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        int(parts[1], 16), int(parts[2], 16)
        sampled = bool(int(parts[3], 16) & 1)
    except ValueError:
        return None
    return parts[1], parts[2], sampled


def _rank(pending: Pending) -> float:
    """The order a queue's requests join a batch: arrival, moved back by the class's handicap."""
    return pending.arrived + QOS_HANDICAP_S.get(pending.qos, 0.0)


def _failure(pending: Pending, message: str, code: str) -> bytes:
    """A server-side failure as the client expects it: a JSON error, or an SSE error event and [DONE]."""
    body = orjson.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}})
    return b"data: " + body + b"\n\ndata: [DONE]\n\n" if pending.member.stream else body


def _item_error(pending: Pending, error: batch_pb2.Error) -> bytes:
    """A member the pod refused: its OpenAI error (as SSE for a streaming client)."""
    pending.status = error.status or 400
    body = orjson.dumps({"error": {"message": error.message, "type": error.type or "invalid_request_error",
                                   "param": error.param or None, "code": None}})
    return b"data: " + body + b"\n\ndata: [DONE]\n\n" if pending.member.stream else body


def _sampling(member: Member) -> batch_pb2.SamplingParams:
    params = dict(member.params)
    stop = params.get("stop")
    return batch_pb2.SamplingParams(
        max_tokens=params.get("max_tokens"), temperature=params.get("temperature"), top_p=params.get("top_p"),
        stop=[stop] if isinstance(stop, str) else list(stop or ()), seed=params.get("seed"),
        ignore_eos=bool(params.get("ignore_eos")), min_tokens=int(params.get("min_tokens") or 0))


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                        else "server_error", "param": None, "code": code}}, status=status)


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


def build_app(coordinator: Coordinator) -> web.Application:
    """The coordinator's HTTP app: the two batchable OpenAI endpoints and ``/health``."""
    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/chat/completions", coordinator.handle)
    app.router.add_post("/v1/completions", coordinator.handle)
    app.router.add_get("/health", _health)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(coordinator.metrics.registry),
                            headers={"content-type": CONTENT_TYPE_LATEST})

    app.router.add_get("/metrics", metrics)

    async def session(app: web.Application) -> AsyncIterator[None]:
        coordinator.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await coordinator.session.close()
        for channel in coordinator._channels.values():
            await channel.close()

    app.cleanup_ctx.append(session)
    return app
