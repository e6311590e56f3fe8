"""Streams ask the pod for their usage: the body analysis adds ``stream_options.include_usage`` and the
router marks the request for Envoy's Lua filter, which drops the usage chunk the client did not ask for."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from extproc.gateway import Gateway
from extproc.routing.picker import Picker
from extproc.stages.route import STRIP_USAGE_HEADER
from extproc.steps import Continue
from tests.helpers import deterministic_id_source, make_config, post_headers

MODEL, ALIAS = "llama-3-8b-instruct", "gpt-4o-mini"
HI = [{"role": "user", "content": "hi"}]
ASKED = {"include_usage": True}


def route(body: dict[str, Any], path: str = "/v1/chat/completions") -> Continue:
    gateway = Gateway(make_config(), Picker(random.Random(1)), deterministic_id_source())
    state = gateway.new_request()
    assert isinstance(gateway.request_headers(state, post_headers(path), False), Continue)
    decision = gateway.request_body(state, orjson.dumps(body))
    assert isinstance(decision, Continue), decision
    return decision


@pytest.mark.parametrize(
    ("path", "body", "sent", "marked"),
    [
        pytest.param("/v1/chat/completions", {"model": MODEL, "messages": HI, "stream": True},
                     {"model": MODEL, "messages": HI, "stream": True, "stream_options": ASKED},
                     True, id="stream-without-options-gets-include-usage"),
        pytest.param("/v1/chat/completions",
                     {"model": MODEL, "messages": HI, "stream": True, "stream_options": {"include_usage": False}},
                     {"model": MODEL, "messages": HI, "stream": True, "stream_options": ASKED},
                     True, id="include-usage-false-is-turned-on"),
        pytest.param("/v1/chat/completions",
                     {"model": MODEL, "messages": HI, "stream": True, "stream_options": ASKED},
                     None, False, id="client-asked-itself-untouched"),  # it gets the chunk it asked for
        pytest.param("/v1/chat/completions", {"model": MODEL, "messages": HI}, None, False,
                     id="not-streamed-untouched"),  # usage is in the JSON body
        pytest.param("/v1/chat/completions", {"model": MODEL, "messages": HI, "stream": False}, None, False,
                     id="stream-false-untouched"),
        pytest.param("/v1/chat/completions",
                     {"model": ALIAS, "messages": HI, "stream": True, "stream_options": {"x": 1}},
                     {"model": MODEL, "messages": HI, "stream": True,
                      "stream_options": {"x": 1, "include_usage": True}},
                     True, id="alias-and-usage-in-one-body-other-options-kept"),
        pytest.param("/v1/chat/completions",
                     {"model": MODEL, "messages": HI, "stream": True,
                      "stream_options": {"continuous_usage_stats": True}},
                     None, False, id="continuous-usage-stats-untouched"),  # vLLM would add usage to every chunk
        pytest.param("/v1/completions", {"model": MODEL, "prompt": "Once", "stream": True},
                     {"model": MODEL, "prompt": "Once", "stream": True, "stream_options": ASKED},
                     True, id="streamed-completion-too"),
        pytest.param("/v1/embeddings", {"model": MODEL, "input": "hi"}, None, False, id="embedding-untouched"),
    ],
)
def test_route_asks_streams_for_usage(path: str, body: dict[str, Any], sent: dict[str, Any] | None,
                                      marked: bool) -> None:
    decision = route(body, path)
    headers = dict(decision.set_headers)
    if sent is None:
        assert decision.body is None and "content-length" not in headers
    else:
        assert decision.body is not None and orjson.loads(decision.body) == sent
        assert headers["content-length"] == str(len(decision.body))
    assert (headers.get(STRIP_USAGE_HEADER) == "1") is marked


def test_alias_without_stream_rewrites_only_the_model() -> None:
    decision = route({"model": ALIAS, "messages": HI})
    assert decision.body is not None and orjson.loads(decision.body) == {"model": MODEL, "messages": HI}
    assert STRIP_USAGE_HEADER not in dict(decision.set_headers)


def test_a_client_copy_of_the_mark_is_stripped() -> None:
    gateway = Gateway(make_config(), Picker(random.Random(1)), deterministic_id_source())
    decision = gateway.request_headers(gateway.new_request(), post_headers(**{STRIP_USAGE_HEADER: "1"}), False)
    assert isinstance(decision, Continue) and STRIP_USAGE_HEADER in decision.remove_headers
