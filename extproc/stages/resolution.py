"""Resolution: which model and pool serve the request. The served model (404 when there is none);
a pool whose circuit breaker is open hands the request down the model's fallback chain;
degradation gives way by QoS class when the pool is loaded; shedding refuses a class past its
queue depth; and the spare model Envoy's last attempt falls back to."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from extproc.api import ApiError
from extproc.body import with_served_model
from extproc.config import GatewayConfig, Model, Pool
from extproc.routing.picker import PodStates
from extproc.routing.router import Router
from extproc.stages.identity import model_not_found
from extproc.state import RequestState
from extproc.steps import RETRY_SOON, Reply


@dataclass(frozen=True, slots=True)
class Unavailable:
    """No pool can serve the request (its breaker and every fallback's are open): a stale cached
    answer may still do, else ``Resolution.no_pool`` answers 503."""

    pool: Pool


class Resolution:
    """The model and pool of a request whose body is analyzed."""

    def __init__(self, config: GatewayConfig, router: Router) -> None:
        self.config = config
        self.router = router

    def reload(self, config: GatewayConfig) -> None:
        """Use a new config snapshot from the next request on."""
        self.config = config

    def resolve(self, state: RequestState) -> Reply | Unavailable | None:
        """Set ``state.model``, ``state.pool`` and ``state.spare``; None: on to admission."""
        facts = state.facts
        assert facts is not None
        model = self.config.lookup(facts.served or facts.model)
        if model is None:
            state.new_body = None
            return state.reject(model_not_found(facts.model))
        state.model = model
        pool = state.pool = self.config.pools[facts.pool] if facts.pool else model.pool
        router = self.router
        if not router.pool_allows(pool, time.monotonic()):
            alternative = self._fallback(state, model)
            if alternative is None:
                return Unavailable(pool)
            model, pool = self._switch(state, alternative)
        degrade = pool.degrade
        if degrade.max_concurrent is not None and (load := pool_load(router.picker.states, pool)) is not None \
                and load >= degrade.of(state.qos, degrade.share) * degrade.max_concurrent:
            alternative = self._fallback(state, model) if degrade.of(state.qos, degrade.action) == "fallback" else None
            if alternative is None:
                state.new_body = None
                return state.reject(ApiError(
                    429, f"Pool {pool.name!r} is at {load:g} requests for {degrade.max_concurrent}; "
                         f"{state.qos or 'default'} requests give way first. Please try again in 1s.",
                    type="requests", code="pool_overloaded"), RETRY_SOON)
            model, pool = self._switch(state, alternative)
        state.spare = self._spare(model, pool)
        if pool.shed and (overloaded := shed(router.picker.states, pool, state.qos)) is not None:
            state.new_body = None
            return state.reject(overloaded, RETRY_SOON)
        return None

    def no_pool(self, state: RequestState, pool: Pool) -> Reply:
        """503: the pool's breaker is open and so is every fallback's."""
        state.new_body = None
        wait = max(1, math.ceil(self.router.pool_reopens_in(pool, time.monotonic())))
        return state.reject(ApiError(
            503, f"The pool serving this model is failing (its circuit breaker is open), and so is every "
                 f"fallback: try again in {wait} s.", type="server_error", code="pool_unavailable"),
            (("retry-after", str(wait)),))

    def _fallback(self, state: RequestState, model: Model) -> tuple[Model, Pool] | None:
        """The first model of ``model``'s fallback chain whose pool's breaker lets a request through."""
        now = time.monotonic()
        for name in model.fallback:
            alternative = self.config.models_by_name[name]
            if self.router.pool_allows(alternative.pool, now):
                state.fallback_from = model.name
                return alternative, alternative.pool
        return None

    def _switch(self, state: RequestState, alternative: tuple[Model, Pool]) -> tuple[Model, Pool]:
        """Serve the request with a fallback model: its pool, and the body rewritten for it."""
        model, pool = state.model, state.pool = alternative
        assert state.facts is not None
        state.facts = replace(state.facts, served=model.name, pool=pool.name)
        body = state.new_body or state.body
        assert body is not None
        state.new_body = with_served_model(body, model.name)
        return model, pool

    def _spare(self, model: Model, pool: Pool) -> tuple[Model, Pool] | None:
        """The model Envoy's last attempt falls back to if the picked pods refuse the request (429,
        503, no connection): the first of the chain in another pool whose breaker is not open."""
        now = time.monotonic()
        for name in model.fallback:
            alternative = self.config.models_by_name[name]
            if alternative.pool is not pool and self.router.pool_would_allow(alternative.pool, now):
                return alternative, alternative.pool
        return None


def pool_load(states: PodStates, pool: Pool) -> float | None:
    """Requests running and waiting on the pool's pods, as last scraped (None: none known)."""
    known = [s for s in (states.get(e) for e in pool.endpoints) if s is not None]
    return sum(s.running + s.waiting for s in known) if known else None


def shed(states: PodStates, pool: Pool, qos: str) -> ApiError | None:
    """QoS shedding: a 429 when the pool's pods have more requests waiting on average than class
    ``qos`` may queue behind (``pools[].shed``); None to go on. Pods whose state is unknown are
    left out of the average; with none known, nothing is shed."""
    depth = pool.shed_depth(qos)
    if depth is None:
        return None
    waiting = [s.waiting for s in (states.get(e) for e in pool.endpoints if e not in pool.draining) if s is not None]
    if not waiting:
        return None
    mean = sum(waiting) / len(waiting)
    if mean <= depth:
        return None
    return ApiError(429, f"Pool {pool.name!r} is overloaded ({mean:.1f} requests waiting per pod); "
                    f"{qos or 'default'} requests are shed past {depth:g}. Please try again in 1s.",
                    type="requests", code="pool_overloaded")
