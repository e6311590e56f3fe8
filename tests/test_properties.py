"""Property-based: the real gRPC server never crashes or hangs, whatever the body or message order."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import orjson
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.launcher import ProcessGroup
from tests.helpers import CONFIG, post_headers, request_body, request_headers

PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/v1/models/qwen-72b", "/", ""]
MODELS = ["llama-3-8b-instruct", "gpt-4o-mini", "qwen-72b", "unknown", ""]


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pb_grpc.ExternalProcessorStub]:
    run_dir = tmp_path_factory.mktemp("props")
    config = Path(run_dir) / "config.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    group = ProcessGroup(Path(run_dir))
    child = group.spawn("extproc", [sys.executable, "-m", "extproc.app", "--config", str(config), "--port", "0",
                                    "--log-level", "CRITICAL"], env={"POOL_KEY": "k"})
    address = group.wait_ready_line(child, 20)
    channel = grpc.insecure_channel(address)
    yield pb_grpc.ExternalProcessorStub(channel)
    channel.close()
    assert child.proc.poll() is None, "the server died during the property tests"
    group.stop()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                           "content": json_values}, optional={"tool_calls": json_values, "name": json_values}),
    max_size=4,
)
chat_like = st.fixed_dictionaries(
    {"model": st.sampled_from(MODELS) | json_values},
    optional={"messages": messages | json_values, "prompt": json_values, "input": json_values,
              "stream": json_values, "max_tokens": json_values, "temperature": json_values, "n": json_values,
              "tools": json_values, "response_format": json_values, "stop": json_values},
).map(orjson.dumps)
bodies = st.binary(max_size=300) | json_values.map(orjson.dumps) | chat_like


def _run(stub: pb_grpc.ExternalProcessorStub, sequence: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    """Send the sequence, half-close, collect answers; an INVALID_ARGUMENT abort is a fine outcome."""
    try:
        return list(stub.Process(iter(sequence), timeout=10))
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error  # not a crash, not a hang
        return []


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS[:3]), body=bodies)
def test_any_body_gets_a_routing_decision_or_an_openai_error(stub: pb_grpc.ExternalProcessorStub, path: str,
                                                             body: bytes) -> None:
    responses = _run(stub, [request_headers(post_headers(path)), request_body(body)])
    assert len(responses) == 2
    final = responses[1]
    if final.HasField("immediate_response"):
        reply = final.immediate_response
        assert reply.status.code in (400, 404, 413)
        error = orjson.loads(reply.body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    else:
        assert final.request_body.response.clear_route_cache


phases = st.sampled_from(["request_headers", "request_body", "request_trailers", "response_headers",
                          "response_body", "response_trailers"])
header_maps = st.fixed_dictionaries(
    {":method": st.sampled_from(["GET", "POST", "PUT", ""]), ":path": st.sampled_from(PATHS) | st.text(max_size=30)},
    optional={"content-type": st.sampled_from(["application/json", "text/plain", ""]),
              "content-length": st.sampled_from(["0", "10", "99999999", "-1", "x"]),
              "x-llmgw-route": st.just("batch"), "traceparent": st.text(max_size=60),
              "x-request-id": st.text(max_size=40)},
)


@st.composite
def message(draw: st.DrawFn) -> pb.ProcessingRequest:
    phase = draw(phases)
    eos = draw(st.booleans())
    observe = draw(st.booleans())  # not special: only Envoy's observability-mode filters set it
    if phase.endswith("headers"):
        headers = request_headers(draw(header_maps), eos).request_headers
        return pb.ProcessingRequest(**{phase: headers}, observability_mode=observe)
    if phase.endswith("body"):
        return pb.ProcessingRequest(**{phase: pb.HttpBody(body=draw(bodies), end_of_stream=eos)},
                                    observability_mode=observe)
    return pb.ProcessingRequest(**{phase: pb.HttpTrailers()}, observability_mode=observe)


def _decides(message: pb.ProcessingRequest, response: pb.ProcessingResponse) -> bool:
    """The request is decided by this answer: refused or answered (an ImmediateResponse), or
    forwarded whole (headers without a body, the whole body, the trailers)."""
    if response.HasField("immediate_response"):
        return True
    kind = message.WhichOneof("request")
    if kind in ("request_headers", "request_body"):
        return getattr(message, kind).end_of_stream
    return kind == "request_trailers"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=st.lists(message(), max_size=6))
def test_any_message_order_is_answered_or_refused_cleanly(stub: pb_grpc.ExternalProcessorStub,
                                                         sequence: list[pb.ProcessingRequest]) -> None:
    responses = _run(stub, sequence)
    assert len(responses) <= len(sequence)
    for i, (sent, response) in enumerate(zip(sequence, responses, strict=False)):
        kind = response.WhichOneof("response")
        assert kind in (sent.WhichOneof("request"), "immediate_response")  # each message answered in turn
        assert not kind.startswith("response_")  # the stream ends before any response phase
        if _decides(sent, response):
            assert i == len(responses) - 1  # the stream ends with the decision


CHAT = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize(
    ("sequence", "answered"),
    [
        pytest.param([request_headers({":method": "GET", ":path": "/v1/models"}, True), request_body(CHAT)],
                     ["immediate_response"], id="answered-then-nothing"),
        pytest.param([request_headers(post_headers()), request_body(CHAT),
                      pb.ProcessingRequest(response_headers=pb.HttpHeaders())],
                     ["request_headers", "request_body"], id="forwarded-body-then-nothing"),
        pytest.param([request_headers(post_headers()), request_body(CHAT, end_of_stream=False),
                      pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
                      pb.ProcessingRequest(response_headers=pb.HttpHeaders())],
                     ["request_headers", "request_body", "request_trailers"], id="trailers-end-the-stream"),
    ],
)
def test_the_stream_ends_with_the_decision(stub: pb_grpc.ExternalProcessorStub,
                                           sequence: list[pb.ProcessingRequest], answered: list[str]) -> None:
    # Messages after the decision are never read: the server has closed the stream (not an error).
    assert [r.WhichOneof("response") for r in _run(stub, sequence)] == answered


def test_server_still_serves_after_the_storm(stub: pb_grpc.ExternalProcessorStub) -> None:
    responses = _run(stub, [request_headers(post_headers()), request_body(CHAT)])
    assert responses[1].request_body.response.clear_route_cache
