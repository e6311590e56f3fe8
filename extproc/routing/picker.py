"""Endpoint picking within a pool, from the plugins of ``extproc.routing.plugins``: filters, the
producers (the prefix index), weighted scorers (``extproc.routing.scorers``), then the picker: the
pod with the highest weighted sum wins, ties broken at random (several extproc processes seeing the
same state must not all pile onto one pod); the second best is Envoy's retry. Health is filtered
before, by ``EndpointHealth``. The baselines ``least_in_flight``, ``round_robin`` and ``random``
are there to measure the scorers against. Pure: no I/O.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from extproc.routing.plugins import (
    FILTERS,
    LEAST_IN_FLIGHT,
    NO_REQUEST,
    SCORERS,
    PickContext,
    PickRequest,
    PodStates,
    PodView,
    Producer,
)
from extproc.routing.prefix import PrefixIndex
from extproc.routing.scorers.prefix import HOME_SCORE, PrefixAffinity

__all__ = ["HOME_SCORE", "LEAST_IN_FLIGHT", "NO_REQUEST", "EndpointPicker", "PickRequest", "Picker", "PodStates",
           "PodView", "Scored"]


class _NoStates:
    def get(self, endpoint: str) -> PodView | None:
        return None


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
        self.producers: list[Producer] = [PrefixAffinity(self.prefixes)]
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
        for producer in self.producers:
            producer.picked(request, chosen)
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
        for keep in FILTERS.values():
            endpoints = keep(endpoints, request, self.states) or endpoints  # never down to none
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
        """(scorer, weight, each candidate's score) for every scorer with a weight, in the order of
        the weights (the producers run first, once)."""
        context = PickContext(candidates, [self.states.get(e) for e in candidates], request, self._in_flight)
        for producer in self.producers:
            context.produced[producer.name] = producer.produce(context)
        return [(name, weight, SCORERS[name](context)) for name, weight in request.picker.weights.items()
                if weight > 0]

    def _totals(self, candidates: tuple[str, ...], request: PickRequest) -> list[float]:
        totals = [0.0] * len(candidates)
        for _, weight, values in self._columns(candidates, request):
            for i, value in enumerate(values):
                totals[i] += weight * value
        return totals

    def _tie(self, candidates: list[str]) -> str:
        return candidates[0] if len(candidates) == 1 else self._rng.choice(candidates)
