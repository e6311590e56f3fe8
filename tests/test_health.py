"""Endpoint health (probes and failed attempts) and the picker's fallback (no network)."""

from __future__ import annotations

import random

from extproc.routing.health import BACKOFF_S, MAX_BACKOFF_S, EndpointHealth
from extproc.routing.picker import Picker

PODS = ("a:1", "b:1", "c:1")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_probe_down_until_it_answers_again() -> None:
    health = EndpointHealth(Clock())
    assert health.probed("b:1", healthy=False)  # a change
    assert not health.probed("b:1", healthy=False)  # no change: logged once
    assert health.usable(PODS) == ("a:1", "c:1")
    assert health.probed("b:1", healthy=True)
    assert health.usable(PODS) == PODS


def test_failed_attempt_ejects_with_doubling_backoff_and_success_forgets() -> None:
    clock = Clock()
    health = EndpointHealth(clock)
    assert health.attempt_failed("a:1") == BACKOFF_S
    assert health.usable(PODS) == ("b:1", "c:1")
    clock.now += BACKOFF_S  # the backoff is over: it may be tried again
    assert health.usable(PODS) == PODS
    assert health.attempt_failed("a:1") == 2 * BACKOFF_S  # failed again: twice as long
    for _ in range(10):
        backoff = health.attempt_failed("a:1")
    assert backoff == MAX_BACKOFF_S
    health.attempt_succeeded("a:1")
    assert health.usable(PODS) == PODS
    assert health.attempt_failed("a:1") == BACKOFF_S  # a fresh start after a success


def test_a_healthy_probe_does_not_clear_an_ejection() -> None:
    # A hung pod often still answers /health: only the backoff (or a success through it) ends it.
    health = EndpointHealth(Clock())
    health.attempt_failed("a:1")
    health.probed("a:1", healthy=True)
    assert "a:1" not in health.usable(PODS)


def test_all_bad_means_all_are_tried() -> None:
    health = EndpointHealth(Clock())
    for pod in PODS:
        health.probed(pod, healthy=False)
    assert health.usable(PODS) == PODS  # a probe can be wrong; Envoy answers 503 if they are gone


def test_fallback_is_the_least_loaded_other_endpoint() -> None:
    picker = Picker(random.Random(1))
    first = picker.pick(PODS)
    second = picker.pick(PODS)
    fallback = picker.fallback(PODS, first)
    assert fallback not in (first, second)  # the only one with nothing in flight
    assert picker.fallback(("a:1",), "a:1") is None  # nowhere else to go
    assert picker.in_flight(fallback) == 0  # a fallback is not counted: it serves only a retry


def test_a_failed_attempt_does_not_cut_short_a_pause_the_pod_asked_for() -> None:
    # The router's log of the refused attempt (retry-after: 30) comes first; the request's own entry
    # (retried elsewhere) then backs the pod off for 2 s, which must not end the 30 s.
    clock = Clock()
    health = EndpointHealth(clock)
    health.pause("a:1", 30.0)
    health.attempt_failed("a:1")
    clock.now += 29
    assert "a:1" not in health.usable(PODS)
    clock.now += 1
    assert health.usable(PODS) == PODS
