"""The route stage on its own: the pods, the headers Envoy's routes and filters read, the new body,
and the decision metadata that brings the request back to settlement."""

from __future__ import annotations

import random

import orjson

from extproc.accounting import NAMESPACE, Decision
from extproc.api import Operation
from extproc.body import BodyLimits, analyze
from extproc.config import GatewayConfig, parse_config
from extproc.routing.picker import Picker
from extproc.routing.router import Router
from extproc.stages.route import Route
from extproc.state import RequestState, new_state
from extproc.steps import Continue
from extproc.telemetry.tracecontext import continue_or_start
from extproc.validation import DESTINATION_HEADER
from tests.helpers import deterministic_id_source

DOCUMENT = {
    "server": {"coordinator": "127.0.0.1:8081"},
    "pools": [{"name": "big", "endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"], "credential": {"env": "KEY"},
               "batching": {"enabled": True}},
              {"name": "small", "endpoints": ["10.0.1.1:8000"]}],
    "models": [{"name": "big-model", "pool": "big", "fallback": ["small-model"], "chat_template": "chatml"},
               {"name": "small-model", "pool": "small"}],
}


def _route(document: dict = DOCUMENT) -> tuple[Route, GatewayConfig]:
    config = parse_config(document, env={"KEY": "sk-pool"})
    router = Router(Picker(random.Random(0)))
    router.configure(config)
    return Route(router), config


def _state(config: GatewayConfig, **body: object) -> RequestState:
    state = new_state("1")
    state.operation, state.request_id = Operation.CHAT, "req-1"
    state.trace = continue_or_start(None, deterministic_id_source())
    raw = orjson.dumps({"model": "big-model", "messages": [{"role": "user", "content": "hi"}], **body})
    analysis = analyze(Operation.CHAT, raw, {"big-model": "big-model", "small-model": "small-model"}, BodyLimits())
    state.facts, state.new_body = analysis.facts, analysis.body
    state.model = config.models_by_name["big-model"]
    state.pool = state.model.pool
    return state


def test_a_direct_route_names_the_pod_its_retry_and_the_spare_models_pod_tried_last() -> None:
    route, config = _route()
    state = _state(config, n=2)  # two choices cannot share a merged call
    state.spare = (config.models_by_name["small-model"], config.pools["small"])
    answer = route.route(state)
    assert isinstance(answer, Continue) and answer.clear_route_cache
    headers = dict(answer.set_headers)
    hosts = headers[DESTINATION_HEADER].split(",")
    assert set(hosts[:2]) == {"10.0.0.1:8000", "10.0.0.2:8000"} and hosts[2] == "10.0.1.1:8000"
    assert headers["x-llmgw-route"] == "direct" and headers["x-envoy-max-retries"] == "2"
    assert headers["x-llmgw-fallback"] == "10.0.1.1:8000 small-model"
    assert headers["authorization"] == "Bearer sk-pool"
    assert headers["x-llmgw-decision"] == "rule=model; model=big-model; pool=big"
    assert "llmgw.request_id=req-1" in headers["baggage"]
    assert state.endpoint == hosts[0] and [p.name for p in state.phases] == ["route"]


def test_the_decision_travels_as_metadata_and_the_pick_is_held_until_settled() -> None:
    route, config = _route()
    state = _state(config, stream=True)
    answer = route.route(state)
    (namespace, metadata), = answer.metadata
    assert namespace == NAMESPACE
    decision = Decision.from_metadata(metadata)
    assert decision.id == "1" and decision.endpoint == state.endpoint and decision.pool == "big"
    assert route.router.feedback.picks == 1
    # the usage chunk asked for (the ledger's exact count), stripped before the client
    assert dict(answer.set_headers)["x-llmgw-strip-usage"] == "1"
    assert answer.body is not None and orjson.loads(answer.body)["stream_options"] == {"include_usage": True}
    assert dict(answer.set_headers)["content-length"] == str(len(answer.body))
    assert state.new_body is None  # sent once


def test_a_batchable_request_goes_to_the_coordinator_while_it_answers_its_probes() -> None:
    route, config = _route()
    headers = dict(route.route(_state(config)).set_headers)
    assert headers["x-llmgw-route"] == "batch" and headers["x-llmgw-batch"].startswith("wait_ms=")
    assert "x-llmgw-fallback" not in headers  # the coordinator's own pods answer, no spare model
    route.router.health.probed("127.0.0.1:8081", False)
    assert dict(route.route(_state(config)).set_headers)["x-llmgw-route"] == "direct"


def test_a_chat_is_merged_only_where_a_template_is_known_never_with_a_guessed_one() -> None:
    untemplated = {**DOCUMENT, "models": [{"name": "big-model", "pool": "big"}, DOCUMENT["models"][1]]}
    route, config = _route(untemplated)
    assert dict(route.route(_state(config)).set_headers)["x-llmgw-route"] == "direct"  # vLLM renders nothing for us
    merged = {**DOCUMENT["pools"][0], "engine": "llamacpp", "batching": {"enabled": True, "merge": "always"}}
    llamacpp = {**untemplated, "pools": [merged, DOCUMENT["pools"][1]]}
    route, config = _route(llamacpp)
    assert dict(route.route(_state(config)).set_headers)["x-llmgw-route"] == "batch"  # its /apply-template does


def test_a_batching_pool_merges_only_on_engines_where_merged_calls_pay_unless_told_always() -> None:
    llamacpp = {**DOCUMENT, "pools": [{**DOCUMENT["pools"][0], "engine": "llamacpp"}, DOCUMENT["pools"][1]]}
    route, config = _route(llamacpp)  # llama.cpp's slots batch already: merging measured no gain
    assert dict(route.route(_state(config)).set_headers)["x-llmgw-route"] == "direct"
    llamacpp["pools"][0]["batching"] = {"enabled": True, "merge": "always"}
    route, config = _route(llamacpp)
    assert dict(route.route(_state(config)).set_headers)["x-llmgw-route"] == "batch"
