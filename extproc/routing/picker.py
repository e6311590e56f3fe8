"""Endpoint picking within a pool, as small plugins: filters, then weighted scorers. Pure: no I/O.

Filters drop the pods that may not take the request: draining ones, and those whose ``/v1/models``
(scraped) does not list the served model or LoRA adapter. A filter never empties the set: with
nothing left, the filter is skipped (a scrape can be wrong; Envoy retries elsewhere if a pod is).
Health is filtered before, by ``EndpointHealth``.

Scorers each give every remaining pod a score in 0..1, higher better:

- ``queue``: fewest requests waiting at the pod (``vllm:num_requests_waiting``), as a ratio to the fewest;
- ``kv_cache``: most free KV cache (1 - ``vllm:kv_cache_usage_perc``);
- ``in_flight``: fewest requests this process has in flight to the pod, likewise;
- ``prefix``: the share of the prompt's leading blocks last sent to the pod (``PrefixIndex``); a
  prefix sent nowhere yet scores 0.25 on its home pod (rendezvous hashing of its first block), so
  workers that do not share an index still place it alike;
- ``lora``: 1 when the pod has the request's adapter loaded, 0.5 when it has room for another.

A pod whose scraped state is unknown (never scraped, or older than a few intervals) scores 0 on
what its state would tell: unknown is not idle. The pool's ``picker`` config weighs the scorers;
the pod with the highest weighted sum wins, ties broken at random (several extproc processes
seeing the same state must not all pile onto one pod). The baselines ``least_in_flight``,
``round_robin`` and ``random`` are there to measure the scorers against.
"""

from __future__ import annotations

import math
import random
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from extproc.config import PickerSpec
from extproc.routing.prefix import PrefixIndex

LEAST_IN_FLIGHT = PickerSpec(kind="least_in_flight")
HOME_SCORE = 0.25  # the prefix score of a new prefix's home pod (see _prefix)


class PodView(Protocol):
    """What the scorers read of a pod's scraped state (``extproc.routing.podstate.PodState``, a
    frozen dataclass: read-only, hence properties)."""

    @property
    def running(self) -> float: ...
    @property
    def waiting(self) -> float: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def running_adapters(self) -> frozenset[str]: ...
    @property
    def waiting_adapters(self) -> frozenset[str]: ...
    @property
    def max_lora(self) -> int: ...
    @property
    def models(self) -> frozenset[str]: ...


class PodStates(Protocol):
    """The node's latest scrape of its pods (``extproc.routing.podstate.PodStates``)."""

    def get(self, endpoint: str) -> PodView | None:
        """The pod's state, or None when unknown (never scraped, or stale)."""
        ...


class _NoStates:
    def get(self, endpoint: str) -> PodView | None:
        return None


@dataclass(frozen=True, slots=True)
class PickRequest:
    """What the picker needs to know of a request and its pool."""

    model: str = ""  # the served model or LoRA adapter
    prefix: tuple[int, ...] = ()  # chained hashes of the prompt's leading blocks
    picker: PickerSpec = LEAST_IN_FLIGHT  # the pool's
    draining: frozenset[str] = frozenset()
    adapter: bool = False  # ``model`` is a LoRA adapter: pods that have it loaded score higher


NO_REQUEST = PickRequest()


class EndpointPicker(Protocol):
    """Chooses an endpoint of a pool for a request and learns when that request ends."""

    states: PodStates  # the node's scrape of its pods (QoS shedding reads their queues too)

    def pick(self, endpoints: tuple[str, ...], request: PickRequest = NO_REQUEST) -> str:
        """Choose one of ``endpoints`` (never empty) and count a request in flight to it."""
        ...

    def choose(self, endpoints: tuple[str, ...], request: PickRequest = NO_REQUEST) -> tuple[str, str | None]:
        """``pick``, and the ``fallback`` for it, in one go."""
        ...

    def release(self, endpoint: str) -> None:
        """A request picked earlier has ended (completed, failed or cancelled)."""
        ...

    def fallback(self, endpoints: tuple[str, ...], chosen: str, request: PickRequest = NO_REQUEST) -> str | None:
        """Another endpoint for Envoy's one retry if ``chosen`` fails (None with no other)."""
        ...


@dataclass(frozen=True, slots=True)
class Scored:
    """One pod's scores, for ``llmgw route --explain`` and the tests."""

    endpoint: str
    total: float
    scores: tuple[tuple[str, float], ...]


class Picker:
    """The endpoint picker of one extproc process: its in-flight counts and prefix index, and the
    node's pod states."""

    def __init__(self, rng: random.Random | None = None, states: PodStates | None = None,
                 prefix_capacity: int = 200_000) -> None:
        self._in_flight: Counter[str] = Counter()
        self._rng = rng or random.Random()
        self.states: PodStates = states or _NoStates()
        self.prefixes = PrefixIndex(prefix_capacity)
        self._turn: Counter[tuple[str, ...]] = Counter()  # round robin's position per endpoint list

    def pick(self, endpoints: tuple[str, ...], request: PickRequest = NO_REQUEST) -> str:
        """Choose a pod and count the request against it; a scored pick also records its prefix."""
        return self.choose(endpoints, request)[0]

    def choose(self, endpoints: tuple[str, ...], request: PickRequest = NO_REQUEST) -> tuple[str, str | None]:
        """``pick`` and ``fallback`` from one ranking: the pod (counted) and the one for Envoy's retry."""
        candidates = self._filter(endpoints, request)
        kind = request.picker.kind
        if kind == "scored" and len(candidates) > 1:
            totals = self._totals(candidates, request)
            best = max(totals)
            chosen = self._tie([e for e, t in zip(candidates, totals, strict=True) if t >= best - 1e-9])
            others = [(t, e) for e, t in zip(candidates, totals, strict=True) if e != chosen]
            fallback = max(others)[1] if others else None
        else:
            chosen = self._choose(candidates, request, None)
            fallback = self.fallback(endpoints, chosen, request)
        if fallback is None and len(endpoints) > len(candidates):  # filtered out, but better than no retry
            fallback = next((e for e in endpoints if e != chosen), None)
        self._in_flight[chosen] += 1
        if request.prefix and kind == "scored" and request.picker.weights.prefix > 0:
            self.prefixes.record(request.prefix, chosen)
        return chosen, fallback

    def fallback(self, endpoints: tuple[str, ...], chosen: str, request: PickRequest = NO_REQUEST) -> str | None:
        """The best other pod by the same rule; not counted: it is used only on a retry."""
        others = tuple(e for e in self._filter(endpoints, request) if e != chosen) \
            or tuple(e for e in endpoints if e != chosen)
        if not others:
            return None
        return self._choose(others, request, chosen)

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

    def score(self, endpoints: tuple[str, ...], request: PickRequest) -> list[Scored]:
        """Every pod's weighted scores (after the filters), best first (``llmgw route --explain``)."""
        candidates = self._filter(endpoints, request)
        columns = self._columns(candidates, request)
        rows = [Scored(endpoint, sum(weight * values[i] for _, weight, values in columns),
                       tuple((name, round(values[i], 4)) for name, _, values in columns))
                for i, endpoint in enumerate(candidates)]
        return sorted(rows, key=lambda row: -row.total)

    # -- internals ------------------------------------------------------------------------------

    def _filter(self, endpoints: tuple[str, ...], request: PickRequest) -> tuple[str, ...]:
        if request.draining:
            endpoints = tuple(e for e in endpoints if e not in request.draining) or endpoints
        if request.model:
            serving = tuple(e for e in endpoints if _serves(self.states.get(e), request.model))
            endpoints = serving or endpoints
        return endpoints

    def _choose(self, candidates: tuple[str, ...], request: PickRequest, exclude: str | None) -> str:
        if len(candidates) == 1:
            return candidates[0]
        kind = request.picker.kind
        if kind == "least_in_flight":
            fewest = min(self._in_flight[e] for e in candidates)
            return self._tie([e for e in candidates if self._in_flight[e] == fewest])
        if kind == "random":
            return self._rng.choice(candidates)
        if kind == "round_robin":
            turn = self._turn[candidates]
            if exclude is None:
                self._turn[candidates] = turn + 1
            return candidates[turn % len(candidates)]
        totals = self._totals(candidates, request)
        best = max(totals)
        return self._tie([e for e, t in zip(candidates, totals, strict=True) if t >= best - 1e-9])

    def _columns(self, candidates: tuple[str, ...], request: PickRequest) -> list[tuple[str, float, list[float]]]:
        """(scorer, weight, each candidate's score) for every scorer with a weight."""
        weights = request.picker.weights
        states = [self.states.get(e) for e in candidates]
        return [(name, weight, scorer(self, candidates, states, request)) for name, weight, scorer in (
            ("queue", weights.queue, _queue), ("kv_cache", weights.kv_cache, _kv_cache),
            ("in_flight", weights.in_flight, _in_flight), ("prefix", weights.prefix, _prefix),
            ("lora", weights.lora, _lora)) if weight > 0]

    def _totals(self, candidates: tuple[str, ...], request: PickRequest) -> list[float]:
        totals = [0.0] * len(candidates)
        for _, weight, values in self._columns(candidates, request):
            for i, value in enumerate(values):
                totals[i] += weight * value
        return totals

    def _tie(self, candidates: list[str]) -> str:
        return candidates[0] if len(candidates) == 1 else self._rng.choice(candidates)


def _serves(state: PodView | None, model: str) -> bool:
    """False only when the pod's model list is known and lacks ``model``."""
    return state is None or not state.models or model in state.models


def _fewest(values: Sequence[float | None]) -> list[float]:
    """(fewest + 1) / (count + 1): the fewest scores 1, one more than it 0.5 when it is 0, and
    10 against 11 barely differ (min-max scaling would make them 1 and 0); unknown: 0."""
    known = [v for v in values if v is not None]
    if not known:
        return [0.0] * len(values)
    low = min(known) + 1.0
    return [0.0 if v is None else low / (v + 1.0) for v in values]


States = list[PodView | None]


def _queue(picker: Picker, candidates: tuple[str, ...], states: States, request: PickRequest) -> list[float]:
    return _fewest([s.waiting if s is not None else None for s in states])


def _kv_cache(picker: Picker, candidates: tuple[str, ...], states: States, request: PickRequest) -> list[float]:
    # unknown (no state, or an engine that does not report its KV cache: NaN) scores as full
    return [0.0 if s is None or math.isnan(s.kv_usage) else max(0.0, min(1.0, 1.0 - s.kv_usage)) for s in states]


def _in_flight(picker: Picker, candidates: tuple[str, ...], states: States, request: PickRequest) -> list[float]:
    return _fewest([float(picker._in_flight[e]) for e in candidates])


def _prefix(picker: Picker, candidates: tuple[str, ...], states: States, request: PickRequest) -> list[float]:
    if not request.prefix:
        return [0.0] * len(candidates)
    matched = picker.prefixes.matches(request.prefix, candidates)
    if any(matched.values()):
        return [matched[e] / len(request.prefix) for e in candidates]
    # A prefix no pod was sent yet: its home pod (rendezvous hashing on the first block) gets a
    # quarter of a match, so every worker and every gateway replica places a new system prompt on
    # the same pod (when loads are close) instead of each on its own, and caches it once. Only a
    # quarter: at half, a burst of new prompts queued their prefills on their homes (bench.prefix
    # TTFT p99 ~490 ms against ~400 for least-in-flight; at a quarter ~230-320).
    first = request.prefix[0] & 0xFFFFFFFF
    ranks = [zlib.crc32(e.encode(), first) for e in candidates]
    home = max(ranks)
    return [HOME_SCORE if rank == home else 0.0 for rank in ranks]


def _lora(picker: Picker, candidates: tuple[str, ...], states: States, request: PickRequest) -> list[float]:
    if not request.adapter:
        return [0.0] * len(candidates)
    out = []
    for state in states:
        if state is None or state.max_lora <= 0:
            out.append(0.0)
        elif request.model in state.running_adapters or request.model in state.waiting_adapters:
            out.append(1.0)
        elif len(state.running_adapters) < state.max_lora:
            out.append(0.5)
        else:
            out.append(0.0)
    return out
