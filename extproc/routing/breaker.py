"""Circuit breakers per pod and per pool, fed by the request records. Pure: the clock is passed in.

A breaker counts outcomes in a rolling window (``window_s``, one bucket a second). It opens when,
over at least ``min_requests``, the share of failures reaches ``failure_ratio`` (the reference
design: 0.6 over 60 s). Open, it lets nothing through for ``open_s``; then it is half-open and
lets ``probes`` requests through: if they all succeed it closes, if one fails it opens again.

A failure is what a pod or the path to it did wrong: a 5xx or a 429 from the pod, a reset, a
refused connection or a timeout. What the client did (went away, sent a bad request) is not
counted either way. Each worker process keeps its own breakers from the records it settles
(Envoy spreads access-log entries over the workers, so each sees a fair sample of the traffic).

Breakers sit above Envoy's own defences, which act per attempt: active health checks and
outlier detection eject a pod from Envoy's load balancing, and one retry goes to the fallback
pod. A pod's breaker takes it out of the picker's choices; a pool's breaker sends its models'
requests along their fallback chain (``models[].fallback``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # as the metrics export them


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """When a breaker opens and how it tries again."""

    window_s: int = 60
    failure_ratio: float = 0.6
    min_requests: int = 20
    open_s: float = 30.0
    probes: int = 3

    def __post_init__(self) -> None:
        if self.window_s < 1 or self.min_requests < 1 or self.probes < 1 or self.open_s <= 0:
            raise ValueError("window_s, min_requests and probes must be >= 1, open_s > 0")
        if not 0 < self.failure_ratio <= 1:
            raise ValueError("failure_ratio must be within (0, 1]")


@dataclass(slots=True)
class Breaker:
    """One breaker: closed, open (until ``reopen_at``), or half-open (counting its probes)."""

    settings: BreakerSettings
    state: str = CLOSED
    opened_at: float = 0.0
    _buckets: dict[int, list[int]] = field(default_factory=dict)  # second -> [requests, failures]
    _probes_out: int = 0
    _probes_ok: int = 0

    def allows(self, now: float) -> bool:
        """Whether a request may go now (a half-open breaker hands out its probes)."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            if now - self.opened_at < self.settings.open_s:
                return False
            self.state, self._probes_out, self._probes_ok = HALF_OPEN, 0, 0
        if self._probes_out < self.settings.probes:
            self._probes_out += 1
            return True
        return False

    def would_allow(self, now: float) -> bool:
        """``allows`` without taking a probe (for choosing among candidates)."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            return now - self.opened_at >= self.settings.open_s
        return self._probes_out < self.settings.probes

    def record(self, failed: bool, now: float) -> bool:
        """One outcome; True when it changed the state."""
        if self.state == HALF_OPEN:
            if failed:
                self._open(now)
                return True
            self._probes_ok += 1
            if self._probes_ok >= self.settings.probes:
                self.state = CLOSED
                self._buckets.clear()
                return True
            return False
        if self.state == OPEN:
            return False  # a request sent before it opened: already counted in its decision
        second = int(now)
        bucket = self._buckets.get(second)
        if bucket is None:
            bucket = self._buckets[second] = [0, 0]
            oldest = second - self.settings.window_s
            for old in [s for s in self._buckets if s <= oldest]:
                del self._buckets[old]
        bucket[0] += 1
        bucket[1] += failed
        requests = sum(b[0] for b in self._buckets.values())
        failures = sum(b[1] for b in self._buckets.values())
        if requests >= self.settings.min_requests and failures >= self.settings.failure_ratio * requests:
            self._open(now)
            return True
        return False

    def _open(self, now: float) -> None:
        self.state, self.opened_at = OPEN, now
        self._buckets.clear()


class Breakers:
    """The breakers of every pod and pool one process has seen, created on first use."""

    def __init__(self, settings: BreakerSettings | None = None) -> None:
        self.enabled = True  # off (``breakers.enabled: false``): nothing is recorded, everything allowed
        self.reset(settings or BreakerSettings())

    def reset(self, settings: BreakerSettings) -> None:
        """Forget every breaker; new ones use ``settings``."""
        self.settings = settings
        self.pods: dict[str, Breaker] = {}
        self.pools: dict[str, Breaker] = {}

    def pod(self, endpoint: str) -> Breaker:
        """The breaker of ``endpoint``."""
        breaker = self.pods.get(endpoint)
        if breaker is None:
            breaker = self.pods[endpoint] = Breaker(self.settings)
        return breaker

    def pool(self, name: str) -> Breaker:
        """The breaker of pool ``name``."""
        breaker = self.pools.get(name)
        if breaker is None:
            breaker = self.pools[name] = Breaker(self.settings)
        return breaker

    def record(self, pool: str, endpoint: str, failed: bool, now: float) -> list[tuple[str, str, str]]:
        """One request's outcome, for its pod and its pool: the (scope, name, new state) changes."""
        changes = []
        if endpoint and self.pod(endpoint).record(failed, now):
            changes.append(("pod", endpoint, self.pods[endpoint].state))
        if pool and self.pool(pool).record(failed, now):
            changes.append(("pool", pool, self.pools[pool].state))
        return changes
