"""Output-length prediction: how many tokens a request will generate, learned from usage.

The TPM limiter reserves ``estimated input + predicted output`` tokens when a request is admitted
and reconciles with the server's ``usage`` when it ends. This module predicts the output part, per
key (a ``(tenant, model)`` pair), from the completion lengths observed for that key:

* the estimate is a high quantile (p90 by default) of the observed lengths, capped by the
  request's ``max_tokens``; a fixed cold-start default applies until enough are observed;
* the design paper (``llm-gateway-design.txt`` 2.1) detects drift with a two-sample
  Kolmogorov-Smirnov test between sliding windows at alpha = 0.01 and re-learns on drift. Here the
  last ``reference_size + recent_size`` lengths are kept; every ``check_every`` observations the
  older part (reference) is tested against the newer part (recent), and on drift the reference is
  dropped, so the estimate comes from the recent window alone.

Windows count observations, not seconds (the paper samples every 10 s), so the predictor needs
no clock and adapts at the pace a key's traffic arrives. Pure and single-threaded: one predictor
per process, fed by the response path; memory is bounded by ``max_keys`` (least recently used
keys are forgotten) times the window, 4 bytes per kept length.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

# The Kolmogorov series below converge to double precision well within this many terms.
_SERIES_TERMS = 100
# Below this argument the theta-function form converges faster (Numerical Recipes 6.14).
_SMALL_ARGUMENT = 1.18


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    """Tuning of ``OutputLengthPredictor``; every field is validated on construction."""

    quantile: float = 0.9
    cold_start_tokens: int = 512
    min_observations: int = 32
    reference_size: int = 256
    recent_size: int = 256
    check_every: int = 16
    alpha: float = 0.01
    max_keys: int = 4096

    def __post_init__(self) -> None:
        if not 0 < self.quantile <= 1:
            raise ValueError(f"quantile: must be in (0, 1], got {self.quantile}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha: must be in (0, 1), got {self.alpha}")
        for name in ("reference_size", "recent_size", "check_every", "max_keys", "min_observations"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")
        if self.cold_start_tokens < 0:
            raise ValueError("cold_start_tokens: must be >= 0")
        if self.min_observations > self.recent_size:
            # after a re-learn only the recent window is left, and it must still be enough
            raise ValueError("min_observations: must not exceed recent_size")


@dataclass(frozen=True, slots=True)
class KsResult:
    """A two-sample Kolmogorov-Smirnov test: the statistic D and its asymptotic p-value."""

    statistic: float
    p_value: float


@dataclass(frozen=True, slots=True)
class KeyStats:
    """What the predictor holds for one key (for metrics and debugging)."""

    observations: int
    estimate: int | None
    drifts: int


# ---------------------------------------------------------------------------------------------
# Statistics


def quantile(sorted_values: Sequence[int], q: float) -> int:
    """The nearest-rank ``q`` quantile of ascending, non-empty ``sorted_values``: the smallest
    value with at least ``q`` of the sample at or below it (Hyndman & Fan definition 1)."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def ks_statistic(a: Sequence[int], b: Sequence[int]) -> float:
    """D = sup |F_a(x) - F_b(x)| of two ascending, non-empty samples (ties step together)."""
    n, m = len(a), len(b)
    i = j = 0
    d = 0.0
    while i < n and j < m:
        x = a[i] if a[i] <= b[j] else b[j]
        while i < n and a[i] == x:
            i += 1
        while j < m and b[j] == x:
            j += 1
        d = max(d, abs(i / n - j / m))
    return d


def kolmogorov_sf(x: float) -> float:
    """Q_KS(x) = P(K > x) of the Kolmogorov distribution, 2 sum (-1)^(j-1) exp(-2 j^2 x^2);
    for small x the equivalent sqrt(2 pi)/x sum exp(-(2j-1)^2 pi^2 / (8 x^2)) gives 1 - Q."""
    if x <= 0:
        return 1.0
    if x < _SMALL_ARGUMENT:
        factor = -math.pi ** 2 / (8 * x * x)
        cdf = math.sqrt(2 * math.pi) / x * sum(math.exp(factor * (2 * j - 1) ** 2) for j in range(1, 6))
        return min(1.0, max(0.0, 1.0 - cdf))
    total = 0.0
    for j in range(1, _SERIES_TERMS):
        term = math.exp(-2 * j * j * x * x)
        total += term if j % 2 else -term
        if term < 1e-17:
            break
    return min(1.0, max(0.0, 2 * total))


def ks_2samp(a: Sequence[int], b: Sequence[int]) -> KsResult:
    """Two-sample KS test with the asymptotic p-value Q_KS((sqrt(ne) + 0.12 + 0.11/sqrt(ne)) D),
    ne = n m / (n + m) (Stephens' correction, Numerical Recipes 14.3); good for ne >= 4."""
    if not a or not b:
        raise ValueError("ks_2samp needs two non-empty samples")
    d = ks_statistic(sorted(a), sorted(b))
    root = math.sqrt(len(a) * len(b) / (len(a) + len(b)))
    return KsResult(d, kolmogorov_sf((root + 0.12 + 0.11 / root) * d))


# ---------------------------------------------------------------------------------------------
# The predictor


class _Lengths:
    """One key's kept lengths: a ring buffer of the last ``capacity`` values, oldest first."""

    __slots__ = ("buffer", "start", "count", "since_check", "estimate", "drifts")

    def __init__(self, capacity: int) -> None:
        self.buffer = array("l", bytes(capacity * array("l").itemsize))
        self.start = 0
        self.count = 0
        self.since_check = 0
        self.estimate: int | None = None
        self.drifts = 0

    def append(self, value: int) -> None:
        capacity = len(self.buffer)
        if self.count < capacity:
            self.buffer[(self.start + self.count) % capacity] = value
            self.count += 1
        else:
            self.buffer[self.start] = value
            self.start = (self.start + 1) % capacity

    def values(self) -> list[int]:
        """The kept lengths, oldest first."""
        end = self.start + self.count
        if end <= len(self.buffer):
            return self.buffer[self.start:end].tolist()
        return (self.buffer[self.start:] + self.buffer[:end - len(self.buffer)]).tolist()

    def keep(self, values: list[int]) -> None:
        """Replace the contents with ``values`` (oldest first)."""
        self.buffer[:len(values)] = array("l", values)
        self.start, self.count = 0, len(values)


class OutputLengthPredictor:
    """Predicts completion tokens per key from observed usage (see the module docstring)."""

    def __init__(self, config: PredictorConfig = PredictorConfig()) -> None:
        self.config = config
        self._keys: OrderedDict[Hashable, _Lengths] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def predict(self, key: Hashable, max_tokens: int | None = None, n: int = 1) -> int:
        """Tokens ``n`` choices will generate: the learned quantile per choice (the cold-start
        default while fewer than ``min_observations`` are known), capped by ``max_tokens``."""
        state = self._keys.get(key)
        if state is not None:
            self._keys.move_to_end(key)
        per_choice = self.config.cold_start_tokens if state is None or state.estimate is None \
            else state.estimate
        if max_tokens is not None:
            per_choice = min(per_choice, max_tokens)
        return per_choice * n

    def observe(self, key: Hashable, completion_tokens: int, n: int = 1) -> bool:
        """Record a finished request's ``usage.completion_tokens`` (for ``n`` choices, recorded as
        their mean). Returns True when this observation revealed drift and the key re-learned."""
        if completion_tokens < 0 or n < 1:
            raise ValueError("completion_tokens must be >= 0 and n >= 1")
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _Lengths(self.config.reference_size + self.config.recent_size)
            if len(self._keys) > self.config.max_keys:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key)
        state.append(round(completion_tokens / n))
        state.since_check += 1
        first_estimate = state.estimate is None and state.count >= self.config.min_observations
        if not first_estimate and state.since_check < self.config.check_every:
            return False
        return self._refresh(state)

    def _refresh(self, state: _Lengths) -> bool:
        """Test for drift when both windows are full, then recompute the estimate."""
        state.since_check = 0
        values = state.values()
        drifted = False
        if state.count == len(state.buffer):
            recent = values[-self.config.recent_size:]
            if ks_2samp(values[:-self.config.recent_size], recent).p_value < self.config.alpha:
                state.keep(recent)
                state.drifts += 1
                values, drifted = recent, True
        if len(values) >= self.config.min_observations:
            state.estimate = quantile(sorted(values), self.config.quantile)
        return drifted

    def stats(self, key: Hashable) -> KeyStats | None:
        """The key's kept observations, current estimate and drift count; None if unknown."""
        state = self._keys.get(key)
        if state is None:
            return None
        return KeyStats(state.count, state.estimate, state.drifts)
