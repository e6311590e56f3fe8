"""Admission on the request path: the gateway asks, the quota store answers, the gateway replies."""

from __future__ import annotations

import random

import orjson
import pytest

from extproc.config import hash_key, parse_config
from extproc.gateway import Gateway
from extproc.quota import MemoryStore, StoreUnavailable
from extproc.routing.picker import Picker
from extproc.state import RequestState
from extproc.steps import Admit, Continue, Reply
from tests.helpers import CONFIG, post_headers

KEY = "sk-limited"
DOCUMENT = {**CONFIG, "tenants": [{"name": "team-l", "keys": [{"sha256": hash_key(KEY).hex()}],
                                   "limits": {"rpm": 2, "concurrency": 5}}]}
CHAT = b'{"model": "llama-3-8b-instruct", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 50}'


@pytest.fixture
def gateway() -> Gateway:
    return Gateway(parse_config(DOCUMENT, env={"POOL_KEY": "p"}), Picker(random.Random(0)))


def _ask(gateway: Gateway) -> tuple[RequestState, Admit]:
    state = gateway.new_request()
    assert isinstance(gateway.request_headers(state, post_headers(authorization=f"Bearer {KEY}"), False), Continue)
    ask = gateway.request_body(state, CHAT)
    assert isinstance(ask, Admit)
    return state, ask


async def test_admitted_requests_route_with_rate_headers_then_429(gateway: Gateway) -> None:
    store = MemoryStore()
    for remaining in ("1", "0"):
        state, ask = _ask(gateway)
        assert state.endpoint is None  # nothing is picked before the store says yes
        assert ask.admission.reserve_tokens == state.reserved_tokens
        assert 50 < state.reserved_tokens <= 50 + 20  # input estimate + predicted output capped by max_tokens
        decision = gateway.resume(state, ask, await store.admit(ask.admission, ask.quota))
        assert isinstance(decision, Continue) and state.endpoint is not None and state.lease is not None
        headers = dict(decision.set_headers)
        assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("2", remaining)
    state, ask = _ask(gateway)
    refused = gateway.resume(state, ask, await store.admit(ask.admission, ask.quota))
    assert isinstance(refused, Reply) and refused.status == 429
    error = orjson.loads(refused.body)["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
    assert "team-l" in error["message"] and "requests per minute (rpm) (limit 2)" in error["message"]
    assert int(dict(refused.headers)["retry-after"]) >= 1
    assert state.endpoint is None and state.lease is None  # a refused request holds nothing


async def test_settle_is_claimed_once(gateway: Gateway) -> None:
    store = MemoryStore()
    state, ask = _ask(gateway)
    gateway.resume(state, ask, await store.admit(ask.admission, ask.quota))
    lease = gateway.settle(state)
    assert lease is not None and lease.lease_id == state.id and gateway.settle(state) is None


def test_store_outage_with_fail_closed_is_503(gateway: Gateway) -> None:
    state, ask = _ask(gateway)
    reply = gateway.resume(state, ask, StoreUnavailable("down"))
    assert isinstance(reply, Reply) and reply.status == 503
    assert orjson.loads(reply.body)["error"]["code"] == "service_unavailable"
    assert dict(reply.headers)["retry-after"] == "1"


def test_tenant_without_limits_is_routed_directly() -> None:
    document = {**DOCUMENT, "tenants": [{**DOCUMENT["tenants"][0], "limits": None}]}
    gateway = Gateway(parse_config(document, env={"POOL_KEY": "p"}), Picker())
    state = gateway.new_request()
    gateway.request_headers(state, post_headers(authorization=f"Bearer {KEY}"), False)
    decision = gateway.request_body(state, CHAT)
    assert isinstance(decision, Continue) and not [k for k, _ in decision.set_headers if k.startswith("x-ratelimit")]


PRICED = {**CONFIG,
          "models": [{**CONFIG["models"][0], "price": {"input": 1000.0, "output": 2000.0}}],  # $ per 1M tokens
          "tenants": [
              {"name": "team-q", "keys": [{"sha256": hash_key("sk-q").hex()}], "qos": ["interactive", "batch"],
               "limits": {"rpm": 100}, "qos_limits": {"batch": {"rpm": 1}}},
              {"name": "team-b", "keys": [{"sha256": hash_key("sk-b").hex()}], "budget": {"daily_usd": 1.0}},
          ]}


@pytest.fixture
def priced() -> Gateway:
    return Gateway(parse_config(PRICED, env={"POOL_KEY": "p"}), Picker(random.Random(0)))


@pytest.mark.parametrize("asked, granted", [
    pytest.param(None, "interactive", id="no header: the tenant's first class"),
    pytest.param("batch", "batch", id="an allowed class"),
    pytest.param(" batch ", "batch", id="spaces are ignored"),
])
def test_qos_class_is_chosen_from_the_header(priced: Gateway, asked: str | None, granted: str) -> None:
    state = priced.new_request()
    extra = {"x-llmgw-qos": asked} if asked is not None else {}
    assert isinstance(priced.request_headers(state, post_headers(authorization="Bearer sk-q", **extra), False),
                      Continue)
    ask = priced.request_body(state, CHAT)
    assert isinstance(ask, Admit) and state.qos == granted
    # Only a class with limits of its own is a quota scope (team-q's batch; interactive has none).
    assert ask.admission.qos == (granted if granted == "batch" else "")


def test_a_class_the_tenant_may_not_use_is_403(priced: Gateway) -> None:
    state = priced.new_request()
    reply = priced.request_headers(state, post_headers(authorization="Bearer sk-q", **{"x-llmgw-qos": "gold"}), False)
    assert isinstance(reply, Reply) and reply.status == 403
    error = orjson.loads(reply.body)["error"]
    assert (error["code"], error["param"]) == ("qos_class_not_allowed", "x-llmgw-qos")
    assert "interactive, batch" in error["message"]


async def test_each_class_has_its_own_limit_on_top_of_the_tenants(priced: Gateway) -> None:
    store = MemoryStore()

    async def send(qos: str) -> Continue | Reply:
        state = priced.new_request()
        priced.request_headers(state, post_headers(authorization="Bearer sk-q", **{"x-llmgw-qos": qos}), False)
        ask = priced.request_body(state, CHAT)
        assert isinstance(ask, Admit)
        return priced.resume(state, ask, await store.admit(ask.admission, ask.quota))

    admitted = await send("batch")
    assert isinstance(admitted, Continue) and ("x-llmgw-qos", "batch") in admitted.set_headers  # for the pod
    refused = await send("batch")  # the batch class allows 1 per minute
    assert isinstance(refused, Reply) and refused.status == 429
    assert "for QoS class" in orjson.loads(refused.body)["error"]["message"]
    assert isinstance(await send("interactive"), Continue)  # the tenant's own 100 still has room


async def test_spending_budget_reserves_cost_and_refuses_with_402(priced: Gateway) -> None:
    store = MemoryStore()

    def ask() -> tuple[RequestState, Admit]:
        state = priced.new_request()
        priced.request_headers(state, post_headers(authorization="Bearer sk-b"), False)
        admit = priced.request_body(state, CHAT)
        assert isinstance(admit, Admit)
        return state, admit

    state, admit = ask()
    # $1000 per 1M input and $2000 per 1M output tokens: a micro-dollar is 1/1000 of an input token.
    assert state.facts is not None
    inputs = state.facts.input_tokens
    expected = 1000 * inputs + 2000 * (state.reserved_tokens - inputs)
    assert admit.admission.reserve_cost == state.reserved_cost == expected
    spent = 0
    while isinstance(decision := priced.resume(state, admit, await store.admit(admit.admission, admit.quota)),
                     Continue):
        spent += state.reserved_cost
        state, admit = ask()
    assert spent <= 1_000_000 < spent + state.reserved_cost  # admitted until the next would pass $1
    assert decision.status == 402
    error = orjson.loads(decision.body)["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert "daily spending budget of $1.00" in error["message"] and "team-b" in error["message"]
    assert int(dict(decision.headers)["retry-after"]) >= 1  # until UTC midnight


async def _process(servicer: object, *messages: object) -> list[object]:
    class _Context:
        async def abort(self, code: object, details: str) -> None:
            raise AssertionError(details)

    async def stream():
        for message in messages:
            yield message

    return [r async for r in servicer.Process(stream(), _Context())]  # type: ignore[attr-defined]


async def test_a_bug_after_admission_gives_the_slot_back_and_answers_500(monkeypatch: pytest.MonkeyPatch) -> None:
    from extproc.server import ExternalProcessor
    from tests.helpers import request_body, request_headers

    solo = {**CONFIG, "tenants": [{"name": "team-s", "keys": [{"sha256": hash_key("sk-s").hex()}],
                                   "limits": {"concurrency": 1}}]}
    gateway = Gateway(parse_config(solo, env={"POOL_KEY": "p"}), Picker(random.Random(0)))
    store = MemoryStore()
    servicer = ExternalProcessor(gateway, store)

    def broken(state: RequestState) -> None:
        raise RuntimeError("a bug in routing")

    monkeypatch.setattr(gateway.route, "route", broken)
    replies = await _process(servicer, request_headers(post_headers(authorization="Bearer sk-s")), request_body(CHAT))
    answer = replies[-1].immediate_response  # type: ignore[attr-defined]
    assert answer.status.code == 500 and orjson.loads(answer.body)["error"]["code"] == "internal_error"
    await servicer.settlement.drain()  # the release was sent
    monkeypatch.undo()
    # The only concurrency slot is free again: the next request is admitted at once.
    state = gateway.new_request()
    gateway.request_headers(state, post_headers(authorization="Bearer sk-s"), False)
    admit = gateway.request_body(state, CHAT)
    assert isinstance(admit, Admit)
    assert (await store.admit(admit.admission, admit.quota)).admitted


def test_large_bodies_are_handed_to_the_shell_for_analysis() -> None:
    from extproc.steps import Analyze

    document = {**DOCUMENT, "server": {**CONFIG["server"], "max_body_bytes": 1 << 20, "offload_body_bytes": 1024}}
    gateway = Gateway(parse_config(document, env={"POOL_KEY": "p"}), Picker(random.Random(0)))
    state = gateway.new_request()
    gateway.request_headers(state, post_headers(authorization=f"Bearer {KEY}"), False)
    big = orjson.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x " * 1000}]})
    job = gateway.request_body(state, big)
    assert isinstance(job, Analyze) and job.served_names["gpt-4o-mini"] == "llama-3-8b-instruct"
