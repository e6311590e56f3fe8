"""Circuit breakers (open at a failure ratio over a rolling window, half-open probes, closed again)
and what the gateway does with them: pods with open breakers are not picked, a model whose pool's
breaker is open is served by its fallback chain, and with nothing left a stale cached answer or a
503 with retry-after."""

from __future__ import annotations

import random

import orjson
import pytest

from extproc.config import parse_config
from extproc.gateway import Gateway
from extproc.routing.breaker import CLOSED, HALF_OPEN, OPEN, Breaker, BreakerSettings
from extproc.routing.picker import Picker
from extproc.steps import Continue, Lookup, Reply

SETTINGS = BreakerSettings(window_s=60, failure_ratio=0.6, min_requests=5, open_s=10.0, probes=2)


def test_it_opens_at_the_failure_ratio_over_enough_requests() -> None:
    breaker = Breaker(SETTINGS)
    for _ in range(3):
        breaker.record(True, 100.0)
    assert breaker.state == CLOSED  # 3 failures of 3: too few requests to judge
    breaker.record(False, 100.5)
    assert breaker.record(True, 101.0)  # 4 of 5 = 0.8 >= 0.6
    assert breaker.state == OPEN and not breaker.allows(105.0)


def test_a_healthy_ratio_keeps_it_closed_and_old_outcomes_leave_the_window() -> None:
    breaker = Breaker(SETTINGS)
    for i in range(10):
        breaker.record(i % 2 == 1, 100.0 + i / 10)  # every other one fails: at most half, under 0.6
    assert breaker.state == CLOSED
    for i in range(4):
        breaker.record(True, 200.0 + i)  # a minute later the old successes are gone: 4 of 4 but too few
    assert breaker.state == CLOSED
    breaker.record(True, 204.0)
    assert breaker.state == OPEN


def test_half_open_probes_close_it_or_open_it_again() -> None:
    breaker = Breaker(SETTINGS)
    breaker.record(True, 0.0)
    for _ in range(4):
        breaker.record(True, 0.0)
    assert breaker.state == OPEN
    assert breaker.would_allow(10.0) and breaker.allows(10.0) and breaker.state == HALF_OPEN
    assert breaker.allows(10.1) and not breaker.allows(10.2)  # two probes, no more
    breaker.record(False, 10.5)
    assert breaker.record(False, 10.6) and breaker.state == CLOSED
    for _ in range(5):
        breaker.record(True, 20.0)
    assert breaker.state == OPEN
    assert breaker.allows(30.0)
    assert breaker.record(True, 30.1) and breaker.state == OPEN and not breaker.allows(35.0)  # a probe failed


@pytest.mark.parametrize("bad", [dict(window_s=0), dict(failure_ratio=0), dict(failure_ratio=1.5), dict(probes=0)])
def test_settings_are_checked(bad: dict) -> None:
    with pytest.raises(ValueError):
        BreakerSettings(**bad)


DOCUMENT = {
    "pools": [{"name": "big", "endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"]},
              {"name": "small", "endpoints": ["10.0.1.1:8000"]}],
    "models": [{"name": "big-model", "pool": "big", "fallback": ["small-model"], "cache": {}},
               {"name": "small-model", "pool": "small"}],
    "breakers": {"min_requests": 2, "open_s": 30},
}


def _gateway() -> Gateway:
    return Gateway(parse_config(DOCUMENT), Picker(random.Random(0)))


def _decide(gateway: Gateway, body: dict) -> object:
    state = gateway.new_request()
    gateway.request_headers(state, {":method": "POST", ":path": "/v1/chat/completions",
                                    "content-type": "application/json"}, False)
    return gateway.request_body(state, orjson.dumps(body))


def _open(gateway: Gateway, pool: str) -> None:
    for _ in range(2):
        gateway.router.breakers.record(pool, "", True, 0.0)
    gateway.router.breakers.pool(pool).opened_at = 1e18  # open for good, whatever the clock says


ASK = {"model": "big-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_a_model_whose_pool_is_open_is_served_by_its_fallback() -> None:
    gateway = _gateway()
    _open(gateway, "big")
    decided = _decide(gateway, ASK)
    assert isinstance(decided, Continue)
    headers = dict(decided.set_headers)
    assert headers["x-llmgw-pool"] == "small" and headers["x-llmgw-model"] == "small-model"
    assert "fallback_from=big-model" in headers["x-llmgw-decision"]
    assert decided.body is not None and orjson.loads(decided.body)["model"] == "small-model"
    assert headers["x-gateway-destination-endpoint"].startswith("10.0.1.1:8000")


def test_with_every_pool_open_a_cacheable_request_asks_for_a_stale_copy_and_others_get_a_503() -> None:
    gateway = _gateway()
    _open(gateway, "big")
    _open(gateway, "small")
    assert isinstance(_decide(gateway, {**ASK, "temperature": 0}), Lookup)
    refused = _decide(gateway, ASK)
    assert isinstance(refused, Reply) and refused.status == 503
    assert orjson.loads(refused.body)["error"]["code"] == "pool_unavailable"
    assert int(dict(refused.headers)["retry-after"]) >= 1


def test_a_pod_whose_breaker_is_open_is_not_picked() -> None:
    gateway = _gateway()
    for _ in range(2):
        gateway.router.breakers.record("", "10.0.0.1:8000", True, 0.0)
    gateway.router.breakers.pod("10.0.0.1:8000").opened_at = 1e18
    for _ in range(20):
        decided = _decide(gateway, ASK)
        assert isinstance(decided, Continue)
        assert dict(decided.set_headers)["x-gateway-destination-endpoint"].split(",")[0] == "10.0.0.2:8000"


# -- degradation under load, by QoS class ------------------------------------------------------------

class _Load:
    """Scraped pod states: every pod of the big pool with ``running`` requests, others unknown."""

    def __init__(self, running: float) -> None:
        self.running = running

    def get(self, endpoint: str) -> object | None:
        if not endpoint.startswith("10.0.0."):
            return None
        return type("State", (), {"running": self.running, "waiting": 0.0, "kv_usage": 0.0, "models": frozenset(),
                                  "running_adapters": frozenset(), "waiting_adapters": frozenset(),
                                  "max_lora": 0})()


DEGRADING = {
    **DOCUMENT,
    "pools": [{"name": "big", "endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"],
               "degrade": {"max_concurrent": 10, "action": {"batch": "refuse", "default": "fallback"},
                           "timeout_s": {"realtime": 2.5}}},
              {"name": "small", "endpoints": ["10.0.1.1:8000"]}],
    "tenants": [{"name": "t", "keys": [{"sha256": "a" * 64}], "qos": ["standard", "batch", "realtime"]}],
}


@pytest.mark.parametrize(("running", "outcomes"), [
    # load = 2 pods x running; shares of max_concurrent 10: batch 5, the default class 8, realtime 10
    (2, {"batch": "big", "standard": "big", "realtime": "big"}),
    (3, {"batch": 429, "standard": "big", "realtime": "big"}),  # 6: batch is refused first
    (4.5, {"batch": 429, "standard": "small", "realtime": "big"}),  # 9: the default class falls back
    (5, {"batch": 429, "standard": "small", "realtime": "small"}),  # 10: realtime last
])
def test_under_load_batch_is_refused_first_the_default_class_falls_back_and_realtime_goes_on(
        running: float, outcomes: dict[str, object]) -> None:
    gateway = Gateway(parse_config(DEGRADING), Picker(random.Random(0), _Load(running)))  # type: ignore[arg-type]
    for qos, expected in outcomes.items():
        state = gateway.new_request()
        gateway.request_headers(state, {":method": "POST", ":path": "/v1/chat/completions",
                                        "content-type": "application/json", "authorization": "Bearer k",
                                        "x-llmgw-qos": qos}, False)
        state.tenant = gateway.config.tenants_by_name["t"]  # the key's digest stands for it here
        state.qos = qos
        decided = gateway.request_body(state, orjson.dumps(ASK))
        if expected == 429:
            assert isinstance(decided, Reply) and decided.status == 429, qos
            assert orjson.loads(decided.body)["error"]["code"] == "pool_overloaded"
            continue
        assert isinstance(decided, Continue), (qos, decided)
        headers = dict(decided.set_headers)
        assert headers["x-llmgw-pool"] == expected, qos
        assert ("x-envoy-upstream-rq-timeout-ms" in headers) == (qos == "realtime" and expected == "big")  # big's bound


def test_a_semantic_cache_beside_routing_rules_gets_its_context_digest() -> None:
    # analyze() once reused one name for the semantic cache's context digest and the rules' context:
    # with any `routes:` configured, the digest became a RouteContext and every lookup a 500.
    semantic = {"embedder": "hashing", "check": "none"}
    document = {**DOCUMENT, "models": [{**DOCUMENT["models"][0], "cache": {"semantic": semantic}},
                                       DOCUMENT["models"][1]],
                "routes": [{"name": "long", "match": {"input_tokens": {"min": 10_000}}, "model": "small-model"}]}
    gateway = Gateway(parse_config(document), Picker(random.Random(0)))
    asked = _decide(gateway, {**ASK, "temperature": 0, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a Bloom filter?"}]})
    assert isinstance(asked, Lookup) and asked.semantic is not None
    partition, text = asked.semantic.partition, asked.semantic.text
    assert len(partition) == 64 and text == "What is a Bloom filter?"
