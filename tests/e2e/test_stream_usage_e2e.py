"""End to end: streams are counted from the pod's own usage chunk, which the client sees only if it
asked for it (extproc adds ``stream_options.include_usage``; envoy.yaml's Lua filter drops the chunk)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import orjson
import pytest

from extproc.launcher import StackInfo
from extproc.ledger import UsageRecord, read_file
from tests.e2e.conftest import MODEL, TENANT_KEY, small_stack
from tests.e2e.test_gateway_e2e import access_record, pod_request_with_id
from tests.helpers import wait_for

HELLO = [{"role": "user", "content": "Say hello to the gateway."}]
STRIP_HEADER = "x-llmgw-strip-usage"


@pytest.fixture(scope="module")
def client(stack: StackInfo) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=TENANT_KEY, max_retries=0, timeout=30)


def ledger_record(stack: StackInfo, request_id: str, timeout: float = 10.0) -> UsageRecord:
    # Usually there in milliseconds (the access-log entry is sent at once); generous for a loaded machine.
    found = wait_for(f"a ledger record for {request_id}", lambda: [
        r for r in read_file(stack.log_dir.parent / "usage.jsonl") if r.request_id == request_id], timeout, 0.05)
    assert len(found) == 1
    return found[0]


def test_stream_without_include_usage_is_counted_exactly(stack: StackInfo, client: openai.OpenAI) -> None:
    request_id = f"strip-{uuid.uuid4()}"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HELLO, stream=True, max_tokens=17, seed=3, extra_body={"ignore_eos": True},
        extra_headers={"x-request-id": request_id}))
    # The client gets exactly what it asked for: content chunks only, no usage chunk.
    assert chunks and all(c.choices and c.usage is None for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=17, seed=3,
                                           extra_body={"ignore_eos": True})
    assert text == plain.choices[0].message.content  # the text is intact
    assert plain.usage is not None

    # The pod was asked for usage and never saw the gateway's mark.
    seen = pod_request_with_id(stack, request_id)
    assert seen["body"]["stream_options"] == {"include_usage": True}  # type: ignore[index]
    assert STRIP_HEADER not in seen["headers"]  # type: ignore[operator]

    record = ledger_record(stack, request_id)
    assert (record.input_tokens, record.output_tokens) == (plain.usage.prompt_tokens, 17)
    assert record.usage_estimated is False
    access = access_record(stack, request_id)
    assert access["gen_ai.usage.output_tokens"] == 17 and access["llmgw.usage.estimated"] is False


def test_client_that_asks_for_usage_gets_it_once(stack: StackInfo, client: openai.OpenAI) -> None:
    request_id = f"keep-{uuid.uuid4()}"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HELLO, stream=True, stream_options={"include_usage": True}, max_tokens=9,
        extra_body={"ignore_eos": True}, extra_headers={"x-request-id": request_id}))
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 9
    assert chunks[-1].choices == [] and chunks[-1].usage == usage[0]  # last, as OpenAI sends it
    assert STRIP_HEADER not in pod_request_with_id(stack, request_id)["headers"]  # type: ignore[operator]
    record = ledger_record(stack, request_id)
    assert (record.input_tokens, record.output_tokens, record.usage_estimated) == (
        usage[0].prompt_tokens, 9, False)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_raw_stream_still_ends_with_done(stack: StackInfo, path: str) -> None:
    prompt: dict[str, Any] = {"messages": HELLO} if path.endswith("chat/completions") else {"prompt": "Once"}
    body = {"model": MODEL, **prompt, "stream": True, "max_tokens": 5}
    with httpx.stream("POST", f"{stack.base_url}{path}", json=body, timeout=30,
                      headers={"authorization": f"Bearer {TENANT_KEY}"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read()
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]  # the stream's end, untouched
    assert all(e.startswith(b"data: {") for e in events[:-2])  # whole events only, nothing left over
    assert b'"choices":[]' not in raw and b'"usage":{' not in raw


def test_chunks_still_arrive_spread_over_time(client: openai.OpenAI) -> None:
    started = time.monotonic()
    arrivals: list[float] = []
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, stream=True, max_tokens=24,
                                            extra_body={"ignore_eos": True})
    for chunk in stream:
        assert chunk.choices
        if chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - started)
    assert len(arrivals) >= 20
    # Streamed, not buffered by the Lua filter: the first token came well before the last.
    assert arrivals[-1] - arrivals[0] > 0.15
    assert arrivals[len(arrivals) // 2] < arrivals[-1] - 0.05


# -- a scripted pod: an event cut between two TCP writes, and a pod that ignores include_usage ----

PIECES = ["Hello", " from", " the", " scripted", " pod"]


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class ScriptedPod(BaseHTTPRequestHandler):
    """A vLLM-like streaming pod whose writes are chosen: the usage event arrives in two pieces
    (``"choices":[]`` in the first, ``"usage":{`` in the second), a content event too."""

    protocol_version = "HTTP/1.1"
    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # http.server's name
        body = orjson.loads(self.rfile.read(int(self.headers["content-length"])))
        ScriptedPod.seen.append({"headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
        head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
        honour = (body.get("stream_options") or {}).get("include_usage") and self.headers.get("x-pod") != "ignore"
        usage_null = {"usage": None} if honour else {}  # OpenAI's shape: every other chunk says null
        events = [_event({**head, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}],
                          **usage_null}) for piece in PIECES]
        events.append(_event({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                              **usage_null}))
        if honour:
            events.append(_event({**head, "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 5,
                                                                   "total_tokens": 16}}))
        # Some servers end without the blank line: the Lua filter holds "data: [DONE]" back until the end.
        events.append(b"data: [DONE]" if self.headers.get("x-pod") == "unterminated" else b"data: [DONE]\n\n")
        stream = b"".join(events)
        cuts = sorted({len(b"".join(events[:2])) + 20, *([stream.index(b'"choices":[]') + 14] if honour else [])})
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        start = 0
        for end in [*cuts, len(stream)]:
            piece = stream[start:end]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.flush()
            time.sleep(0.1)  # separate reads on Envoy's side: separate body chunks
            start = end
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedPod)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    pools = [{"name": "local", "endpoints": [f"127.0.0.1:{server.server_address[1]}"]}]
    try:
        with small_stack(tmp_path_factory, "scripted", 0, extra_config={"pools": pools}) as info:
            yield info
    finally:
        server.shutdown()
        server.server_close()


def _scripted_stream(stack: StackInfo, request_id: str, **headers: str) -> list[dict[str, Any]]:
    body = {"model": MODEL, "messages": HELLO, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=30,
                      headers={"x-request-id": request_id, **headers}) as response:
        raw = response.read()
    assert raw.endswith(b"data: [DONE]" if headers.get("x-pod") == "unterminated" else b"data: [DONE]\n\n")
    return [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]


@pytest.mark.parametrize("pod", ["vllm", "unterminated"])
def test_usage_event_cut_between_chunks_is_still_removed(scripted: StackInfo, pod: str) -> None:
    request_id = f"cut-{uuid.uuid4()}"
    events = _scripted_stream(scripted, request_id, **{"x-pod": pod})
    assert [e["choices"][0]["delta"].get("content") for e in events] == [*PIECES, None]
    assert all(e["usage"] is None for e in events)  # the "usage":null chunks pass untouched
    assert ScriptedPod.seen[-1]["body"]["stream_options"] == {"include_usage": True}
    assert STRIP_HEADER not in ScriptedPod.seen[-1]["headers"]
    record = ledger_record(scripted, request_id)
    assert (record.input_tokens, record.output_tokens, record.usage_estimated) == (11, 5, False)


def test_pod_that_ignores_include_usage_is_counted_from_its_events(scripted: StackInfo) -> None:
    request_id = f"ignored-{uuid.uuid4()}"
    events = _scripted_stream(scripted, request_id, **{"x-pod": "ignore"})
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "".join(PIECES)
    record = ledger_record(scripted, request_id)
    # One token per content event (Envoy's Lua filter counted them); the role and finish events hold none.
    assert record.usage_estimated is True and record.output_tokens == len(PIECES)


def test_a_stream_the_client_hangs_up_is_estimated_within_ten_percent(stack: StackInfo) -> None:
    request_id = f"hangup-{uuid.uuid4()}"
    body = {"model": MODEL, "messages": HELLO, "stream": True, "max_tokens": 2000, "ignore_eos": True}
    received = 0
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=30, headers={
            "authorization": f"Bearer {TENANT_KEY}", "x-request-id": request_id}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {") and orjson.loads(line[6:])["choices"][0]["delta"].get("content"):
                received += 1
            if received == 120:
                break  # hang up mid-generation: no usage chunk will ever come
    record = ledger_record(stack, request_id)
    plain = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=TENANT_KEY).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=1)
    assert record.usage_estimated and not record.complete
    # Tokens Envoy forwarded (a few more may have been on their way when the client left) against the
    # 120 the client read; the input counted by the model's own tokenizer, as the pod counts it.
    assert 120 <= record.output_tokens <= 132, record
    assert record.input_tokens == plain.usage.prompt_tokens
