"""The endpoint picker's plugin points, as llm-d's scheduler has them. Pure: no I/O.

    filters -> producers -> scorers (weighted) -> picker

- A **filter** drops pods that may not take the request (never down to none: with nothing left,
  the filter is skipped, as a scrape can be wrong and Envoy retries elsewhere if a pod is).
- A **producer** runs once per pick, before the scorers, and computes what some of them read (the
  prefix index's matches); it hears which pod was picked.
- A **scorer** gives every remaining pod a score in 0..1, higher better; the pool's
  ``picker.weights`` weigh them by name. A pod whose scraped state is unknown scores 0 on what its
  state would tell: unknown is not idle.
- A **picker** chooses from the candidates: the best weighted total (ties at random), or a
  baseline (``least_in_flight``, ``round_robin``, ``random``) to measure the scorers against.

Each kind has a registry. A new scorer is one module in ``extproc/routing/scorers/`` that
registers a function with ``@scorer("name")``, and one config entry (``picker.weights.name``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from extproc.config import PickerSpec

LEAST_IN_FLIGHT = PickerSpec(kind="least_in_flight")


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


@dataclass(frozen=True, slots=True)
class PickRequest:
    """What the picker needs to know of a request and its pool."""

    model: str = ""  # the served model or LoRA adapter
    prefix: tuple[int, ...] = ()  # chained hashes of the prompt's leading blocks
    picker: PickerSpec = LEAST_IN_FLIGHT  # the pool's
    draining: frozenset[str] = frozenset()
    adapter: bool = False  # ``model`` is a LoRA adapter: pods that have it loaded score higher


NO_REQUEST = PickRequest()


@dataclass(slots=True)
class PickContext:
    """What the plugins see of one pick: the candidates (after the filters) and their states, the
    request, this process's requests in flight per pod, and what the producers computed."""

    candidates: tuple[str, ...]
    states: Sequence[PodView | None]
    request: PickRequest
    in_flight: Mapping[str, int]
    produced: dict[str, object] = field(default_factory=dict)


Filter = Callable[[tuple[str, ...], PickRequest, PodStates], tuple[str, ...]]
Scorer = Callable[[PickContext], list[float]]


class Producer(Protocol):
    """Runs before the scorers of a pick; its ``produce`` result is ``context.produced[name]``."""

    name: str

    def produce(self, context: PickContext) -> object:
        """What the scorers that read it need, for these candidates."""
        ...

    def picked(self, request: PickRequest, endpoint: str) -> None:
        """The pick went to ``endpoint`` (a producer that learns records it)."""
        ...


FILTERS: dict[str, Filter] = {}
SCORERS: dict[str, Scorer] = {}


def filter_plugin(name: str) -> Callable[[Filter], Filter]:
    """Register a filter under ``name`` (filters run in registration order)."""
    def register(function: Filter) -> Filter:
        FILTERS[name] = function
        return function
    return register


def scorer(name: str) -> Callable[[Scorer], Scorer]:
    """Register a scorer under ``name``, the key of its weight in ``picker.weights``."""
    def register(function: Scorer) -> Scorer:
        if name in SCORERS:
            raise ValueError(f"a scorer named {name!r} is registered already")
        SCORERS[name] = function
        return function
    return register


def fewest(values: Sequence[float | None]) -> list[float]:
    """(fewest + 1) / (count + 1): the fewest scores 1, one more than it 0.5 when it is 0, and
    10 against 11 barely differ (min-max scaling would make them 1 and 0); unknown: 0."""
    known = [v for v in values if v is not None]
    if not known:
        return [0.0] * len(values)
    low = min(known) + 1.0
    return [0.0 if v is None else low / (v + 1.0) for v in values]


# -- the filters ------------------------------------------------------------------------------


@filter_plugin("draining")
def not_draining(endpoints: tuple[str, ...], request: PickRequest, states: PodStates) -> tuple[str, ...]:
    """Pods being drained take no new requests (``pools[].draining``)."""
    return tuple(e for e in endpoints if e not in request.draining) if request.draining else endpoints


@filter_plugin("serves_model")
def serves_model(endpoints: tuple[str, ...], request: PickRequest, states: PodStates) -> tuple[str, ...]:
    """Pods whose ``/v1/models`` (scraped) lists the served model or LoRA adapter; a pod whose list
    is unknown may."""
    if not request.model:
        return endpoints
    return tuple(e for e in endpoints if _serves(states.get(e), request.model))


def _serves(state: PodView | None, model: str) -> bool:
    return state is None or not state.models or model in state.models
