"""The director's decisions for each phase, with no network: a table of requests and outcomes."""

from __future__ import annotations

import random

import orjson
import pytest

from extproc.gateway import Gateway
from extproc.routing.picker import Picker
from extproc.state import RequestState
from extproc.steps import Continue, Reply
from extproc.validation import DESTINATION_HEADER
from tests.helpers import deterministic_id_source, make_config, post_headers

CHAT = b'{"model": "llama-3-8b-instruct", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.fixture
def gateway() -> Gateway:
    return Gateway(make_config(), Picker(random.Random(1)), deterministic_id_source())


def through_body(gateway: Gateway, body: bytes, **headers: str) -> tuple[RequestState, Continue | Reply]:
    state = gateway.new_request()
    first = gateway.request_headers(state, post_headers(**headers), end_of_stream=False)
    assert isinstance(first, Continue), first
    return state, gateway.request_body(state, body)


def error_of(reply: Continue | Reply) -> tuple[int, str | None]:
    assert isinstance(reply, Reply)
    return reply.status, orjson.loads(reply.body)["error"]["code"]


@pytest.mark.parametrize(
    ("headers", "end_of_stream", "status", "code"),
    [
        pytest.param({":method": "POST", ":path": "/v1/nope"}, False, 404, "unknown_url", id="unknown-path"),
        pytest.param({":method": "GET", ":path": "/v1/chat/completions"}, True, 405, "method_not_allowed",
                     id="get-on-chat"),
        pytest.param({":method": "DELETE", ":path": "/v1/models"}, True, 405, "method_not_allowed",
                     id="delete-models"),
        pytest.param(post_headers(**{"content-type": "text/plain"}), False, 415, "unsupported_media_type",
                     id="text-plain"),
        pytest.param({":method": "POST", ":path": "/v1/completions"}, False, 415, "unsupported_media_type",
                     id="no-content-type"),
        pytest.param(post_headers(**{"content-length": "5000"}), False, 413, "request_too_large",
                     id="declared-too-large"),  # limit is 4096 in the test config
        pytest.param(post_headers(), True, 400, "invalid_json", id="no-body"),
        pytest.param({":method": "GET", ":path": "/v1/models/unknown"}, True, 404, "model_not_found",
                     id="unknown-model-card"),
    ],
)
def test_header_phase_rejections(gateway: Gateway, headers: dict[str, str], end_of_stream: bool,
                                 status: int, code: str) -> None:
    state = gateway.new_request()
    reply = gateway.request_headers(state, headers, end_of_stream)
    assert error_of(reply) == (status, code)
    assert ("x-request-id", state.request_id) in reply.headers  # type: ignore[union-attr]


def test_json_with_charset_is_accepted(gateway: Gateway) -> None:
    state = gateway.new_request()
    decision = gateway.request_headers(state, post_headers(**{"content-type": "Application/JSON; charset=utf-8"}),
                                       False)
    assert isinstance(decision, Continue)


def test_models_list_has_names_and_aliases(gateway: Gateway) -> None:
    reply = gateway.request_headers(gateway.new_request(), {":method": "GET", ":path": "/v1/models?x=1"}, True)
    assert isinstance(reply, Reply) and reply.status == 200
    ids = [card["id"] for card in orjson.loads(reply.body)["data"]]
    assert ids == ["llama-3-8b-instruct", "qwen-72b", "gpt-4o-mini"]


def test_internal_headers_and_authorization_are_stripped(gateway: Gateway) -> None:
    spoofed = {"x-llmgw-route": "batch", "x-llmgw-tenant": "admin", DESTINATION_HEADER: "evil:1",
               "authorization": "Bearer sk-tenant", "api-key": "sk-azure-style", "x-api-key": "k",
               "proxy-authorization": "Basic x", "x-other": "kept"}
    decision = gateway.request_headers(gateway.new_request(), post_headers(**spoofed), False)
    assert isinstance(decision, Continue)
    assert set(decision.remove_headers) == {"x-llmgw-route", "x-llmgw-tenant", DESTINATION_HEADER, "authorization",
                                            "api-key", "x-api-key", "proxy-authorization"}
    assert decision.clear_route_cache  # the route Envoy chose from the forged headers is dropped


def test_trailers_without_a_body_are_refused(gateway: Gateway) -> None:
    state = gateway.new_request()
    gateway.request_headers(state, post_headers(**{"x-llmgw-route": "batch"}), False)
    assert error_of(gateway.request_trailers(state)) == (400, "invalid_json")
    assert state.endpoint is None


def test_trailers_after_the_body_pass(gateway: Gateway) -> None:
    state, _ = through_body(gateway, CHAT)
    assert gateway.request_trailers(state) == Continue()


@pytest.mark.parametrize(
    ("client_id", "kept"),
    [
        ("req-123_abc", True),  # safe characters: kept
        ("bad id with spaces", False),  # replaced
        ("x" * 200, False),  # too long: replaced
    ],
)
def test_request_id_kept_when_valid(gateway: Gateway, client_id: str, kept: bool) -> None:
    state = gateway.new_request()
    gateway.request_headers(state, post_headers(**{"x-request-id": client_id}), False)
    assert (state.request_id == client_id) is kept


def test_traceparent_is_continued(gateway: Gateway) -> None:
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    state = gateway.new_request()
    decision = gateway.request_headers(state, post_headers(traceparent=parent), False)
    sent = dict(decision.set_headers)  # type: ignore[union-attr]
    assert sent["traceparent"].startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    assert sent["traceparent"] != parent  # the gateway's own span is the pod's parent
    assert state.trace is not None and state.trace.parent_span_id == "00f067aa0ba902b7"


def test_canonical_name_routes_without_body_rewrite(gateway: Gateway) -> None:
    state, decision = through_body(gateway, CHAT)
    assert isinstance(decision, Continue)
    headers = dict(decision.set_headers)
    assert decision.body is None and decision.clear_route_cache
    assert headers["x-llmgw-route"] == "direct"
    # The pick, then the other pod for Envoy's one retry (override_host tries them in order).
    assert headers[DESTINATION_HEADER] in ("10.0.0.1:8000,10.0.0.2:8000", "10.0.0.2:8000,10.0.0.1:8000")
    assert headers["x-llmgw-pool"] == "general" and "authorization" not in headers


def test_alias_rewrites_model_and_content_length(gateway: Gateway) -> None:
    body = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"top_k":3}'
    _, decision = through_body(gateway, body)
    assert isinstance(decision, Continue) and decision.body is not None
    rewritten = orjson.loads(decision.body)
    assert rewritten == {"model": "llama-3-8b-instruct", "messages": [{"role": "user", "content": "hi"}], "top_k": 3}
    assert dict(decision.set_headers)["content-length"] == str(len(decision.body))


def test_pool_credential_replaces_tenant_key(gateway: Gateway) -> None:
    _, decision = through_body(gateway, b'{"model":"qwen-72b","messages":[{"role":"user","content":"x"}]}',
                               authorization="Bearer sk-tenant")
    assert dict(decision.set_headers)["authorization"] == "Bearer sk-pool-secret"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"not json", 400, "invalid_json"),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found"),
        (b'{"model": "qwen-72b", "messages": [{"role": "user", "content": "x"}], "pad": "' + b"x" * 5000 + b'"}',
         413, "request_too_large"),  # chunked upload with no content-length: caught on the body
    ],
    ids=["invalid-json", "unknown-model", "body-too-large"],
)
def test_body_phase_rejections(gateway: Gateway, body: bytes, status: int, code: str) -> None:
    state, decision = through_body(gateway, body)
    assert error_of(decision) == (status, code)
    assert state.endpoint is None  # nothing picked, nothing to release


def test_least_in_flight_spreads_and_releases(gateway: Gateway) -> None:
    first, _ = through_body(gateway, CHAT)
    second, _ = through_body(gateway, CHAT)
    assert {first.endpoint, second.endpoint} == {"10.0.0.1:8000", "10.0.0.2:8000"}  # one each
    endpoint = first.endpoint
    gateway.feedback.ended(first.id)  # its access-log entry came to this process
    gateway.feedback.ended(first.id)  # a duplicate releases nothing more
    third, _ = through_body(gateway, CHAT)
    assert third.endpoint == endpoint  # the freed endpoint is now the least loaded


def test_picks_whose_entries_went_elsewhere_are_forgotten(gateway: Gateway) -> None:
    first, _ = through_body(gateway, CHAT)
    second, _ = through_body(gateway, CHAT)
    gateway.feedback.running(second.id)  # a periodic entry: still generating
    stale = gateway.feedback.forget_stale(now=10**9)
    assert {d.id for d in stale} == {first.id, second.id} and gateway.feedback.picks == 0


def test_the_decision_rides_as_metadata_with_baggage(gateway: Gateway) -> None:
    from extproc.accounting import Decision

    state, decision = through_body(gateway, CHAT, **{"x-request-id": "req-9"})
    assert isinstance(decision, Continue)
    (namespace, data), = decision.metadata
    carried = Decision.from_metadata(data)
    assert namespace == "llmgw" and carried.id == state.id and carried.request_id == "req-9"
    assert (carried.served_model, carried.pool, carried.endpoint) == ("llama-3-8b-instruct", "general", state.endpoint)
    assert [p.name for p in carried.phases] == ["auth", "tokens", "route"]
    assert dict(decision.set_headers)["baggage"] == "llmgw.request_id=req-9"


def test_client_envoy_headers_never_reach_a_pod(gateway: Gateway) -> None:
    state = gateway.new_request()
    decision = gateway.request_headers(state, post_headers(**{
        "x-envoy-original-dst-host": "10.9.9.9:80", "x-envoy-retry-on": "5xx", "x-envoy-upstream-rq-timeout-ms": "1"}),
        False)
    assert isinstance(decision, Continue)
    assert {"x-envoy-original-dst-host", "x-envoy-retry-on", "x-envoy-upstream-rq-timeout-ms"} <= set(
        decision.remove_headers)


@pytest.mark.parametrize("encoding", ["br", "deflate", "gzip, br", "x-unknown"])
def test_a_content_encoding_envoy_did_not_decode_is_415(gateway: Gateway, encoding: str) -> None:
    state = gateway.new_request()
    reply = gateway.request_headers(state, post_headers(**{"content-encoding": encoding}), False)
    assert isinstance(reply, Reply) and reply.status == 415
    assert b"unsupported_media_type" in reply.body and b"content-encoding" in reply.body


@pytest.mark.parametrize("extra", [
    {f"x-h{i}": "v" for i in range(60)},  # too many: the gateway's own headers would pass Envoy's count
    {"x-big": "a" * 13000},  # too large for a pod's header block
], ids=["count", "bytes"])
def test_too_many_or_too_large_headers_are_431(gateway: Gateway, extra: dict[str, str]) -> None:
    reply = gateway.request_headers(gateway.new_request(), post_headers(**extra), False)
    assert isinstance(reply, Reply) and reply.status == 431 and b"request_header_fields_too_large" in reply.body


def test_an_expectation_never_reaches_the_pod(gateway: Gateway) -> None:
    decision = gateway.request_headers(gateway.new_request(), post_headers(expect="200-ok"), False)
    assert isinstance(decision, Continue) and "expect" in decision.remove_headers
