"""How long a batch may wait to fill, per queue, adapted to its traffic. Pure: the clock is passed in.

The configured ``wait_ms`` of a request's class is the starting point. Then:

- after two departures in a row that left full (``size`` or ``tokens`` reached before the window
  closed: more traffic than the window holds), the window grows by 1.2x, up to twice the
  configured wait; a departure that left because the pod had room shrinks it by 0.8x (the pods
  idle: waiting only adds latency), down to a tenth;
- EWMAs (alpha 0.2) of the arrival rate and of the pod's call latency cap the wait: never longer
  than the pod takes to answer a call (it would have room by then), nor than the time the
  expected arrivals need to fill the batch.

``reasons`` counts why batches left (``full``, ``window``, ``room``) for the metrics.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

ALPHA = 0.2
GROW, SHRINK = 1.2, 0.8
MAX_FACTOR, MIN_FACTOR = 2.0, 0.1
FULL, WINDOW, ROOM = "full", "window", "room"


@dataclass
class AdaptiveWindow:
    """The window of one queue (pod, model, sampling parameters)."""

    factor: float = 1.0
    arrival_rate: float | None = None  # requests per second, EWMA
    call_latency: float | None = None  # seconds per merged call, EWMA
    full_in_a_row: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    _last_arrival: float | None = None

    def arrived(self, now: float) -> None:
        """A request joined the queue."""
        if self._last_arrival is not None:
            gap = max(now - self._last_arrival, 1e-4)
            self.arrival_rate = _ewma(self.arrival_rate, 1.0 / gap)
        self._last_arrival = now

    def wait_s(self, configured_s: float, queued: int, size: int) -> float:
        """How long the oldest request may wait for this batch to fill."""
        wait = configured_s * self.factor
        if self.call_latency is not None:
            wait = min(wait, self.call_latency)
        if self.arrival_rate:
            wait = min(wait, max(size - queued, 0) / self.arrival_rate)
        return max(wait, 0.0)

    def departed(self, reason: str) -> None:
        """A batch left, for ``reason``."""
        self.reasons[reason] += 1
        if reason == FULL:
            self.full_in_a_row += 1
            if self.full_in_a_row >= 2:
                self.factor = min(self.factor * GROW, MAX_FACTOR)
        else:
            self.full_in_a_row = 0
            if reason == ROOM:
                self.factor = max(self.factor * SHRINK, MIN_FACTOR)

    def answered(self, seconds: float) -> None:
        """A merged call to the pod took ``seconds`` (to its end)."""
        self.call_latency = _ewma(self.call_latency, seconds)


def _ewma(previous: float | None, value: float) -> float:
    return value if previous is None else ALPHA * value + (1 - ALPHA) * previous
