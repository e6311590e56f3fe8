"""The identity stage on its own: ids and trace context, path and method, keys, QoS class."""

from __future__ import annotations

import orjson

from extproc.config import parse_config
from extproc.keys import hash_key
from extproc.stages.identity import Identity
from extproc.state import new_state
from extproc.steps import Continue, Reply
from tests.helpers import deterministic_id_source, make_config, post_headers

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _identity(config=None) -> Identity:  # type: ignore[no-untyped-def]
    return Identity(config or make_config(), deterministic_id_source())


def test_a_request_keeps_the_clients_request_id_and_continues_its_trace() -> None:
    state = new_state("1")
    answer = _identity().request_headers(state, post_headers(**{"x-request-id": "req-7", "traceparent": TRACEPARENT}),
                                         end_of_stream=False)
    assert isinstance(answer, Continue) and answer.clear_route_cache
    assert state.request_id == "req-7" and state.trace is not None
    assert state.trace.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert state.trace.parent_span_id == "00f067aa0ba902b7"
    assert dict(answer.set_headers)["traceparent"] == state.trace.traceparent
    assert [p.name for p in state.phases] == ["auth"]


def test_internal_headers_from_a_client_are_stripped() -> None:
    answer = _identity().request_headers(new_state("1"), post_headers(**{"x-llmgw-route": "batch"}), False)
    assert isinstance(answer, Continue) and "x-llmgw-route" in answer.remove_headers


def test_models_are_listed_here_and_nothing_else_is_asked_for() -> None:
    answer = _identity().request_headers(new_state("1"), {":method": "GET", ":path": "/v1/models"}, True)
    assert isinstance(answer, Reply) and answer.status == 200
    names = {model["id"] for model in orjson.loads(answer.body)["data"]}
    assert {"llama-3-8b-instruct", "gpt-4o-mini", "qwen-72b"} <= names


KEYED = {
    "pools": [{"name": "p", "endpoints": ["10.0.0.1:8000"]}],
    "models": [{"name": "m", "pool": "p"}],
    "tenants": [{"name": "team-a", "keys": [{"sha256": hash_key("sk-a").hex()}],
                 "qos": ["standard", "batch"]}],
}


def test_a_key_names_its_tenant_and_an_unknown_key_is_refused_with_a_challenge() -> None:
    identity = _identity(parse_config(KEYED, env={}))
    state = new_state("1")
    assert isinstance(identity.request_headers(state, post_headers(authorization="Bearer sk-a"), False), Continue)
    assert state.tenant is not None and state.tenant.name == "team-a" and state.qos == "standard"
    refused = new_state("2")
    answer = identity.request_headers(refused, post_headers(authorization="Bearer sk-nope"), False)
    assert isinstance(answer, Reply) and answer.status == 401
    assert dict(answer.headers)["www-authenticate"].startswith("Bearer")
    assert refused.rejected is not None and refused.tenant is None


def test_a_class_the_tenant_may_not_use_is_refused() -> None:
    identity = _identity(parse_config(KEYED, env={}))
    state = new_state("1")
    batch = identity.request_headers(state, post_headers(authorization="Bearer sk-a", **{"x-llmgw-qos": "batch"}),
                                     False)
    assert isinstance(batch, Continue) and state.qos == "batch"
    answer = identity.request_headers(new_state("2"), post_headers(authorization="Bearer sk-a",
                                                                   **{"x-llmgw-qos": "realtime"}), False)
    assert isinstance(answer, Reply) and answer.status == 403
    assert orjson.loads(answer.body)["error"]["code"] == "qos_class_not_allowed"


def test_a_reload_changes_what_the_next_request_sees() -> None:
    identity = _identity()
    identity.reload(parse_config(KEYED, env={}))
    answer = identity.request_headers(new_state("1"), post_headers(), False)  # keys are required now
    assert isinstance(answer, Reply) and answer.status == 401
