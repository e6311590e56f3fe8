"""The analysis stage on its own: the body's facts here or in the helper, and semantic routing."""

from __future__ import annotations

import orjson

from extproc.api import ApiError, Operation
from extproc.body import analyze
from extproc.config import parse_config
from extproc.routing.intents import Intent, IntentMatch
from extproc.stages.analysis import BodyAnalysis
from extproc.state import RequestState, new_state
from extproc.steps import Analyze, Classify, Reply
from tests.helpers import make_config

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


def _state() -> RequestState:
    state = new_state("1")
    state.operation = Operation.CHAT
    return state


def test_a_small_body_is_analyzed_here_and_an_alias_is_forwarded_as_the_served_name() -> None:
    state = _state()
    assert BodyAnalysis(make_config()).request_body(state, orjson.dumps(CHAT)) is None  # on to resolution
    facts = state.facts
    assert facts is not None and facts.model == "gpt-4o-mini" and facts.served == "llama-3-8b-instruct"
    assert state.new_body is not None and orjson.loads(state.new_body)["model"] == "llama-3-8b-instruct"
    assert [p.name for p in state.phases] == ["tokens"]


def test_a_large_body_goes_to_the_helper_and_comes_back_the_same() -> None:
    analysis = BodyAnalysis(make_config(offload_body_bytes=64))
    body = orjson.dumps(CHAT | {"messages": [{"role": "user", "content": "x" * 200}]})
    state = _state()
    asked = analysis.request_body(state, body)
    assert isinstance(asked, Analyze) and asked.body == body
    result = analyze(asked.operation, asked.body, asked.served_names, asked.limits, None, asked.routing)
    assert analysis.analyzed(state, result) is None and state.facts == result.facts


def test_a_busy_helper_is_a_503_with_retry_after_and_a_bad_body_a_400() -> None:
    state = _state()
    busy = analysis_reply(state, ApiError(503, "busy", type="server_error", code="service_unavailable"))
    assert busy.status == 503 and ("retry-after", "1") in busy.headers
    bad = BodyAnalysis(make_config()).request_body(_state(), b'{"model": "gpt-4o-mini"}')
    assert isinstance(bad, Reply) and bad.status == 400


def analysis_reply(state: RequestState, error: ApiError) -> Reply:
    reply = BodyAnalysis(make_config()).analyzed(state, error)
    assert isinstance(reply, Reply) and state.rejected is error
    return reply


def test_trailers_without_a_body_are_an_empty_request() -> None:
    reply = BodyAnalysis(make_config()).request_trailers(_state())
    assert isinstance(reply, Reply) and reply.status == 400


INTENTS = {
    "pools": [{"name": "general", "endpoints": ["10.0.0.1:8000"]}, {"name": "code", "endpoints": ["10.0.1.1:8000"]}],
    "models": [{"name": "chat-model", "pool": "general"}, {"name": "code-model", "pool": "code"}],
    "intents": {"embedder": {"kind": "hashing"}, "default": {"model": "chat-model"},
                "routes": [{"name": "coding", "model": "code-model", "examples": ["fix my python bug"]}]},
}


def test_auto_is_classified_and_the_chosen_model_is_put_back_in_the_body() -> None:
    analysis = BodyAnalysis(parse_config(INTENTS, env={}))
    state = _state()
    asked = analysis.request_body(state, orjson.dumps({"model": "auto", "messages": [{"role": "user",
                                                                                      "content": "fix this bug"}]}))
    assert isinstance(asked, Classify) and "fix this bug" in asked.text
    intent = Intent("coding", ("fix my python bug",), "code-model", "code")
    analysis.classified(state, IntentMatch(intent, 0.9, 0.1, "coding"))
    assert state.facts is not None and (state.facts.served, state.facts.pool) == ("code-model", "code")
    assert state.facts.intent == "coding" and state.facts.score == 0.9
    assert state.new_body is not None and orjson.loads(state.new_body)["model"] == "code-model"


def test_no_intent_matching_keeps_the_default_route() -> None:
    analysis = BodyAnalysis(parse_config(INTENTS, env={}))
    state = _state()
    analysis.request_body(state, orjson.dumps({"model": "auto", "messages": [{"role": "user", "content": "hello"}]}))
    analysis.classified(state, None)  # the embedder was busy
    assert state.facts is not None and state.facts.served == "chat-model" and state.facts.intent == "default"
    assert state.new_body is not None and orjson.loads(state.new_body)["model"] == "chat-model"
