"""Which endpoints may get traffic: what active probes and failed attempts say. Pure: no I/O.

Two signals, kept apart:
- **probes** (``probed``): an endpoint whose last ``GET /health`` failed is out until one succeeds;
- **failed attempts** (``attempt_failed``): Envoy retried a request elsewhere (the pod refused the
  connection, reset, or stayed silent past the first-byte timeout), so the pod is out for a
  backoff that doubles on each repeat (2 s up to 60 s) whatever its probes say: a hung pod often
  still answers ``/health``. A success through it clears the backoff.

``usable`` never returns nothing: when every endpoint looks bad, all are tried (a probe can be
wrong; Envoy then answers an OpenAI 503 if the pods really are gone).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

BACKOFF_S = 2.0
MAX_BACKOFF_S = 60.0


@dataclass(slots=True)
class _Ejection:
    until: float
    backoff: float


class EndpointHealth:
    """Health of endpoints as one process sees it; read on every request, updated by the shell."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._probe_down: set[str] = set()
        self._ejected: dict[str, _Ejection] = {}

    def probed(self, endpoint: str, healthy: bool) -> bool:
        """Record a probe's result; True when it changed the endpoint's probe state."""
        if healthy:
            if endpoint in self._probe_down:
                self._probe_down.discard(endpoint)
                return True
            return False
        if endpoint in self._probe_down:
            return False
        self._probe_down.add(endpoint)
        return True

    def attempt_failed(self, endpoint: str) -> float:
        """An attempt on ``endpoint`` failed and was retried elsewhere: eject it; the backoff in seconds."""
        now = self._clock()
        previous = self._ejected.get(endpoint)
        backoff = BACKOFF_S if previous is None else min(previous.backoff * 2, MAX_BACKOFF_S)
        # A pause the pod asked for (its refused attempt logged first) is not cut short.
        self._ejected[endpoint] = _Ejection(max(now + backoff, previous.until if previous else 0.0), backoff)
        return backoff

    def pause(self, endpoint: str, seconds: float) -> None:
        """The pod answered 429/503 with ``retry-after``: out for that long (its backoff unchanged)."""
        now = self._clock()
        previous = self._ejected.get(endpoint)
        backoff = previous.backoff if previous is not None else BACKOFF_S / 2
        self._ejected[endpoint] = _Ejection(max(now + seconds, previous.until if previous else 0.0), backoff)

    def attempt_succeeded(self, endpoint: str) -> None:
        """A request went through ``endpoint`` at the first attempt: forget its failures."""
        if self._ejected:
            self._ejected.pop(endpoint, None)

    def is_usable(self, endpoint: str, now: float | None = None) -> bool:
        """Neither probed down nor ejected right now."""
        if endpoint in self._probe_down:
            return False
        ejection = self._ejected.get(endpoint)
        return ejection is None or ejection.until <= (self._clock() if now is None else now)

    def usable(self, endpoints: tuple[str, ...]) -> tuple[str, ...]:
        """The endpoints that may get traffic now; all of them when none may."""
        if not self._probe_down and not self._ejected:
            return endpoints
        now = self._clock()
        good = tuple(e for e in endpoints if self.is_usable(e, now))
        return good or endpoints
