"""The router: which pods of a pool may serve a request, and which one the picker chooses.

Pods are left out while their health says so (a failed attempt, a pause a pod asked for, a failed
probe) or their circuit breaker is open (unless every pod's is). The picker's count of requests in
flight is this process's; what ends a pick comes back through ``RoutingFeedback``, the one object
settlement tells what happened to a routed request.
"""

from __future__ import annotations

import time

from extproc.config import GatewayConfig, Model, Pool
from extproc.predict import OutputLengthPredictor
from extproc.routing.breaker import Breakers, BreakerSettings
from extproc.routing.feedback import RoutingFeedback
from extproc.routing.health import EndpointHealth
from extproc.routing.picker import EndpointPicker, PickRequest


class Router:
    """Picks endpoints (skipping unhealthy ones and those whose breaker is open)."""

    def __init__(self, picker: EndpointPicker, health: EndpointHealth | None = None,
                 breakers: Breakers | None = None, predictor: OutputLengthPredictor | None = None) -> None:
        self.picker = picker
        self.health = health or EndpointHealth()
        self.breakers = breakers or Breakers()
        self.coordinator: str | None = None  # host:port of the batching coordinator, if there is one
        self.feedback = RoutingFeedback(picker, self.health, self.breakers, predictor or OutputLengthPredictor())

    def configure(self, config: GatewayConfig) -> None:
        """Take a new config's routing settings (a breaker whose settings changed starts afresh)."""
        self.feedback.forget_after_s = config.quota.lease_ttl_s * 2
        self.coordinator = config.server.coordinator
        spec = config.breakers
        settings = BreakerSettings(spec.window_s, spec.failure_ratio, spec.min_requests, spec.open_s, spec.probes)
        if settings != self.breakers.settings:
            self.breakers.reset(settings)
        self.breakers.enabled = spec.enabled

    def pick(self, model: Model, pool: Pool, prefix: tuple[int, ...]) -> tuple[str, str | None]:
        """The pod for a request and the one Envoy's one retry goes to (None: no other pod)."""
        usable = self.health.usable(pool.endpoints)
        breakers, now = self.breakers, time.monotonic()
        if breakers.enabled:  # pods whose breaker is open are left out (unless all are)
            usable = tuple(e for e in usable if breakers.pod(e).would_allow(now)) or usable
        request = PickRequest(model.name, prefix, pool.picker, pool.draining, model.lora)
        endpoint, fallback = self.picker.choose(usable, request)
        if breakers.enabled:
            breakers.pod(endpoint).allows(now)  # a half-open pod's probe is this request
        return endpoint, fallback

    def any_pod(self, model: Model, pool: Pool, prefix: tuple[int, ...]) -> str | None:
        """A usable pod of ``pool`` for ``model``, not counted as a pick (a fallback model's spare
        attempt, a hot key's warm-up); None when the pool has none."""
        request = PickRequest(model.name, prefix, pool.picker, pool.draining, model.lora)
        return self.picker.fallback(self.health.usable(pool.endpoints), "", request)

    def coordinator_usable(self) -> bool:
        """A batching coordinator is configured and answers its probes."""
        return self.coordinator is not None and self.health.is_usable(self.coordinator)

    def pool_allows(self, pool: Pool, now: float) -> bool:
        """The pool's breaker lets a request through (counting it as a half-open probe)."""
        return not self.breakers.enabled or self.breakers.pool(pool.name).allows(now)

    def pool_would_allow(self, pool: Pool, now: float) -> bool:
        """The pool's breaker would let a request through (nothing counted)."""
        return not self.breakers.enabled or self.breakers.pool(pool.name).would_allow(now)

    def pool_reopens_in(self, pool: Pool, now: float) -> float:
        """Seconds until the pool's open breaker lets a probe through."""
        breaker = self.breakers.pool(pool.name)
        return breaker.opened_at + breaker.settings.open_s - now
