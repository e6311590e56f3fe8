"""The ext_proc gRPC servicer (grpc.aio): a tiny stream loop around the pure core.

    recv -> check the phase table -> gateway decides (running the effects it asks for) -> wire -> send

The stream ends as soon as the request is decided: Envoy treats a server's close as "processing
complete" and forwards the rest of the request untouched. The decision travels on with the request
as dynamic metadata, and the access-log entry that ends it settles it (``extproc.accesslog``), so no
process holds anything per request after its decision, and a restarted worker cuts no generation.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.api import ApiError
from extproc.cache.lookup import CacheLookup, SemanticParaphrases
from extproc.cache.semantic import SemanticIndexes
from extproc.cache.sharing import PromptSharing
from extproc.cache.store import ResponseCache
from extproc.gateway import Gateway
from extproc.offload import BodyAnalyzer
from extproc.phases import Phase, ProtocolError, Stage, advance, check
from extproc.quota import MemoryStore, QuotaStore, StoreUnavailable
from extproc.routing.classifier import IntentClassifier
from extproc.sinks import Settlement
from extproc.state import RequestState
from extproc.steps import PASS_THROUGH, Admit, Analyze, Answer, Classify, Continue, Lookup, Reply, Step, Warm
from extproc.wire import headers_to_dict, to_response

log = logging.getLogger("llmgw.extproc")
_INTERNAL_ERROR = ApiError(500, "The gateway failed to process the request; it was not forwarded.",
                           type="server_error", code="internal_error")
_DONE = (Stage.FORWARDED, Stage.ANSWERED)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """The servicer: one ``Process`` stream per HTTP request, until the request is decided."""

    def __init__(self, gateway: Gateway, store: QuotaStore | None = None, settlement: Settlement | None = None,
                 analyzer: BodyAnalyzer | None = None, classifier: IntentClassifier | None = None,
                 cache: ResponseCache | None = None, semantic: SemanticIndexes | None = None) -> None:
        self.gateway = gateway
        self.semantic = semantic or SemanticIndexes()
        # The prompts of stored answers, shared by every process; ``follow()`` it to receive them.
        self.sharing = PromptSharing(self.semantic, cache) if cache is not None else None
        self.cache = CacheLookup(cache, SemanticParaphrases(cache, self.semantic, self.sharing)) \
            if cache is not None and self.sharing is not None else None
        self.store = store or MemoryStore()
        self.settlement = settlement or Settlement(gateway.feedback, lambda: gateway.config, self.store)
        self.analyzer = analyzer or BodyAnalyzer()
        self.classifier = classifier or IntentClassifier()
        # The effects the gateway may ask for, each run by one coroutine.
        self._effects: dict[type, Callable[[Any], Awaitable[object]]] = {
            Analyze: self.analyzer.analyze, Admit: self._admit, Classify: self._classify,
            Lookup: self._lookup, Warm: self._warm}

    async def Process(  # noqa: N802 (the gRPC method name)
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        """Answer each message of the stream; close it once the request is decided."""
        state: RequestState | None = None
        stage = Stage.START
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind is None:
                    raise ProtocolError("a ProcessingRequest without a request message")
                phase = Phase(kind)
                if state is None:
                    state = self.gateway.new_request()
                check(stage, phase)
                decision, end_of_stream = await self._decide(state, phase, message)
                stage = advance(stage, phase, answered=isinstance(decision, Reply), end_of_stream=end_of_stream)
                if isinstance(decision, Reply) and (answered := self.gateway.answered(state)) is not None:
                    self.settlement.answered(*answered)
                yield to_response(phase, decision)
                if stage in _DONE:
                    return  # processing complete: Envoy sends nothing more on this stream
        except ProtocolError as error:
            log.error("ext_proc protocol error: %s (request_id=%s)", error, state.request_id if state else "-")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

    async def _decide(self, state: RequestState, phase: Phase, message: pb.ProcessingRequest
                      ) -> tuple[Answer, bool]:
        """The gateway's answer to one message, after running the effects it asks for. A bug fails
        this request closed with a 500 (never the server), and gives back whatever admission took."""
        try:
            step, end_of_stream = self._phase(state, phase, message)
            while not isinstance(step, (Continue, Reply)):
                step = self.gateway.resume(state, step, await self._effects[type(step)](step))
            return step, end_of_stream
        except Exception:  # logged with its traceback; the request fails closed
            log.exception("failed to process %s (request_id=%s)", phase.value, state.request_id)
            lease = self.gateway.settle(state)
            if lease is not None:
                self.settlement.release(lease)
            return self.gateway.internal_error(state, _INTERNAL_ERROR), True

    async def _classify(self, effect: Classify) -> object:
        return await self.classifier.classify(effect.text)

    async def _lookup(self, effect: Lookup) -> object:
        return await self.cache.lookup(effect) if self.cache is not None else None

    async def _warm(self, effect: Warm) -> object:
        return await self.cache.warm(effect) if self.cache is not None else None

    async def _admit(self, effect: Admit) -> object:
        try:
            return await self.store.admit(effect.admission, effect.quota)
        except StoreUnavailable as error:
            return error

    def _phase(self, state: RequestState, phase: Phase, message: pb.ProcessingRequest) -> tuple[Step, bool]:
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
