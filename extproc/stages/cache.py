"""Cache: the response cache, for a deterministic request (temperature 0, or a seed). Its key
(``Lookup``, run by ``extproc.cache.lookup``): a hit is answered here, in the shape the client asked
for; a hot key that keeps missing is fetched once from a pod (``Warm``); a miss goes on to the
pods and its answer is stored. When no pool can serve the request, a stale copy will do."""

from __future__ import annotations

import hashlib
import time

from extproc.accounting import CACHE_HIT, CACHE_STALE, RequestRecord, Usage, cache_hit
from extproc.cache.answers import cache_key, render, usage_of
from extproc.cache.warm import WarmUp
from extproc.config import CacheSpec, GatewayConfig
from extproc.routing.router import Router
from extproc.state import RequestState
from extproc.steps import HotMiss, Lookup, Reply, SemanticHit, SemanticQuery, Warm

CACHE_HEADER = "x-llmgw-cache"  # hit (the gateway answered from its cache), miss (the pod's answer is stored)
MATCH_HEADER = "x-llmgw-cache-match"  # a paraphrase's hit: "semantic; score=0.953"


class Caching:
    """The response cache's part of a request."""

    def __init__(self, config: GatewayConfig, router: Router) -> None:
        self.config = config
        self.router = router

    def reload(self, config: GatewayConfig) -> None:
        """Use a new config snapshot from the next request on."""
        self.config = config

    def lookup(self, state: RequestState) -> Lookup | None:
        """Ask the cache for a cacheable request's answer; None (not cached): on to the route."""
        facts, model = state.facts, state.model
        assert facts is not None and model is not None
        spec, partition = self._keyed(state)
        if spec is None or state.cache_key is None or not state.cache_read:
            return None  # not cached, or the client asked for a fresh answer (stored, unless no-store)
        semantic = None
        if spec.semantic is not None and facts.context_digest is not None and facts.semantic_text:
            partition = hashlib.sha256(b"\0".join((facts.context_digest, model.name.encode(), model.version.encode(),
                                                    partition.encode()))).hexdigest()
            semantic = SemanticQuery(partition, facts.semantic_text, spec.semantic)
        return Lookup(state.cache_key, semantic=semantic)

    def stale(self, state: RequestState) -> Lookup | None:
        """No pool can serve the request: ask for a stale copy of its answer (None: not cached)."""
        spec, _ = self._keyed(state)
        if spec is None or state.cache_key is None or not state.cache_read:
            return None
        return Lookup(state.cache_key, stale=True)

    def looked_up(self, state: RequestState, effect: Lookup | Warm, stored: object) -> Reply | Warm | None:
        """The cache's answer: a hit is answered here; a hot key is warmed (``Warm``); None: a
        miss (or a cache that failed: ``stored`` is then the exception), on to the route (or, for
        a stale lookup, the 503)."""
        if isinstance(stored, HotMiss):
            warm_up = self._warm_up(state)
            if warm_up is not None:
                return Warm(effect.key, warm_up)
        state.end("cache")
        stale = isinstance(effect, Lookup) and effect.stale
        match: tuple[tuple[str, str], ...] = ()
        if isinstance(stored, SemanticHit):
            match = ((MATCH_HEADER, f"semantic; score={stored.score:.3f}"),)
            stored = stored.value
        if not isinstance(stored, bytes):
            if stale:
                state.cache_key = None
            return None
        facts = state.facts
        assert facts is not None
        state.cached, state.cache_stale, state.new_body = stored, stale, None
        body, content_type = render(stored, facts.model, facts.stream, include_usage=not facts.strip_usage)
        return Reply(200, body, (("content-type", content_type), (CACHE_HEADER, CACHE_STALE if stale else CACHE_HIT),
                                 *match, *state.identity_headers(), *state.rate_headers))

    def record(self, state: RequestState) -> tuple[RequestRecord, bool]:
        """The record of a request the cache answered, and whether its tokens are charged."""
        assert state.cached is not None and state.model is not None and state.facts is not None
        spec = self.config.cache_for(state.facts.rule, state.model)
        charged = spec is not None and spec.charge_tokens
        usage = Usage(*usage_of(state.cached))
        return cache_hit(state.decision(), usage, state.model.prices, time.time_ns(), charged), charged

    def _keyed(self, state: RequestState) -> tuple[CacheSpec | None, str]:
        """The cache of a deterministic request (None: not cached) and its partition ("" for a
        cache shared by all tenants); its key goes in ``state.cache_key``."""
        facts, model = state.facts, state.model
        assert facts is not None and model is not None
        spec = self.config.cache_for(facts.rule, model) if facts.answer_digest is not None else None
        if spec is None or facts.answer_digest is None or not state.cache_write:
            return None, ""  # not cached; or Cache-Control: no-store, which keeps nothing of it
        partition = state.tenant.name if spec.partition == "tenant" and state.tenant is not None else ""
        state.cache_key = cache_key(facts.answer_digest, model.name, model.version, partition)
        return spec, partition

    def _warm_up(self, state: RequestState) -> WarmUp | None:
        """How a hot key's answer is fetched from a pod of the request's pool (not counted as a pick)."""
        model, pool, facts = state.model, state.pool, state.facts
        body = state.new_body or state.body
        if model is None or pool is None or facts is None or body is None or not state.path:
            return None
        spec = self.config.cache_for(facts.rule, model)
        endpoint = self.router.any_pod(model, pool, facts.prefix)
        if spec is None or endpoint is None:
            return None
        return WarmUp(state.path, body, endpoint, pool.credential, spec.ttl_s, spec.stale_ttl_s)
