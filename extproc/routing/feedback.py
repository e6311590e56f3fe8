"""What routing learns from a finished request, through one object: settlement tells it each
request's record; the router registers its picks with it. Nothing outside ``routing/`` reaches
into the picker, the pods' health, the breakers or the predictor: they hear it here.

- **Picks**: a pick is released when its request's access-log entry reaches this process, or
  forgotten after ``forget_after_s`` (its entry went to another worker, or nowhere).
- **Pod outcomes**: a pod Envoy had to retry past is backed off; a pod that asked for a pause
  (429/503 with Retry-After) gets one; a pod that answered is healthy again.
- **Breakers**: the pod extproc picked failed if Envoy had to retry; the pod that answered by the
  final outcome; the pool by the final outcome, or failed when a fallback model's pod answered.
- **The predictor** of output lengths (what reservations hold) learns from reported usage.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from extproc.accounting import Decision, RequestRecord
from extproc.predict import OutputLengthPredictor
from extproc.routing.breaker import Breakers
from extproc.routing.health import EndpointHealth
from extproc.routing.picker import EndpointPicker

log = logging.getLogger("llmgw.settlement")
BreakerChange = tuple[str, str, str]  # (scope: pod or pool, its name, the breaker's new state)


class RoutingFeedback:
    """The routing state settlement updates, and the router's picks still in flight."""

    def __init__(self, picker: EndpointPicker, health: EndpointHealth, breakers: Breakers,
                 predictor: OutputLengthPredictor, forget_after_s: float = 120.0) -> None:
        self._picker = picker
        self._health = health
        self._breakers = breakers
        self._predictor = predictor
        self.forget_after_s = forget_after_s
        # id -> (decision, deadline): what this process routed and has not seen end yet
        self._picked: OrderedDict[str, tuple[Decision, float]] = OrderedDict()

    def picked(self, decision: Decision) -> None:
        """The router sent a request to ``decision.endpoint``: remember the pick until it ends."""
        self._picked[decision.id] = (decision, time.monotonic() + self.forget_after_s)

    def finished(self, record: RequestRecord, retry_after_s: float | None, served_elsewhere: bool
                 ) -> list[BreakerChange]:
        """A routed request ended: release its pick, note how its pod did, feed the breakers and
        the predictor. Returns the breakers that changed state (``served_elsewhere``: a fallback
        model's pod answered for the pool)."""
        decision = record.decision
        self.ended(decision.id)
        if decision.endpoint and record.attempts > 1:
            # Envoy needed a second attempt: the pod extproc picked failed this request.
            backoff = self._health.attempt_failed(decision.endpoint)
            log.warning("pod %s failed an attempt (retried elsewhere): no traffic for %.0f s", decision.endpoint,
                        backoff)
        elif decision.endpoint and record.upstream == decision.endpoint:
            if record.status in (429, 503) and retry_after_s is not None:
                # The pod asked for a pause: it gets no traffic from this process for that long.
                self._health.pause(decision.endpoint, retry_after_s)
            else:
                self._health.attempt_succeeded(decision.endpoint)
        changes = self._feed_breakers(record, served_elsewhere)
        self.learn(record)
        return changes

    def paused(self, endpoint: str, seconds: float) -> None:
        """A pod refused an attempt with ``retry-after``: no traffic from this process for that long."""
        self._health.pause(endpoint, seconds)
        log.warning("pod %s asked for a pause: no traffic for %.0f s", endpoint, seconds)

    def _feed_breakers(self, record: RequestRecord, served_elsewhere: bool) -> list[BreakerChange]:
        breakers, decision = self._breakers, record.decision
        failed = record.pod_failed
        if not breakers.enabled or failed is None or not decision.endpoint:
            return []
        now = time.monotonic()
        if record.attempts <= 1:
            return breakers.record(decision.pool, decision.endpoint, failed, now)
        changes = breakers.record("", decision.endpoint, True, now)
        if record.upstream and record.upstream != decision.endpoint:
            changes += breakers.record("", record.upstream, failed, now)
        return changes + breakers.record(decision.pool, "", failed or served_elsewhere, now)

    def learn(self, record: RequestRecord) -> None:
        """A finished request's reported output length teaches the predictor (reservations)."""
        decision = record.decision
        if record.usage is not None and decision.tenant and not record.usage_estimated:
            self._predictor.observe((decision.tenant, decision.served_model), record.usage.output_tokens, decision.n)

    def ended(self, record_id: str) -> None:
        """The request ``record_id`` ended: its pick is released."""
        picked = self._picked.pop(record_id, None)
        if picked is not None:
            self._picker.release(picked[0].endpoint)

    def running(self, record_id: str) -> None:
        """A periodic entry says the request still runs: keep its pick."""
        picked = self._picked.get(record_id)
        if picked is not None:
            self._picked[record_id] = (picked[0], time.monotonic() + self.forget_after_s)
            self._picked.move_to_end(record_id)

    def forget_stale(self, now: float | None = None) -> list[Decision]:
        """Release the picks whose entries never came here, and return their decisions: their
        requests were settled by another worker, or never (the access-log stream was down)."""
        now = time.monotonic() if now is None else now
        stale = [decision for decision, deadline in self._picked.values() if deadline <= now]
        for decision in stale:
            self.ended(decision.id)
        return stale

    @property
    def picks(self) -> int:
        """Picks whose requests have not ended yet, as far as this process knows."""
        return len(self._picked)
