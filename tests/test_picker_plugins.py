"""The endpoint picker as plugins: filters, producers, scorers found by name, and a scorer of one's
own as one registered function and one config entry."""

from __future__ import annotations

import random

import pytest

from extproc.config import ConfigError, parse_config
from extproc.routing.picker import Picker, PickRequest
from extproc.routing.plugins import FILTERS, SCORERS, PickContext, scorer
from extproc.routing.prefix import prefix_hashes
from extproc.routing.scorers.prefix import PrefixAffinity

PODS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")


def test_each_scorer_is_a_module_of_its_own_found_by_name() -> None:
    assert {"queue", "kv_cache", "in_flight", "prefix", "lora"} <= set(SCORERS)
    for name in ("queue", "kv_cache", "in_flight", "prefix", "lora"):
        assert SCORERS[name].__module__ == f"extproc.routing.scorers.{name}"
    assert list(FILTERS) == ["draining", "serves_model"]


@scorer("test_last_octet")
def _last_octet(context: PickContext) -> list[float]:  # prefers the highest address: easy to see
    return [int(e.split(":")[0].rsplit(".", 1)[1]) / 10 for e in context.candidates]


def test_a_scorer_of_ones_own_is_one_function_and_one_config_entry() -> None:
    config = parse_config({
        "pools": [{"name": "p", "endpoints": list(PODS),
                   "picker": {"weights": {"test_last_octet": 100, "in_flight": 0, "prefix": 0}}}],
        "models": [{"name": "m", "pool": "p"}]}, env={})
    pool = config.pools["p"]
    picker = Picker(random.Random(0))
    assert {picker.pick(PODS, PickRequest("m", (), pool.picker)) for _ in range(5)} == {"10.0.0.3:8000"}
    assert picker.score(PODS, PickRequest("m", (), pool.picker))[0].scores[-1] == ("test_last_octet", 0.3)


def test_a_weight_naming_no_scorer_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"pools\[0\]\.picker\.weights\.qeue: no such scorer"):
        parse_config({"pools": [{"name": "p", "endpoints": list(PODS), "picker": {"weights": {"qeue": 1}}}],
                      "models": [{"name": "m", "pool": "p"}]}, env={})


def test_the_prefix_index_is_a_producer_that_runs_before_the_scorers_and_learns_each_pick() -> None:
    config = parse_config({"pools": [{"name": "p", "endpoints": list(PODS)}], "models": [{"name": "m", "pool": "p"}]},
                          env={})
    picker = Picker(random.Random(0))
    (producer,) = picker.producers
    assert isinstance(producer, PrefixAffinity) and producer.index is picker.prefixes
    prompt = {"messages": [{"role": "system", "content": "You are a careful assistant. " * 30}]}
    request = PickRequest("m", tuple(prefix_hashes(prompt, 256, 16)), config.pools["p"].picker)
    first = picker.pick(PODS, request)
    context = PickContext(PODS, [None] * 3, request, {})
    matched = producer.produce(context)
    assert matched is not None and matched[first] == len(request.prefix) and sum(matched.values()) == matched[first]
    assert {picker.pick(PODS, request) for _ in range(4)} == {first}  # the prefix keeps it there
