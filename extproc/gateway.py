"""The director: what the gateway decides for each phase of a request. Pure: no grpc, no I/O.

request headers -> identity (request id, traceparent), header limits, path and method
                   (``validation``), the key's tenant (``auth``) and QoS class (``qos``), body
                   headers, internal headers stripped
request body    -> the body's facts (``body``: bounded parse, validation, token estimate), the
                   model, the reservation and admission (``quota``), the pod (``routing``)

Work that needs I/O is asked for as an effect (``Analyze`` a large body off the loop, ``Admit``
against the quota store); the shell runs it and hands the result to ``resume``.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import orjson

from extproc import validation
from extproc.accounting import CACHE_HIT, CACHE_STALE, RequestRecord, Usage, cache_hit, micro_dollars, rejection
from extproc.api import OPERATIONS_BY_PATH, ApiError
from extproc.auth import CHALLENGE, UNAUTHORIZED, authenticate
from extproc.body import NO_RULES, BodyFacts, BodyLimits, Routing, analyze, with_model, with_served_model
from extproc.cache.answers import cache_key, render, usage_of
from extproc.cache.warm import WarmUp
from extproc.catalog import model_card, models_list
from extproc.config import CacheSpec, GatewayConfig, Model, Pool
from extproc.decisions import (
    Admit,
    Analyze,
    Classify,
    Continue,
    Decision,
    Effect,
    Headers,
    Lookup,
    Reply,
    SemanticHit,
    Step,
)
from extproc.keys import KeySnapshot
from extproc.predict import OutputLengthPredictor
from extproc.qos import QOS_HEADER, choose_qos
from extproc.quota.limits import UNLIMITED, Admission, Lease
from extproc.quota.limits import Decision as QuotaVerdict
from extproc.quota.replies import UNAVAILABLE, refusal
from extproc.quota.store import StoreUnavailable
from extproc.routing.breaker import Breakers, BreakerSettings
from extproc.routing.decision import CACHE_HEADER, Router, decision_of
from extproc.routing.health import EndpointHealth
from extproc.routing.picker import EndpointPicker, PickRequest
from extproc.state import RequestState, new_state
from extproc.telemetry.tracecontext import IdSource, continue_or_start, random_hex, request_id
from extproc.tokens import BpeEstimator, TokenEstimator

MODELS_PATH = "/v1/models"


class TraceSampler(Protocol):
    """Whether a request's span is exported, and the trace flags the pod gets
    (``extproc.telemetry.tracing.Sampler``)."""

    def sampled(self, trace_id_hex: str, parent_flags: str | None) -> bool:
        """Export this trace's span? (the client's flags when it sent a traceparent, else None)"""
        ...

    def flags(self, trace_id_hex: str, parent_flags: str | None) -> str:
        """The trace-flags for the pod's traceparent."""
        ...


class Gateway:
    """Turns request phases into decisions, against one immutable config snapshot."""

    def __init__(self, config: GatewayConfig, picker: EndpointPicker, new_id: IdSource = random_hex,
                 predictor: OutputLengthPredictor | None = None,
                 health: EndpointHealth | None = None, sampler: TraceSampler | None = None) -> None:
        self.breakers = Breakers()
        self.router = Router(picker, health or EndpointHealth(), breakers=self.breakers)
        self.health = self.router.health
        self._new_id = new_id
        self._sampler = sampler  # None: tracing off, no span exported
        self.predictor = predictor or OutputLengthPredictor()
        # Keys added with `llmgw keys add`: a snapshot of Redis's table, swapped whole by its watcher.
        self.redis_keys = KeySnapshot.empty()
        self.reload(config)

    def reload(self, config: GatewayConfig) -> None:
        """Swap in a new config snapshot; requests in flight keep what they already decided.

        Tokenizers are loaded here (once per file, kept across reloads), never on a request.
        """
        loaded: dict[Path, TokenEstimator] = getattr(self, "_loaded", {})
        self._loaded: dict[Path, TokenEstimator] = {
            m.tokenizer: loaded.get(m.tokenizer) or BpeEstimator.from_spec(str(m.tokenizer))
            for m in config.models if m.tokenizer is not None}
        self._counters = {m.name: self._loaded[m.tokenizer] for m in config.models if m.tokenizer is not None}
        self._tokenizers = {m.name: str(m.tokenizer) for m in config.models if m.tokenizer is not None}
        self._models_body = models_list(config)
        self._served_names = {name: model.name for name, model in config.models_by_name.items()}
        self._limits = BodyLimits(**config.server.limits.model_dump())
        self.router.forget_after_s = config.quota.lease_ttl_s * 2
        self.router.coordinator = config.server.coordinator
        spec = config.breakers
        settings = BreakerSettings(spec.window_s, spec.failure_ratio, spec.min_requests, spec.open_s, spec.probes)
        if settings != self.breakers.settings:  # new settings: breakers start afresh
            self.breakers.reset(settings)
        self.router.breakers = self.breakers if spec.enabled else None
        self._prefix_blocks = config.prefix_blocks
        intents = config.intents
        self._intents = (intents.model_name, *intents.default, intents.max_chars) if intents is not None else None
        self.config = config

    def set_redis_keys(self, snapshot: KeySnapshot) -> None:
        """Swap in a new snapshot of the keys stored in Redis (the key table's watcher calls this)."""
        self.redis_keys = snapshot

    def new_request(self) -> RequestState:
        """State for a new ext_proc stream."""
        return new_state(self._new_id(8))

    # -- phases -----------------------------------------------------------------------------

    def request_headers(self, state: RequestState, headers: Mapping[str, str], end_of_stream: bool) -> Decision:
        """Check path, method, content type and size; set identity; strip internal headers."""
        state.request_id = request_id(headers.get("x-request-id"), self._new_id)
        trace = continue_or_start(headers.get("traceparent"), self._new_id)
        if self._sampler is not None:
            # A continued trace keeps the client's decision; a new one is sampled by its trace id.
            parent_flags = trace.flags if trace.parent_span_id else None
            state.sampled = self._sampler.sampled(trace.trace_id, parent_flags)
            trace = replace(trace, flags=self._sampler.flags(trace.trace_id, parent_flags))
        state.trace = trace
        method = headers.get(":method", "")
        path = state.path = headers.get(":path", "").partition("?")[0]
        if (too_many := validation.header_limits(headers, self.config.server)) is not None:
            return self._reject(state, too_many)
        if path == MODELS_PATH or path.startswith(MODELS_PATH + "/"):
            if method != "GET":
                return self._reject(state, *validation.method_not_allowed(method, path, "GET"))
            if self.config.auth_required and not self._authenticate(state, headers):
                return self._reject(state, UNAUTHORIZED, CHALLENGE)
            return self._models(state, path)
        operation = OPERATIONS_BY_PATH.get(path)
        if operation is None:
            return self._reject(state, validation.unknown_url(method, path))
        if method != "POST":
            return self._reject(state, *validation.method_not_allowed(method, path, "POST"))
        state.operation = operation
        if self.config.auth_required and not self._authenticate(state, headers):
            return self._reject(state, UNAUTHORIZED, CHALLENGE)
        if state.tenant is not None:
            qos = choose_qos(state.tenant, headers.get(QOS_HEADER))
            if isinstance(qos, ApiError):
                return self._reject(state, qos)
            state.qos = qos
        if (bad := validation.body_headers(headers, self.config.max_body_bytes)) is not None:
            return self._reject(state, bad)
        if end_of_stream:
            return self._reject(state, validation.EMPTY_BODY)
        state.end("auth")
        # Envoy picked a route from the client's headers; re-pick it without the stripped ones, so
        # a request that never reaches the body phase cannot ride a forged x-llmgw-route.
        return Continue(set_headers=state.identity_headers(), remove_headers=validation.internal_headers(headers),
                        clear_route_cache=True)

    def request_body(self, state: RequestState, body: bytes) -> Step:
        """Analyze the body here, or (``Analyze``) have the shell analyze a large one off the event
        loop and hand the result back (``resume``)."""
        assert state.operation is not None, "the phase table lets a body in only after POST headers"
        state.begin()
        state.body = body
        if len(body) > self.config.max_body_bytes:
            return self._reject(state, validation.too_large(len(body), self.config.max_body_bytes))
        routing = Routing(self.config.rules, state.tenant.tags if state.tenant else (), state.qos,
                          self._prefix_blocks, self._intents) \
            if self.config.rules or self._prefix_blocks[0] or self._intents else NO_RULES
        if len(body) >= self.config.server.offload_body_bytes:
            return Analyze(state.operation, body, self._served_names, self._limits, self._tokenizers, routing)
        try:
            analyzed = analyze(state.operation, body, self._served_names, self._limits, self._counters, routing)
        except ApiError as error:
            return self._reject(state, error)
        return self._analyzed(state, analyzed)

    def request_trailers(self, state: RequestState) -> Decision:
        """Trailers: after the body they pass; with no body before them the request is empty."""
        if state.facts is None and state.rejected is None:
            return self._reject(state, validation.EMPTY_BODY)
        return Continue()

    def resume(self, state: RequestState, effect: Effect, result: object) -> Step:
        """The shell ran ``effect``: go on with its ``result`` (or the exception it raised)."""
        if isinstance(effect, Analyze):
            assert isinstance(result, (tuple, ApiError)), result
            return self._analyzed(state, result)
        if isinstance(effect, Classify):
            return self._classified(state, result)
        if isinstance(effect, Lookup):
            return self._looked_up(state, effect, result)
        if isinstance(result, StoreUnavailable):
            # The quota store is down and the config says fail closed.
            return self._reject(state, UNAVAILABLE, (("retry-after", "1"),))
        assert isinstance(result, QuotaVerdict), result
        return self._admitted(state, result)

    # -- body, admission, route -------------------------------------------------------------

    def _analyzed(self, state: RequestState, analyzed: tuple[BodyFacts, bytes | None] | ApiError) -> Step:
        """The body's facts (or why it is refused): resolve the model; then route the request, or
        first ask for admission (``Admit``) when the tenant has limits."""
        if isinstance(analyzed, ApiError):
            # 503: the body-analysis helper is too busy to answer within Envoy's message timeout
            return self._reject(state, analyzed, (("retry-after", "1"),) if analyzed.status == 503 else ())
        facts, state.new_body = analyzed
        state.facts = facts
        state.end("tokens")
        if facts.intent_text is not None:
            return Classify(facts.intent_text)
        return self._resolved(state, facts)

    def _classified(self, state: RequestState, match: object) -> Step:
        """Semantic routing's answer: the intent's model and pool, else the default route's (which
        ``analyze`` already set); the forwarded body gets the chosen model."""
        facts, body = state.facts, state.new_body
        assert facts is not None and body is not None
        intent = getattr(match, "intent", None)
        score = getattr(match, "score", None)
        if intent is not None:
            facts = replace(facts, served=intent.model, pool=intent.pool, intent=intent.name, score=score)
        else:
            facts = replace(facts, intent="default", score=score)
        state.facts = facts
        state.new_body = with_model(body, facts.served or facts.model)
        state.end("intent")
        return self._resolved(state, facts)

    def _resolved(self, state: RequestState, facts: BodyFacts) -> Step:
        """The served model is known: its pool, QoS shedding, then admission or the route."""
        model = self.config.lookup(facts.served or facts.model)
        if model is None:
            state.new_body = None
            return self._reject(state, ApiError(
                404, f"The model '{facts.model}' does not exist or you do not have access to it.",
                param="model", code="model_not_found"))
        state.model = model
        pool = state.pool = self.config.pools[facts.pool] if facts.pool else model.pool
        if self.config.breakers.enabled and not self.breakers.pool(pool.name).allows(time.monotonic()):
            alternative = self._fallback(state, model)
            if alternative is None:
                return self._unavailable(state, pool)
            facts, model, pool = self._switch(state, facts, alternative)
        degrade = pool.degrade
        if degrade.max_concurrent is not None and (load := self.router.load(pool)) is not None \
                and load >= degrade.of(state.qos, degrade.share) * degrade.max_concurrent:
            alternative = self._fallback(state, model) if degrade.of(state.qos, degrade.action) == "fallback" else None
            if alternative is None:
                state.new_body = None
                return self._reject(state, ApiError(
                    429, f"Pool {pool.name!r} is at {load:g} requests for {degrade.max_concurrent}; "
                         f"{state.qos or 'default'} requests give way first. Please try again in 1s.",
                    type="requests", code="pool_overloaded"), (("retry-after", "1"),))
            facts, model, pool = self._switch(state, facts, alternative)
        state.spare = self._spare(model, pool)
        if pool.shed and (overloaded := self.router.shed(pool, state.qos)) is not None:
            state.new_body = None
            return self._reject(state, overloaded, (("retry-after", "1"),))
        quota = state.tenant.quota(state.qos) if state.tenant is not None else None
        if quota is None:
            return self._cached_or_routed(state)
        assert state.tenant is not None
        input_tokens, output_tokens = self._reserve(state, facts)
        state.reserved_tokens = input_tokens + output_tokens
        state.reserved_cost = micro_dollars(model.prices.cost(input_tokens, output_tokens, 0))
        # The class is a scope of its own only where it has limits: counting it otherwise doubles the
        # store's writes for nothing (a limit added by a reload counts from then on).
        admission = Admission(tenant=state.tenant.name, lease_id=state.id,
                              qos=state.qos if quota.qos != UNLIMITED else "",
                              reserve_tokens=state.reserved_tokens, reserve_cost=state.reserved_cost)
        return Admit(admission, quota)

    def _fallback(self, state: RequestState, model: Model) -> tuple[Model, Pool] | None:
        """The first model of ``model``'s fallback chain whose pool's breaker lets a request through."""
        now = time.monotonic()
        for name in model.fallback:
            alternative = self.config.models_by_name[name]
            if self.breakers.pool(alternative.pool.name).allows(now):
                state.fallback_from = model.name
                return alternative, alternative.pool
        return None

    def _switch(self, state: RequestState, facts: BodyFacts, alternative: tuple[Model, Pool]
                ) -> tuple[BodyFacts, Model, Pool]:
        """Serve the request with a fallback model: its pool, and the body rewritten for it."""
        model, pool = state.model, state.pool = alternative
        facts = state.facts = replace(facts, served=model.name, pool=pool.name)
        body = state.new_body or state.body
        assert body is not None
        state.new_body = with_served_model(body, model.name)
        return facts, model, pool

    def _spare(self, model: Model, pool: Pool) -> tuple[Model, Pool] | None:
        """The model Envoy's last attempt falls back to if the picked pods refuse the request (429,
        503, no connection): the first of the chain in another pool whose breaker is not open."""
        now = time.monotonic()
        for name in model.fallback:
            alternative = self.config.models_by_name[name]
            if alternative.pool is not pool and (not self.config.breakers.enabled
                                                 or self.breakers.pool(alternative.pool.name).would_allow(now)):
                return alternative, alternative.pool
        return None

    def _unavailable(self, state: RequestState, pool: Pool) -> Step:
        """No pool can serve the request: a stale copy of its answer if the cache has one, else 503."""
        spec, _ = self._keyed(state)
        if spec is not None and state.cache_key is not None:
            return Lookup(state.cache_key, stale=True)
        return self._no_pool(state, pool)

    def _no_pool(self, state: RequestState, pool: Pool) -> Reply:
        state.new_body = None
        breaker = self.breakers.pool(pool.name)
        wait = max(1, math.ceil(breaker.opened_at + breaker.settings.open_s - time.monotonic()))
        return self._reject(state, ApiError(
            503, f"The pool serving this model is failing (its circuit breaker is open), and so is every "
                 f"fallback: try again in {wait} s.", type="server_error", code="pool_unavailable"),
            (("retry-after", str(wait)),))

    def _admitted(self, state: RequestState, verdict: QuotaVerdict) -> Step:
        """The quota store's verdict: route the request, or answer 429/402 naming the limit."""
        state.end("quota")
        if not verdict.admitted:
            state.new_body = None
            tenant = state.tenant.name if state.tenant is not None else "this key"
            return self._reject(state, refusal(tenant, verdict), verdict.headers())
        state.lease = verdict.lease
        state.rate_headers = verdict.headers()
        return self._cached_or_routed(state)

    def _cached_or_routed(self, state: RequestState) -> Step:
        """Admitted: a cacheable request is looked up first (``Lookup``); the others are routed."""
        facts, model = state.facts, state.model
        assert facts is not None and model is not None
        spec, partition = self._keyed(state)
        if spec is None or state.cache_key is None:
            return self.router.route(state, QOS_HEADER)
        semantic = None
        if spec.semantic is not None and facts.context_digest is not None and facts.semantic_text:
            partition = hashlib.sha256(b"\0".join((facts.context_digest, model.name.encode(), model.version.encode(),
                                                    partition.encode()))).hexdigest()
            semantic = (partition, facts.semantic_text, spec.semantic)
        return Lookup(state.cache_key, warm=lambda: self._warm_up(state, spec), semantic=semantic)

    def _keyed(self, state: RequestState) -> tuple[CacheSpec | None, str]:
        """The cache of a deterministic request (None: not cached) and its partition ("" for a
        cache shared by all tenants); its key goes in ``state.cache_key``."""
        facts, model = state.facts, state.model
        assert facts is not None and model is not None
        spec = self.config.cache_for(facts.rule, model) if facts.answer_digest is not None else None
        if spec is None or facts.answer_digest is None:
            return None, ""
        partition = state.tenant.name if spec.partition == "tenant" and state.tenant is not None else ""
        state.cache_key = cache_key(facts.answer_digest, model.name, model.version, partition)
        return spec, partition

    def _warm_up(self, state: RequestState, spec: CacheSpec) -> WarmUp | None:
        """How a hot key's answer is fetched from a pod of the request's pool (not counted as a pick)."""
        model, pool, facts = state.model, state.pool, state.facts
        body = state.new_body or state.body
        if model is None or pool is None or facts is None or body is None or state.path is None:
            return None
        request = PickRequest(model.name, facts.prefix, pool.picker, pool.draining, model.lora)
        endpoint = self.router.picker.fallback(self.health.usable(pool.endpoints), "", request)
        if endpoint is None:
            return None
        return WarmUp(state.path, body, endpoint, pool.credential, spec.ttl_s, spec.stale_ttl_s)

    def _looked_up(self, state: RequestState, effect: Lookup, stored: object) -> Decision:
        """The cache's answer: a hit is answered here, in the shape the client asked for; a miss
        (or a cache that failed: ``stored`` is then the exception) is routed, and its answer stored."""
        state.end("cache")
        stale = isinstance(effect, Lookup) and effect.stale
        match: tuple[tuple[str, str], ...] = ()
        if isinstance(stored, SemanticHit):
            match = (("x-llmgw-cache-match", f"semantic; score={stored.score:.3f}"),)
            stored = stored.value
        if not isinstance(stored, bytes):
            if stale:
                assert state.pool is not None
                state.cache_key = None
                return self._no_pool(state, state.pool)
            return self.router.route(state, QOS_HEADER)
        facts = state.facts
        assert facts is not None
        state.cached, state.cache_stale, state.new_body = stored, stale, None
        body, content_type = render(stored, facts.model, facts.stream, include_usage=not facts.strip_usage)
        return Reply(200, body, (("content-type", content_type), (CACHE_HEADER, CACHE_STALE if stale else CACHE_HIT),
                                 *match, *state.identity_headers(), *state.rate_headers))

    def cache_record(self, state: RequestState) -> tuple[RequestRecord, bool]:
        """The record of a request the cache answered, and whether its tokens are charged."""
        assert state.cached is not None and state.model is not None and state.facts is not None
        spec = self.config.cache_for(state.facts.rule, state.model)
        charged = spec is not None and spec.charge_tokens
        usage = Usage(*usage_of(state.cached))
        return cache_hit(decision_of(state), usage, state.model.prices, time.time_ns(), charged), charged

    def _reserve(self, state: RequestState, facts: BodyFacts) -> tuple[int, int]:
        """Tokens to hold: the input estimate and the predicted output (capped by max_tokens)."""
        if facts.embedding:
            return facts.input_tokens, 0
        key = (state.tenant.name if state.tenant else "", state.model.name if state.model else "")
        return facts.input_tokens, self.predictor.predict(key, facts.output_limit, facts.n)

    # -- endings ----------------------------------------------------------------------------

    def settle(self, state: RequestState) -> Lease | None:
        """Claim the lease of a request that fails inside the gateway (it never reached a pod), once."""
        if state.lease is None or state.settled:
            return None
        state.settled = True
        return state.lease

    def rejection_record(self, state: RequestState) -> RequestRecord:
        """The record of a request the gateway answered itself."""
        assert state.rejected is not None
        return rejection(decision_of(state), state.rejected.status, state.rejected.code, time.time_ns())

    def learn(self, record: RequestRecord) -> None:
        """A finished request's reported output length teaches the predictor (reservations)."""
        decision = record.decision
        if record.usage is not None and decision.tenant and not record.usage_estimated:
            self.predictor.observe((decision.tenant, decision.served_model), record.usage.output_tokens, decision.n)

    def internal_error(self, state: RequestState, error: ApiError) -> Reply:
        """A bug failed this request closed (a 500); the shell gives back the lease ``settle`` claims."""
        return self._reject(state, error)

    # -- helpers ----------------------------------------------------------------------------

    def _authenticate(self, state: RequestState, headers: Mapping[str, str]) -> bool:
        state.tenant = authenticate(self.config, self.redis_keys, headers)
        return state.tenant is not None

    def _reject(self, state: RequestState, error: ApiError, extra: Headers = ()) -> Reply:
        state.rejected = error
        return Reply.error(error, (*state.identity_headers(), *extra))

    def _models(self, state: RequestState, path: str) -> Reply:
        if path == MODELS_PATH:
            return Reply.json(200, self._models_body, state.identity_headers())
        name = path[len(MODELS_PATH) + 1:]
        model = self.config.lookup(name)
        if model is None:
            return self._reject(state, ApiError(
                404, f"The model '{name}' does not exist or you do not have access to it.",
                param="model", code="model_not_found"))
        return Reply.json(200, orjson.dumps(model_card(name, model)), state.identity_headers())
