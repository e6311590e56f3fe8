"""Failure injection for the simulated pod: errors, latency spikes, hangs and crashes.

Pure and seeded: ``FaultInjector.decide()`` draws the same three random numbers for every
request, so one ``--seed`` reproduces the same sequence of faults. Errors answer 500
(``InternalServerError``) or 503 (``ServiceUnavailableError``) with equal odds; a spike delays
the first token by a wall-clock ``spike_ms`` (not scaled by ``--time-scale``); a hang accepts
the request and never answers; ``crash_after`` exits the process after that many requests;
``die_after_tokens`` kills it in the middle of its answers once one of its sequences has generated
that many tokens (no random draw: an answer that long always dies there).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ERROR_TYPES = {500: "InternalServerError", 503: "ServiceUnavailableError"}


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """Fault probabilities per request (0..1) and the crash thresholds (0 = never)."""

    error_rate: float = 0.0
    spike_rate: float = 0.0
    spike_ms: float = 0.0
    hang_rate: float = 0.0
    crash_after: int = 0  # requests answered before the process exits
    die_after_tokens: int = 0  # tokens one sequence generates before the process dies mid-answer
    retry_after_s: float = 0.0  # injected 503s carry retry-after (whole seconds) when > 0
    error_status: int = 0  # injected errors' status: 500 or 503 (0: either, with equal odds)

    def __post_init__(self) -> None:
        for name in ("error_rate", "spike_rate", "hang_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: must be within 0..1, got {value}")
        if self.error_status not in (0, *ERROR_TYPES):
            raise ValueError(f"error_status: must be 0 or one of {sorted(ERROR_TYPES)}")
        if self.spike_ms < 0 or self.crash_after < 0 or self.die_after_tokens < 0:
            raise ValueError("spike_ms, crash_after and die_after_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class FaultDecision:
    """What happens to one request: an error status, a hang, or an extra delay (or nothing)."""

    error_status: int | None = None
    hang: bool = False
    spike_s: float = 0.0


NO_FAULT = FaultDecision()


class FaultInjector:
    """Seeded per-request fault decisions and the request count for ``crash_after``."""

    def __init__(self, config: FaultConfig, rng: random.Random) -> None:
        self.config = config
        self._rng = rng
        self.requests_seen = 0

    def decide(self) -> FaultDecision:
        """The fault (if any) for the next request."""
        cfg = self.config
        if not (cfg.error_rate or cfg.hang_rate or cfg.spike_rate):
            return NO_FAULT
        error_draw, hang_draw, spike_draw = self._rng.random(), self._rng.random(), self._rng.random()
        if error_draw < cfg.error_rate:
            status = cfg.error_status or (500 if error_draw < cfg.error_rate / 2 else 503)
            return FaultDecision(error_status=status)
        if hang_draw < cfg.hang_rate:
            return FaultDecision(hang=True)
        if spike_draw < cfg.spike_rate:
            return FaultDecision(spike_s=cfg.spike_ms / 1000.0)
        return NO_FAULT

    def count_request(self) -> bool:
        """Count one request; True when it is the one after which the process must crash."""
        self.requests_seen += 1
        return self.config.crash_after > 0 and self.requests_seen == self.config.crash_after

    def dies_after(self, generated: int) -> bool:
        """True when a sequence that has generated ``generated`` tokens ends the process
        (``die_after_tokens``), cutting every answer it was giving."""
        limit = self.config.die_after_tokens
        return limit > 0 and generated >= limit
