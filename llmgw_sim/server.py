"""The HTTP shell of the simulated pod: vLLM's OpenAI-compatible routes on aiohttp.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
``GET /v1/models``, ``GET /health``, ``GET /metrics``, and ``GET``/``DELETE /debug/requests``
(the last N received POST requests, with ``--record N``); with ``batch_grpc_port`` set, also
``GET /llmgw/v1/batch`` (where the pod serves the batch protocol, ``batch_grpc.py``). POST
requests echo ``x-request-id`` and use it in the response id (vLLM's
``--enable-request-id-headers``). Everything the handlers decide lives in the pure modules; this
one reads the wire, calls them, and writes the wire.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import orjson
from aiohttp import web

from llmgw_sim import responses
from llmgw_sim.embed import embed, to_base64, truncate
from llmgw_sim.engine import RequestTracker, SimEngine
from llmgw_sim.faults import ERROR_TYPES, FaultConfig, FaultInjector
from llmgw_sim.generate import OutputPlan, SamplingParams, choice_seed, plan_output, prompt_key
from llmgw_sim.metrics import METRICS_CONTENT_TYPE, SimMetrics
from llmgw_sim.options import SimOptions
from llmgw_sim.prefix_cache import block_hashes
from llmgw_sim.protocol import (
    ChatPrompt,
    Endpoint,
    GenerationRequest,
    InvalidRequest,
    Prompt,
    TextPrompt,
    parse_embedding,
    parse_generation,
)
from llmgw_sim.scheduler import Scheduler, SimSequence, StepResult, make_scheduler
from llmgw_sim.tokens import SimTokenizer

REQUEST_ID_HEADER = "x-request-id"
Operation = Literal["chat", "completion", "embedding"]
_POOLING_PLAN = OutputPlan(token_ids=[], deltas=[], finish_reason="stop")
_HANG_POLL_S = 0.05
_CRASH_DELAY_S = 0.05  # let the last response leave the socket before the hard exit
# die_after_tokens: the engine stops at once, the process ends this much later (the last tokens
# handed out reach their clients even on a loaded machine, and none after them can)
_DIE_DELAY_S = 0.3


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One received generation request, as ``/debug/requests`` shows it."""

    method: str
    path: str
    headers: dict[str, str]
    body: object

    def to_json(self) -> dict[str, object]:
        """The JSON form of this record."""
        return {"method": self.method, "path": self.path, "headers": self.headers, "body": self.body}


class RequestError(Exception):
    """A refused request: HTTP status, OpenAI error type, message, param."""

    def __init__(self, status: int, err_type: str, message: str, param: str | None = None,
                 retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.status = status
        self.err_type = err_type
        self.param = param
        self.retry_after_s = retry_after_s  # > 0: sent as retry-after (whole seconds, at least 1)


def _bad_request(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, "BadRequestError", message, param)


@dataclass(frozen=True, slots=True)
class ValidGeneration:
    """A generation request the pod accepts: the parsed body, the name to answer with, the LoRA
    adapter it runs on, its prompts' token ids and the tokens each choice may generate."""

    parsed: GenerationRequest
    model: str
    lora: str | None
    prompt_ids: list[list[int]]
    max_tokens: int


def _exit_hard() -> None:
    os._exit(1)


class SimPod:
    """One simulated pod: wiring of tokenizer, scheduler, engine, metrics and faults."""

    def __init__(self, options: SimOptions, tokenizer: SimTokenizer,
                 exit_process: Callable[[], None] = _exit_hard) -> None:
        self.options = options
        self.tokenizer = tokenizer
        self.metrics = SimMetrics(options.model, options.max_model_len,
                                  options.max_loras if options.enable_lora else None)
        self.scheduler = make_scheduler(options.engine, options.cost, options.max_loras)
        self.engine = SimEngine(self.scheduler, options.time_scale, self._on_step, self._on_sequence_finished)
        self.faults = FaultInjector(options.faults, random.Random(f"faults:{options.seed}"))
        self._dying = False  # die_after_tokens: a sequence reached it; the process ends before the next step
        self._rng = random.Random(f"sampling:{options.seed}")
        self._exit_process = exit_process
        self.recorded: deque[RecordedRequest] | None = (
            deque(maxlen=options.record) if options.record else None)
        self.created = int(time.time())
        self.closing = asyncio.Event()  # set when the server stops: releases injected hangs
        self.batch_grpc_port: int | None = None  # bound by batch_grpc.serve_batch_grpc
        self._adapters = options.adapters
        self._served = frozenset(options.served_models) | self._adapters.keys()
        self._models_body = responses.model_list(options.served_models, self.created,
                                                 options.max_model_len, self._adapters)

    # -- wiring -------------------------------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        """Register the pod's routes and its engine task on ``app``."""
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/debug/requests", self.debug_requests)
        app.router.add_delete("/debug/requests", self.clear_debug_requests)
        app.router.add_put("/debug/faults", self.set_faults)
        if self.options.batch_grpc_port is not None:
            app.router.add_get("/llmgw/v1/batch", self.batch_info)
        app.cleanup_ctx.append(self._engine_task)
        app.on_shutdown.append(self._on_shutdown)

    async def _on_shutdown(self, _app: web.Application) -> None:
        self.closing.set()  # releases injected hangs so that a stop is quick

    async def _engine_task(self, _app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.engine.run(), name="sim-engine")
        yield
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    # -- simple routes ------------------------------------------------------------------------

    async def health(self, _request: web.Request) -> web.Response:
        """``GET /health``: 200 with an empty body, as vLLM answers."""
        return web.Response(status=200)

    async def models(self, _request: web.Request) -> web.Response:
        """``GET /v1/models``."""
        return web.Response(body=self._models_body, content_type="application/json")

    async def metrics_page(self, _request: web.Request) -> web.Response:
        """``GET /metrics`` in Prometheus text format."""
        self.metrics.refresh_gauges(self.scheduler)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def batch_info(self, _request: web.Request) -> web.Response:
        """``GET /llmgw/v1/batch``: the pod serves ``llmgw.v1.BatchGeneration`` on this port of
        its HTTP host (a vLLM pod answers 404: use its HTTP API)."""
        if self.batch_grpc_port is None:  # not bound yet, or stopped
            return _error_response(RequestError(503, "ServiceUnavailableError",
                                                "the batch gRPC server is not running"))
        body = orjson.dumps({"service": "llmgw.v1.BatchGeneration", "grpc_port": self.batch_grpc_port})
        return web.Response(body=body, content_type="application/json")

    async def debug_requests(self, _request: web.Request) -> web.Response:
        """``GET /debug/requests``: the last recorded requests, oldest first."""
        if self.recorded is None:
            return _error_response(RequestError(404, "NotFoundError",
                                              "request recording is off (start with --record N)"))
        body = orjson.dumps({"requests": [r.to_json() for r in self.recorded]})
        return web.Response(body=body, content_type="application/json")

    async def set_faults(self, request: web.Request) -> web.Response:
        """``PUT /debug/faults``: new fault settings (the FaultConfig fields; those not given are
        off), so a test can make a running pod fail and recover."""
        try:
            fields = orjson.loads(await request.read())
            config = FaultConfig(**fields) if isinstance(fields, dict) else None
        except (orjson.JSONDecodeError, TypeError, ValueError) as error:
            return _error_response(RequestError(400, "BadRequestError", f"bad fault settings: {error}"))
        if config is None:
            return _error_response(RequestError(400, "BadRequestError", "fault settings must be an object"))
        self.faults.config = config
        return web.Response(status=204)

    async def clear_debug_requests(self, _request: web.Request) -> web.Response:
        """``DELETE /debug/requests``: forget what was recorded."""
        if self.recorded is not None:
            self.recorded.clear()
        return web.Response(status=204)

    # -- generation ---------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``."""
        return await self._handle(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``."""
        return await self._handle(request, "completion")

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/embeddings``."""
        return await self._handle(request, "embedding")

    async def _handle(self, request: web.Request, operation: Operation) -> web.StreamResponse:
        """What every POST shares: request id, crash count, recording, injected faults."""
        arrived = time.monotonic()
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        crash = self.faults.count_request()
        try:
            return await self._serve(request, operation, request_id, arrived)
        except RequestError as err:
            return _error_response(err, request_id)
        finally:
            if crash:
                self.exit_soon()

    def exit_soon(self, delay_s: float = _CRASH_DELAY_S) -> None:
        """End the process ``delay_s`` from now (``crash_after``: once the last answer has left the
        socket; ``die_after_tokens``: ``_DIE_DELAY_S``, once the tokens handed out have)."""
        asyncio.get_running_loop().call_later(delay_s, self._exit_process)

    def _on_step(self, result: StepResult, scheduler: Scheduler) -> None:
        """After each engine step, before its tokens are handed out: metrics, and ``die_after_tokens``.

        The step in which a sequence generates its N-th token is handed out (every stream and
        batch-protocol call gets its tokens); the engine stops before the next step is, and the
        process ends ``_DIE_DELAY_S`` after that step: its clients' connections are cut mid-answer,
        each having got exactly the tokens handed out."""
        self.metrics.record_step(result, scheduler)
        if self._dying:
            self.engine.halt()
        elif any(self.faults.dies_after(seq.generated) for seq in result.emitted):
            self._dying = True
            self.exit_soon(_DIE_DELAY_S)

    async def _serve(self, request: web.Request, operation: Operation, request_id: str,
                     arrived: float) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: object = orjson.loads(raw)
        except orjson.JSONDecodeError as err:
            self._record(request, raw.decode("utf-8", "replace"))
            raise _bad_request(f"Invalid JSON body: {err}") from err
        self._record(request, body)

        decision = self.faults.decide()
        if decision.error_status is not None:
            raise RequestError(decision.error_status, ERROR_TYPES[decision.error_status],
                               "injected failure (simulated pod)",
                               retry_after_s=self.faults.config.retry_after_s if decision.error_status == 503 else 0.0)
        if decision.hang:
            await _wait_for_disconnect(request, self.closing)
            return web.Response(status=503)
        if operation == "embedding":
            return await self._embed(body, request_id, arrived, decision.spike_s)
        return await self._generate(request, operation, body, request_id, arrived, decision.spike_s)

    def _check_model(self, model: str | None) -> str:
        """The name to answer with (vLLM echoes the name asked for); 404 for unknown names."""
        if model is None:
            return self.options.model
        if model not in self._served:
            raise RequestError(404, "NotFoundError", f"The model `{model}` does not exist.", "model")
        return model

    def _lora(self, model: str) -> str | None:
        """The LoRA adapter a request names as its model, else None (the base model)."""
        return model if model in self._adapters else None

    def validate_generation(self, endpoint: Endpoint, body: object) -> ValidGeneration:
        """Check a chat or completions body as vLLM would; ``RequestError`` says why not."""
        try:
            parsed = parse_generation(endpoint, body)
        except InvalidRequest as err:
            raise _bad_request(str(err), err.param) from err
        model = self._check_model(parsed.model)
        prompt_ids = self._prompt_ids(parsed.prompts, "messages" if endpoint == "chat" else "prompt")
        max_tokens = self._max_tokens(parsed, prompt_ids)
        return ValidGeneration(parsed, model, self._lora(model), prompt_ids, max_tokens)

    async def _generate(self, request: web.Request, endpoint: Endpoint, body: object,
                        request_id: str, arrived: float, spike_s: float) -> web.StreamResponse:
        valid = self.validate_generation(endpoint, body)
        parsed, model = valid.parsed, valid.model
        if spike_s:
            await asyncio.sleep(spike_s)

        tracker = RequestTracker(*self.plan_sequences(valid), parsed.stream, arrived)
        head = responses.ResponseHead(
            id=f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{request_id}",
            created=int(time.time()),
            model=model,
        )
        usage_prompt = sum(len(ids) for ids in valid.prompt_ids)
        self.engine.submit(tracker)
        try:
            if parsed.stream:
                return await self._stream(request, parsed, tracker, head, request_id, usage_prompt)
            while not tracker.done:
                await tracker.wait()
        finally:
            if not tracker.done:
                self.abort(tracker)
        choices = [responses.ChoiceResult(i, plan.text, plan.finish_reason, plan.stop_reason)
                   for i, plan in enumerate(tracker.plans)]
        usage = self._usage(parsed, tracker, usage_prompt)
        shape = responses.chat_completion if parsed.endpoint == "chat" else responses.text_completion
        return web.Response(body=shape(head, choices, usage), content_type="application/json",
                            headers={REQUEST_ID_HEADER: request_id})

    async def _embed(self, body: object, request_id: str, arrived: float,
                     spike_s: float) -> web.Response:
        try:
            parsed = parse_embedding(body)
        except InvalidRequest as err:
            raise _bad_request(str(err), err.param) from err
        model = self._check_model(parsed.model)
        prompt_ids = self._prompt_ids(parsed.inputs, "input")
        limit = self.options.max_model_len
        longest = max(len(ids) for ids in prompt_ids)
        if longest > limit:
            raise _bad_request(f"This model's maximum context length is {limit} tokens. However, "
                               f"you requested {longest} tokens in the input for embedding "
                               "generation. Please reduce the length of the input.", "input")
        dim = self.options.embedding_dim
        if parsed.dimensions is not None and parsed.dimensions > dim:
            raise _bad_request(f"dimensions must be at most {dim}", "dimensions")
        if spike_s:
            await asyncio.sleep(spike_s)
        # The pooling pass is a prefill; it is modelled as a sequence with one output step.
        block_size = self.options.cost.block_size
        lora = self._lora(model)
        seqs = [SimSequence(prompt_len=len(ids), block_hashes=block_hashes(ids, block_size, lora),
                            output_len=1, lora=lora)
                for ids in prompt_ids]
        tracker = RequestTracker(seqs, [_POOLING_PLAN] * len(seqs), False, arrived)
        self.engine.submit(tracker)
        try:
            while not tracker.done:
                await tracker.wait()
        finally:
            if not tracker.done:
                self.abort(tracker)
        vectors = [embed(ids, dim) for ids in prompt_ids]
        if parsed.dimensions is not None:
            vectors = [truncate(v, parsed.dimensions) for v in vectors]
        data: list[list[float]] | list[str] = (
            [to_base64(v) for v in vectors] if parsed.encoding_format == "base64" else vectors)
        head = responses.ResponseHead(id=f"embd-{request_id}", created=int(time.time()), model=model)
        return web.Response(body=responses.embedding_list(head, data, sum(map(len, prompt_ids))),
                            content_type="application/json", headers={REQUEST_ID_HEADER: request_id})

    def _record(self, request: web.Request, body: object) -> None:
        if self.recorded is None:
            return
        self.record(request.method, request.path, request.headers.items(), body)

    def record(self, method: str, path: str, headers: Iterable[tuple[str, str]], body: object) -> None:
        """Keep one received request for ``/debug/requests`` (with ``--record N``); repeated
        header names are joined with ", "."""
        if self.recorded is None:
            return
        joined: dict[str, str] = {}
        for name, value in headers:
            key = name.lower()
            joined[key] = f"{joined[key]}, {value}" if key in joined else value
        self.recorded.append(RecordedRequest(method, path, joined, body))

    def _prompt_ids(self, prompts: Sequence[Prompt], param: str) -> list[list[int]]:
        texts = [p.text for p in prompts if isinstance(p, TextPrompt)]
        encoded = iter(self.tokenizer.encode_texts(texts) if texts else [])
        result: list[list[int]] = []
        vocab = self.tokenizer.vocab_size
        for prompt in prompts:
            if isinstance(prompt, ChatPrompt):
                ids = self.tokenizer.encode_segments(prompt.segments)
            elif isinstance(prompt, TextPrompt):
                ids = next(encoded)
            else:
                ids = prompt.token_ids
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise _bad_request(f"Token id {bad} is out of vocabulary", param)
            if not ids:
                raise _bad_request("The decoder prompt cannot be empty", param)
            result.append(ids)
        return result

    def _max_tokens(self, parsed: GenerationRequest, prompt_ids: list[list[int]]) -> int:
        """``max_tokens``, defaulting to the context left, as vLLM does; 400 past the context."""
        limit = self.options.max_model_len
        longest = max(len(ids) for ids in prompt_ids)
        if parsed.max_tokens is None:
            if longest >= limit:
                raise _bad_request(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"request has {longest} input tokens. Please reduce the length of the input "
                    "messages.", "messages" if parsed.endpoint == "chat" else "prompt")
            return limit - longest
        if longest + parsed.max_tokens > limit:
            raise _bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{longest + parsed.max_tokens} tokens ({longest} in the messages, "
                f"{parsed.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.", "max_tokens")
        return parsed.max_tokens

    def plan_sequences(self, valid: ValidGeneration) -> tuple[list[SimSequence], list[OutputPlan]]:
        """The engine sequences of an accepted request and what each will say, in choice order."""
        parsed, prompt_ids, max_tokens, lora = valid.parsed, valid.prompt_ids, valid.max_tokens, valid.lora
        params = SamplingParams(max_tokens=max_tokens, temperature=parsed.temperature,
                                seed=parsed.seed, stop=parsed.stop, ignore_eos=parsed.ignore_eos,
                                min_tokens=parsed.min_tokens)
        fallback_seed = self._rng.getrandbits(63)
        words, lengths, block_size = self.tokenizer.words, self.options.lengths, self.options.cost.block_size
        chat = parsed.endpoint == "chat"
        seqs: list[SimSequence] = []
        plans: list[OutputPlan] = []
        # OpenAI/vLLM order: choice index = prompt_index * n + i.
        for ids in prompt_ids:
            key = prompt_key(ids)
            hashes = block_hashes(ids, block_size, lora)
            for i in range(parsed.n):
                plan = plan_output(words, lengths, params, choice_seed(params, fallback_seed, key, i),
                                   ignore_eos=self.options.ignore_eos, opening=chat)
                plans.append(plan)
                seqs.append(SimSequence(prompt_len=len(ids), block_hashes=hashes,
                                        output_len=len(plan.token_ids), lora=lora))
        return seqs, plans

    def _usage(self, parsed: GenerationRequest, tracker: RequestTracker,
               prompt_tokens: int) -> responses.Usage:
        # Prompt tokens count once per prompt, not per choice (OpenAI, vLLM); cached tokens are
        # those of each prompt's first choice.
        first_choices = tracker.seqs[::parsed.n]
        return responses.Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=sum(len(p.token_ids) for p in tracker.plans),
            cached_tokens=sum(s.cached_tokens for s in first_choices),
        )

    async def _stream(self, request: web.Request, parsed: GenerationRequest, tracker: RequestTracker,
                      head: responses.ResponseHead, request_id: str,
                      prompt_tokens: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", REQUEST_ID_HEADER: request_id})
        chat = parsed.endpoint == "chat"
        delta_chunk = responses.chat_delta_chunk if chat else responses.completion_delta_chunk
        plans = tracker.plans
        sent = [0] * len(plans)
        try:
            await resp.prepare(request)
            if chat:
                await resp.write(b"".join(responses.chat_role_chunk(head, i) for i in range(len(plans))))
            while True:
                await tracker.wait()
                done = tracker.done  # read first: the engine may finish while this chunk is written
                parts: list[bytes] = []
                for index, plan in enumerate(plans):
                    delivered, already = tracker.delivered[index], sent[index]
                    if delivered <= already:
                        continue
                    sent[index] = delivered
                    # A slow reader gets the tokens of several steps in one chunk (vLLM merges too).
                    text = "".join(plan.deltas[already:delivered])
                    if delivered == len(plan.token_ids):
                        parts.append(delta_chunk(head, index, text, plan.finish_reason, plan.stop_reason))
                    elif text:
                        parts.append(delta_chunk(head, index, text, None, None))
                if parts:
                    await resp.write(b"".join(parts))
                if done:
                    break
            tail = [responses.SSE_DONE]
            if parsed.include_usage:
                usage = self._usage(parsed, tracker, prompt_tokens)
                tail.insert(0, responses.usage_chunk(head, "chat.completion.chunk" if chat
                                                     else "text_completion", usage))
            await resp.write(b"".join(tail))
            await resp.write_eof()
        except ConnectionError:
            pass  # the client went away; the caller aborts what is left
        return resp

    def abort(self, tracker: RequestTracker) -> None:
        """Stop what is left of ``tracker`` (its client went away); it counts as aborted."""
        undelivered = [index for index, plan in enumerate(tracker.plans)
                       if tracker.delivered[index] < len(plan.token_ids)]
        self.engine.abort(tracker)
        now = time.monotonic()
        for index in undelivered:
            self._record_sequence(tracker, index, "abort", now)

    def _on_sequence_finished(self, tracker: RequestTracker, seq: SimSequence) -> None:
        index = seq.index
        now = tracker.finished_at or time.monotonic()
        self._record_sequence(tracker, index, tracker.plans[index].finish_reason, now)

    def _record_sequence(self, tracker: RequestTracker, index: int, reason: str, now: float) -> None:
        first = tracker.first_token_at[index]
        self.metrics.record_finished(
            finish_reason=reason,
            prompt_tokens=tracker.seqs[index].prompt_len,
            generation_tokens=tracker.delivered[index],
            ttft_s=None if first is None else first - tracker.arrived_at,
            e2e_s=now - tracker.arrived_at,
        )


async def _wait_for_disconnect(request: web.Request, closing: asyncio.Event) -> None:
    """Hold a request open until its client goes away or the server stops (an injected hang)."""
    while not closing.is_set():
        transport = request.transport
        if transport is None or transport.is_closing():
            return
        await asyncio.sleep(_HANG_POLL_S)


def _error_response(err: RequestError, request_id: str | None = None) -> web.Response:
    headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
    if err.retry_after_s > 0:
        headers["retry-after"] = str(max(1, round(err.retry_after_s)))
    return web.Response(status=err.status, content_type="application/json", headers=headers,
                        body=responses.error_body(str(err), err.err_type, err.status, err.param))


SIM_POD = web.AppKey("sim_pod", SimPod)


def build_app(options: SimOptions, tokenizer: SimTokenizer | None = None,
              exit_process: Callable[[], None] = _exit_hard) -> web.Application:
    """An aiohttp application serving one simulated pod. ``tokenizer`` may be passed to share
    one loaded tokenizer between pods; ``exit_process`` is what ``crash_after`` calls."""
    pod = SimPod(options, tokenizer or SimTokenizer.from_spec(options.tokenizer), exit_process)
    app = web.Application(client_max_size=64 * 1024**2)
    app[SIM_POD] = pod
    pod.add_routes(app)
    if options.batch_grpc_port is not None:
        # Imported here: a pod without the batch protocol needs neither grpc nor its stubs.
        from llmgw_sim.batch_grpc import serve_batch_grpc

        # After the engine's context, so it stops first (cleanup runs in reverse order).
        app.cleanup_ctx.append(lambda _app: serve_batch_grpc(pod))
    return app
