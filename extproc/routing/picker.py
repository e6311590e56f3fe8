"""Endpoint picking within a pool: least in-flight requests, random among ties."""

from __future__ import annotations

import random
from collections import Counter
from typing import Protocol


class EndpointPicker(Protocol):
    """Chooses an endpoint of a pool for a request and learns when that request ends."""

    def pick(self, endpoints: tuple[str, ...]) -> str:
        """Choose one of ``endpoints`` (never empty) and count a request in flight to it."""
        ...

    def release(self, endpoint: str) -> None:
        """A request picked earlier has ended (completed, failed or cancelled)."""
        ...

    def fallback(self, endpoints: tuple[str, ...], chosen: str) -> str | None:
        """Another endpoint for Envoy's one retry if ``chosen`` fails (None with no other)."""
        ...


class LeastInFlight:
    """Pick the endpoint with the fewest requests this process has in flight to it.

    Ties are broken at random so that several extproc processes, each seeing only its own
    requests, do not all pile onto the first endpoint of the list.
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        self._in_flight: Counter[str] = Counter()
        self._rng = rng or random.Random()

    def pick(self, endpoints: tuple[str, ...]) -> str:
        """Choose the least-loaded endpoint and count the request against it."""
        fewest = min(self._in_flight[e] for e in endpoints)
        candidates = [e for e in endpoints if self._in_flight[e] == fewest]
        chosen = candidates[0] if len(candidates) == 1 else self._rng.choice(candidates)
        self._in_flight[chosen] += 1
        return chosen

    def fallback(self, endpoints: tuple[str, ...], chosen: str) -> str | None:
        """The least-loaded other endpoint (random among ties); not counted: it is used only on a retry."""
        others = [e for e in endpoints if e != chosen]
        if not others:
            return None
        fewest = min(self._in_flight[e] for e in others)
        candidates = [e for e in others if self._in_flight[e] == fewest]
        return candidates[0] if len(candidates) == 1 else self._rng.choice(candidates)

    def release(self, endpoint: str) -> None:
        """Count one request to ``endpoint`` as ended."""
        left = self._in_flight[endpoint] - 1
        if left > 0:
            self._in_flight[endpoint] = left
        else:
            del self._in_flight[endpoint]

    def in_flight(self, endpoint: str) -> int:
        """Requests this process currently has in flight to ``endpoint``."""
        return self._in_flight[endpoint]
