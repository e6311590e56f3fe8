"""The director: what the gateway decides for each phase of a request. Pure: no grpc, no I/O.

    request headers -> identity                      (extproc.stages.identity)
    request body    -> analysis -> [Analyze] -> [Classify]   (extproc.stages.analysis)
                    -> resolution                    (extproc.stages.resolution)
                    -> admission -> [Admit]          (extproc.stages.admission)
                    -> cache -> [Lookup] -> [Warm]   (extproc.stages.cache)
                    -> route                         (extproc.stages.route)

Each stage answers (a reply), asks for an effect in [brackets] (the shell runs it and hands the
result to ``resume``, which gives it to that effect's continuation), or goes on to the next stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from extproc.accounting import RequestRecord, rejection
from extproc.api import ApiError
from extproc.config import GatewayConfig
from extproc.keys import KeySnapshot
from extproc.predict import OutputLengthPredictor
from extproc.quota.limits import Lease
from extproc.routing.feedback import RoutingFeedback
from extproc.routing.health import EndpointHealth
from extproc.routing.picker import EndpointPicker
from extproc.routing.router import Router
from extproc.stages.admission import Admissions
from extproc.stages.analysis import BodyAnalysis
from extproc.stages.cache import Caching
from extproc.stages.identity import Identity, TraceSampler
from extproc.stages.resolution import Resolution, Unavailable
from extproc.stages.route import Route
from extproc.state import RequestState, new_state
from extproc.steps import Admit, Analyze, Answer, Classify, Effect, Lookup, Reply, Step, Warm
from extproc.telemetry.tracecontext import IdSource, random_hex


class Gateway:
    """Turns request phases into answers, against one immutable config snapshot."""

    def __init__(self, config: GatewayConfig, picker: EndpointPicker, new_id: IdSource = random_hex,
                 predictor: OutputLengthPredictor | None = None,
                 health: EndpointHealth | None = None, sampler: TraceSampler | None = None) -> None:
        self._new_id = new_id
        predictor = predictor or OutputLengthPredictor()
        self.router = Router(picker, health, predictor=predictor)
        self.identity = Identity(config, new_id, sampler)
        self.analysis = BodyAnalysis(config)
        self.resolution = Resolution(config, self.router)
        self.admissions = Admissions(predictor)
        self.caching = Caching(config, self.router)
        self.route = Route(self.router)
        # Each effect's continuation: what the stage that asked for it does with the result.
        self._continuations: dict[type, Callable[[RequestState, Any, Any], Step]] = {
            Analyze: self._analyzed, Classify: self._classified, Admit: self._admitted,
            Lookup: self._looked_up, Warm: self._looked_up}
        self.reload(config)

    @property
    def feedback(self) -> RoutingFeedback:
        """What settlement tells routing about each finished request."""
        return self.router.feedback

    def reload(self, config: GatewayConfig) -> None:
        """Swap in a new config snapshot; requests in flight keep what they already decided."""
        self.router.configure(config)
        for stage in (self.identity, self.analysis, self.resolution, self.caching):
            stage.reload(config)
        self.config = config

    def set_redis_keys(self, snapshot: KeySnapshot) -> None:
        """Swap in a new snapshot of the keys stored in Redis (the key table's watcher calls this)."""
        self.identity.redis_keys = snapshot

    def new_request(self) -> RequestState:
        """State for a new ext_proc stream."""
        return new_state(self._new_id(8))

    # -- phases -----------------------------------------------------------------------------

    def request_headers(self, state: RequestState, headers: Mapping[str, str], end_of_stream: bool) -> Answer:
        """Identity: who asks, for what (see ``extproc.stages.identity``)."""
        return self.identity.request_headers(state, headers, end_of_stream)

    def request_body(self, state: RequestState, body: bytes) -> Step:
        """The body, then every stage after it until one answers or asks for an effect."""
        return self.analysis.request_body(state, body) or self._resolved(state)

    def request_trailers(self, state: RequestState) -> Answer:
        """Trailers: after the body they pass; with no body before them the request is empty."""
        return self.analysis.request_trailers(state)

    def resume(self, state: RequestState, effect: Effect, result: object) -> Step:
        """The shell ran ``effect``: its continuation goes on with ``result`` (or the exception it raised)."""
        return self._continuations[type(effect)](state, effect, result)

    # -- continuations ----------------------------------------------------------------------

    def _analyzed(self, state: RequestState, effect: Analyze, result: Any) -> Step:
        return self.analysis.analyzed(state, result) or self._resolved(state)

    def _classified(self, state: RequestState, effect: Classify, result: Any) -> Step:
        self.analysis.classified(state, result)
        return self._resolved(state)

    def _resolved(self, state: RequestState) -> Step:
        resolved = self.resolution.resolve(state)
        if isinstance(resolved, Unavailable):  # no pool can serve it: a stale answer, else 503
            return self.caching.stale(state) or self.resolution.no_pool(state, resolved.pool)
        return resolved or self.admissions.admit(state) or self._admitted_on(state)

    def _admitted(self, state: RequestState, effect: Admit, result: Any) -> Step:
        return self.admissions.admitted(state, result) or self._admitted_on(state)

    def _admitted_on(self, state: RequestState) -> Step:
        return self.caching.lookup(state) or self.route.route(state)

    def _looked_up(self, state: RequestState, effect: Lookup | Warm, result: Any) -> Step:
        answered = self.caching.looked_up(state, effect, result)
        if answered is not None:
            return answered
        if isinstance(effect, Lookup) and effect.stale:
            assert state.pool is not None
            return self.resolution.no_pool(state, state.pool)
        return self.route.route(state)

    # -- endings ----------------------------------------------------------------------------

    def settle(self, state: RequestState) -> Lease | None:
        """Claim the lease of a request that fails inside the gateway (it never reached a pod), once."""
        if state.lease is None or state.settled:
            return None
        state.settled = True
        return state.lease

    def answered(self, state: RequestState) -> tuple[RequestRecord, bool] | None:
        """The record of a request the gateway answered itself (a refusal, a cache hit), and whether
        its tokens are charged; None for a reply with no record (``/v1/models``)."""
        if state.rejected is not None:
            return rejection(state.decision(), state.rejected.status, state.rejected.code, time.time_ns()), False
        if state.cached is not None:
            return self.caching.record(state)
        return None

    def internal_error(self, state: RequestState, error: ApiError) -> Reply:
        """A bug failed this request closed (a 500); the shell gives back the lease ``settle`` claims."""
        return state.reject(error)
