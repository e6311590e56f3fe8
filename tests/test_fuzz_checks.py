"""The fuzzer's own pieces, with no network: the answer checker, the case generator, the tally."""

from __future__ import annotations

import json
import statistics

import pytest

from bench.fuzz import (
    DEFAULT_SEED,
    Answer,
    Case,
    Tally,
    Violation,
    check_answer,
    generate_cases,
    make_case,
    operation_of,
)

JSON = (("content-type", "application/json"),)
CHAT = Case(0, "body.valid", "POST", "/v1/chat/completions", JSON,
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
STREAM = Case(1, "body.valid", "POST", "/v1/chat/completions", JSON,
              b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}')


def error(status: int, code: str | None, *extra: tuple[str, str]) -> Answer:
    body = json.dumps({"error": {"message": "nope", "type": "invalid_request_error", "param": None, "code": code}})
    return Answer(status, (*JSON, *extra), body.encode())


def sse(*events: dict[str, object], done: bool = True) -> Answer:
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + ("data: [DONE]\n\n" if done else "")
    return Answer(200, (("content-type", "text/event-stream"),), text.encode())


CHUNK = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
USAGE_CHUNK = {"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 1}}
COMPLETION = {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}


@pytest.mark.parametrize(
    ("case", "answer", "kind"),
    [
        (CHAT, Answer(504, (("content-length", "0"),), b""), "504 status not documented"),  # Envoy's empty timeout
        (CHAT, Answer(503, (("content-type", "text/plain"),), b"no healthy upstream"),
         "503 error content-type text/plain"),
        (CHAT, error(500, "internal_error"), "500 status not documented"),  # documented, but a bug all the same
        (CHAT, Answer(500, (("content-type", "text/plain"), ("x-envoy-upstream-service-time", "3")), b"oops"),
         "500 status not documented (from pod"),
        (CHAT, Answer(404, (), b""), "404 error content-type missing"),
        (CHAT, Answer(400, JSON, b""), "400 error body empty"),
        (CHAT, Answer(400, JSON, b"Bad Request"), "400 error body not JSON"),
        (CHAT, Answer(400, JSON, b'{"message": "x"}'), "400 error body without an error object"),
        (CHAT, Answer(400, JSON, b'{"error": {"message": "x", "type": "t", "code": null}}'),
         "error object without param"),
        (CHAT, error(503, "no_route"), "503 code no_route is not a documented unavailability"),
        (CHAT, error(405, "method_not_allowed"), "405 without allow"),
        (CHAT, error(429, "rate_limit_exceeded"), "429 without retry-after"),
        (CHAT, Answer(None, failure="hang"), "hang"),
        (CHAT, Answer(None, failure="no answer: reset"), "no answer"),
        (CHAT, Answer(200, (("content-type", "text/event-stream"),), b"data: [DONE]\n\n"),
         "SSE answer to a request without"),
        (STREAM, Answer(200, JSON, json.dumps(COMPLETION).encode()), "JSON answer to a request with stream: true"),
        (STREAM, sse(CHUNK, done=False), "without a final data: [DONE]"),
        (STREAM, sse(CHUNK, USAGE_CHUNK), "usage chunk the client did not ask for"),
        (STREAM, sse({"error": {"message": "x"}}), "SSE event is an error"),
        (STREAM, Answer(200, JSON, b'{"object": "chat.comp', "RemoteProtocolError: peer closed"), "200 answer cut off"),
        (CHAT, Answer(200, JSON, b'{"object": "list", "data": []}'), "not a chat.completion object"),
        (CHAT, Answer(200, JSON, b'{"object": "chat.completion", "choices": []}'), "without choices"),
        (Case(2, "method.path", "GET", "/health"), Answer(200, JSON, b"{}"), "path the gateway does not serve"),
    ],
    ids=["empty-504", "text-503", "json-500", "pod-500", "empty-404", "empty-json-400", "text-in-json-400",
         "no-error-object", "no-param", "503-no-route", "405-no-allow", "429-no-retry-after", "hang", "no-answer",
         "sse-unasked", "json-for-stream", "sse-no-done", "sse-usage-unasked", "sse-error-event", "cut-off",
         "wrong-object", "no-choices", "success-on-unserved-path"],
)
def test_checker_flags(case: Case, answer: Answer, kind: str) -> None:
    violation = check_answer(case, answer)
    assert violation is not None and kind in violation.kind, violation


@pytest.mark.parametrize(
    ("case", "answer"),
    [
        (CHAT, error(400, "invalid_json")),
        (CHAT, error(401, "invalid_api_key", ("www-authenticate", "Bearer"))),
        (CHAT, Answer(400, (("content-type", "application/json; charset=utf-8"),),  # a pod's 400: code is an int
                      b'{"error": {"message": "bad", "type": "BadRequestError", "param": null, "code": 400}}')),
        (CHAT, error(503, "service_unavailable", ("retry-after", "1"))),
        (CHAT, error(503, "upstream_unavailable")),
        (CHAT, error(429, "rate_limit_exceeded", ("retry-after", "3"))),
        (CHAT, error(405, "method_not_allowed", ("allow", "POST"))),
        (CHAT, Answer(200, JSON, json.dumps(COMPLETION).encode())),
        (STREAM, sse(CHUNK, CHUNK)),
        (Case(3, "body.valid", "POST", "/v1/chat/completions", JSON,
              b'{"stream": true, "stream_options": {"include_usage": true}}'), sse(CHUNK, USAGE_CHUNK)),
        (Case(4, "method.path", "HEAD", "/v1/models"), Answer(405, (*JSON, ("allow", "GET")), b"")),  # HEAD: no body
        (Case(5, "method.path", "GET", "/v1/models"), Answer(200, JSON, b'{"object": "list", "data": [{"id": "m", '
                                                                        b'"object": "model"}]}')),
        (Case(6, "raw.short_body", "POST", "/v1/chat/completions", no_answer_ok=True),
         Answer(None, failure="no answer: closed")),  # a body that never ends: closing is fine
    ],
    ids=["openai-400", "openai-401", "pod-400-int-code", "503-service-unavailable", "503-upstream-unavailable",
         "429", "405", "chat-json", "chat-sse", "sse-usage-asked", "head-405", "models", "broken-framing-closed"],
)
def test_checker_accepts(case: Case, answer: Answer) -> None:
    assert check_answer(case, answer) is None


@pytest.mark.parametrize(
    ("method", "target", "operation"),
    [("POST", "/v1/chat/completions?x=1", "chat"), ("GET", "/v1/models/m", "model"), ("GET", "/v1/models/", None),
     ("GET", "http://evil.example/v1/models", "models"), ("PUT", "/v1/embeddings", None), ("POST", "*", None)],
)
def test_operation_of(method: str, target: str, operation: str | None) -> None:
    assert operation_of(method, target) == operation


def test_cases_are_the_same_for_a_seed_and_differ_across_seeds() -> None:
    assert list(generate_cases(7, 200)) == list(generate_cases(7, 200))
    assert make_case(7, 150) == list(generate_cases(7, 51, start=100))[50]  # case i does not depend on the others
    assert list(generate_cases(7, 50)) != list(generate_cases(8, 50))


def test_cases_cover_every_generator_and_stay_mostly_small() -> None:
    cases = list(generate_cases(DEFAULT_SEED, 3000))
    kinds = {c.kind for c in cases}
    for expected in ("body.valid", "body.deep_nesting", "body.long_array", "body.not_json", "body.truncated",
                     "body.raw_number", "body.duplicate_key", "body.bom_encoding", "body.as_strings",
                     "headers.content_type", "headers.content_encoding", "headers.internal", "headers.many",
                     "headers.long_value", "headers.auth", "headers.chunked", "method.path", "method.raw_target",
                     "raw.options_star", "raw.content_length", "raw.chunked", "raw.request_line"):
        assert expected in kinds
    assert {c.method for c in cases} >= {"GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH"}
    assert statistics.median(c.size for c in cases) < 2048
    nesting = [c for c in cases if c.kind == "body.deep_nesting"]
    assert max(c.body.count(b"[") + c.body.count(b"{") for c in nesting) > 1500  # up to 2000 levels


def test_tally_groups_by_kind_and_keeps_the_smallest_repro() -> None:
    tally = Tally(seed=1)
    big = Case(0, "body.valid", "POST", "/v1/chat/completions", JSON, b"x" * 500)
    small = Case(1, "body.truncated", "POST", "/v1/chat/completions", JSON, b"x")
    for case in (big, small):
        tally.add(case, Answer(500), Violation("500 status not documented", "d"))
    tally.add(CHAT, error(400, "invalid_json"), None)
    report = tally.report()
    assert report["violations"] == 2 and report["answers"] == {"400": 1, "500": 2}
    (kind,) = report["violation_kinds"]
    assert kind["count"] == 2 and kind["repro"]["case"] == 1
    assert kind["repro"]["replay"] == "python -m bench.fuzz --seed 1 --replay 1"
