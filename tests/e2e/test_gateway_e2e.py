"""End to end: the official openai client -> real Envoy -> extproc -> simulated vLLM pods."""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import orjson
import pytest

from extproc.launcher import StackInfo
from extproc.ledger import read_file
from tests.e2e.conftest import MAX_BODY, TENANT_KEY
from tests.helpers import wait_for

MODEL = "llama-3-8b-instruct"
ALIAS = "gpt-4o-mini"
HELLO = [{"role": "user", "content": "Say hello to the gateway."}]


@pytest.fixture(scope="module")
def client(stack: StackInfo) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=TENANT_KEY, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def http(stack: StackInfo) -> httpx.Client:
    with httpx.Client(base_url=stack.base_url, timeout=30, headers={"authorization": f"Bearer {TENANT_KEY}"}) as client:
        yield client


def pod_requests(stack: StackInfo) -> list[dict[str, object]]:
    """What the pods received, newest last (the simulator's --record)."""
    seen: list[dict[str, object]] = []
    for url in stack.pod_urls["local"]:
        seen += httpx.get(f"{url}/debug/requests").json()["requests"]
    return seen


def pod_request_with_id(stack: StackInfo, request_id: str) -> dict[str, object]:
    for record in pod_requests(stack):
        headers = {k.lower(): v for k, v in record["headers"].items()}  # type: ignore[union-attr]
        if headers.get("x-request-id") == request_id:
            return {**record, "headers": headers}
    raise AssertionError(f"no pod saw request {request_id}")


@pytest.mark.parametrize(
    ("headers", "path"),
    [
        ({}, "/v1/chat/completions"),  # no key at all
        ({"authorization": "Bearer sk-not-a-key"}, "/v1/chat/completions"),  # unknown key
        ({"authorization": f"Basic {TENANT_KEY}"}, "/v1/chat/completions"),  # not Bearer
        ({}, "/v1/models"),  # listing models needs a key too
    ],
    ids=["missing", "unknown", "wrong-scheme", "models"],
)
def test_bad_keys_are_401(stack: StackInfo, headers: dict[str, str], path: str) -> None:
    body = {"model": MODEL, "messages": HELLO}
    method = "GET" if path == "/v1/models" else "POST"
    response = httpx.request(method, f"{stack.base_url}{path}", json=body if method == "POST" else None,
                             headers=headers, timeout=10)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert TENANT_KEY not in response.text


def test_openai_client_with_a_wrong_key(stack: StackInfo) -> None:
    wrong = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.chat.completions.create(model=MODEL, messages=HELLO)
    assert caught.value.code == "invalid_api_key"


def test_models_list(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS


def test_plain_chat(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, seed=3)
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 12
    assert completion.usage.prompt_tokens > 5


def test_streamed_chat_arrives_spread_over_time(client: openai.OpenAI) -> None:
    started = time.monotonic()
    arrivals: list[float] = []
    text = ""
    usage = None
    stream = client.chat.completions.create(
        model=ALIAS, messages=HELLO, stream=True, stream_options={"include_usage": True},
        max_tokens=24, extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - started)
            text += chunk.choices[0].delta.content
        if chunk.usage:
            usage = chunk.usage
    assert len(arrivals) >= 20 and text
    assert usage is not None and usage.completion_tokens == 24
    # Spread, not all at the end: the first token came well before the last (each decode step is ~15 ms).
    assert arrivals[-1] - arrivals[0] > 0.15
    assert arrivals[len(arrivals) // 2] < arrivals[-1] - 0.05


def test_completions_with_a_list_of_prompts(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=ALIAS, prompt=["The sky is", "Grass is"], max_tokens=5, n=2)
    assert sorted(choice.index for choice in completion.choices) == [0, 1, 2, 3]
    assert all(choice.text for choice in completion.choices)


def test_streamed_completion(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices)


def test_identity_headers_reach_pod_and_client(stack: StackInfo, client: openai.OpenAI) -> None:
    request_id = f"e2e-{uuid.uuid4()}"
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    raw = client.chat.completions.with_raw_response.create(
        model=ALIAS, messages=HELLO, max_tokens=4, extra_headers={"x-request-id": request_id, "traceparent": parent})
    assert raw.headers["x-request-id"] == request_id
    returned = raw.headers["traceparent"]
    assert returned.split("-")[1] == "4bf92f3577b34da6a3ce929d0e0e4736" and returned != parent
    seen = pod_request_with_id(stack, request_id)
    assert seen["headers"]["traceparent"] == returned  # type: ignore[index]
    assert seen["body"]["model"] == MODEL  # type: ignore[index]  # the alias was rewritten


def test_generated_request_id_when_client_sends_none(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 2})
    assert response.status_code == 200
    assert len(response.headers["x-request-id"]) == 36
    assert response.headers["traceparent"].startswith("00-")


def test_spoofed_internal_headers_are_ignored(stack: StackInfo, http: httpx.Client) -> None:
    request_id = f"spoof-{uuid.uuid4()}"
    response = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": HELLO, "max_tokens": 2},
        headers={"x-request-id": request_id, "x-llmgw-route": "batch", "x-llmgw-tenant": "root",
                 "x-gateway-destination-endpoint": "127.0.0.1:1", "x-api-key": TENANT_KEY},
    )
    assert response.status_code == 200, response.text  # routed by extproc, not to 127.0.0.1:1 or batch
    headers = pod_request_with_id(stack, request_id)["headers"]
    assert "authorization" not in headers and "x-api-key" not in headers  # type: ignore[operator]  # keys stay here
    assert headers["x-llmgw-tenant"] == "team-a"  # type: ignore[index]  # the real tenant, not the forged one
    assert headers["x-llmgw-route"] == "direct"  # type: ignore[index]
    pods = {u.removeprefix("http://") for u in stack.pod_urls["local"]}
    assert set(headers["x-gateway-destination-endpoint"].split(",")) == pods  # type: ignore[index]  # pick, fallback


def _error(response: httpx.Response) -> dict[str, object]:
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers.get("x-request-id")
    return response.json()["error"]


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "code", "param"),
    [
        ("POST", "/v1/chat/completions", b"{not json", {}, 400, "invalid_json", None),
        ("POST", "/v1/chat/completions", b'{"model": "llama-3-8b-instruct"}', {}, 400,
         "missing_required_parameter", "messages"),
        ("POST", "/v1/chat/completions", b'{"model": "llama-3-8b-instruct", "messages": [{"role": "user", '
         b'"content": 5}]}', {}, 400, "invalid_type", "messages[0].content"),
        ("POST", "/v1/chat/completions", b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}',
         {}, 404, "model_not_found", "model"),
        ("POST", "/v1/chat/completions", b"x" * (MAX_BODY + 1), {}, 413, "request_too_large", None),
        ("POST", "/v1/chat/completions", b"model=x", {"content-type": "application/x-www-form-urlencoded"},
         415, "unsupported_media_type", None),
        ("POST", "/v1/images/generations", b"{}", {}, 404, "unknown_url", None),
        ("GET", "/v1/chat/completions", None, {}, 405, "method_not_allowed", None),
        ("POST", "/v1/models", b"{}", {}, 405, "method_not_allowed", None),
    ],
    ids=["invalid-json", "missing-field", "ill-typed-field", "unknown-model", "too-large", "form-encoded",
         "unknown-path", "wrong-method", "post-models"],
)
def test_errors(http: httpx.Client, method: str, path: str, body: bytes | None, headers: dict[str, str],
                status: int, code: str, param: str | None) -> None:
    response = http.request(method, path, content=body, headers={"content-type": "application/json", **headers})
    assert response.status_code == status, response.text
    error = _error(response)
    assert (error["code"], error["param"]) == (code, param)
    assert error["message"] and error["type"]


def test_oversize_chunked_body_is_413(http: httpx.Client) -> None:
    def chunks():  # no content-length: the limit is enforced on the buffered body
        yield b'{"model": "llama-3-8b-instruct", "messages": [{"role": "user", "content": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"a" * 1024
        yield b'"}]}'

    response = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert _error(response)["code"] == "request_too_large"


def test_oversize_chunked_body_beyond_grpc_default_is_413(http: httpx.Client) -> None:
    def chunks():  # 2 MiB: past the old gRPC limit of max_body_bytes + 1 MiB
        for _ in range(2048):
            yield b"b" * 1024

    response = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text
    assert _error(response)["code"] == "request_too_large"


def test_openai_client_sees_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-9", messages=HELLO)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=HELLO, temperature=9)
    assert bad.value.param == "temperature"


def test_multimodal_and_tools_pass_through(stack: StackInfo, client: openai.OpenAI) -> None:
    request_id = f"mm-{uuid.uuid4()}"
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Describe"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}},
    ]}]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="auto", max_tokens=3,
                                   response_format={"type": "json_object"}, extra_headers={"x-request-id": request_id})
    body = pod_request_with_id(stack, request_id)["body"]
    assert body["tools"] == tools and body["messages"] == messages  # type: ignore[index]


def test_embeddings_route(client: openai.OpenAI) -> None:
    result = client.embeddings.create(model=ALIAS, input=["alpha", "beta"])
    assert [item.index for item in result.data] == [0, 1]
    assert len(result.data[0].embedding) > 0


def test_large_request_body_passes(client: openai.OpenAI) -> None:
    big = "word " * 3000  # 15 KB, ~3000 tokens: fits the pod's 8192-token context
    completion = client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": big}], max_tokens=2)
    assert completion.usage is not None and completion.usage.prompt_tokens > 1000


def test_concurrent_streams(client: openai.OpenAI) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> str:
        stream = client.chat.completions.create(model=MODEL, messages=HELLO, stream=True, max_tokens=6, seed=i)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, range(32)))
    assert all(texts)


def test_body_without_usage_chunk_still_streams(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": HELLO, "stream": True, "max_tokens": 4}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert all("usage" not in orjson.loads(line[6:]) or orjson.loads(line[6:])["usage"] is None
               for line in lines[:-1])


def access_record(stack: StackInfo, request_id: str, timeout: float = 5.0) -> dict[str, object]:
    """The JSON access record of a request (written by whichever worker settled it), from the logs."""
    def found() -> dict[str, object] | None:
        for log in stack.log_dir.glob("extproc-*.log"):
            for line in log.read_text().splitlines():
                if "llmgw.access" in line and request_id in line:
                    return orjson.loads(line.partition("llmgw.access ")[2])
        return None

    return wait_for(f"the access record of {request_id}", found, timeout, interval=0.05)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_access_log_records_usage_and_route(stack: StackInfo, client: openai.OpenAI, stream: bool) -> None:
    request_id = f"obs-{uuid.uuid4()}"
    asked = {"model": ALIAS, "messages": HELLO, "max_tokens": 7, "seed": 1,
             "extra_headers": {"x-request-id": request_id}}
    if stream:
        # Read to the body's last byte: the client's Stream stops at [DONE] and may close the
        # connection before the chunked body's end arrives, which Envoy logs as a hang-up (DC).
        with client.chat.completions.with_streaming_response.create(
                stream=True, stream_options={"include_usage": True}, **asked) as raw:  # type: ignore[arg-type]
            events = [orjson.loads(line[len("data: "):]) for line in raw.iter_lines() if line.startswith("data: {")]
        usage = next(event["usage"] for event in events if event.get("usage"))
    else:
        usage = client.chat.completions.create(**asked).usage.model_dump()  # type: ignore[arg-type, union-attr]
    record = access_record(stack, request_id)
    assert record["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert record["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert record["gen_ai.request.model"] == ALIAS and record["gen_ai.response.model"] == MODEL
    assert record["llmgw.pool"] == "local" and record["llmgw.kind"] == "served"
    destination = pod_request_with_id(stack, request_id)["headers"]["x-gateway-destination-endpoint"]  # type: ignore[index]
    assert record["server.address"] == destination.split(",")[0]  # the pick (a fallback follows it)
    assert record["llmgw.stream"] is stream and record["llmgw.complete"] is True
    assert record["http.response.status_code"] == 200
    ledger = wait_for("the ledger record", lambda: [
        r for r in read_file(stack.log_dir.parent / "usage.jsonl") if r.request_id == request_id], 3.0, interval=0.05)
    assert len(ledger) == 1  # one record per finished request, in the node's file ledger
    assert (ledger[0].tenant, ledger[0].output_tokens) == ("team-a", usage["completion_tokens"])


def test_client_envoy_control_headers_are_ignored(http: httpx.Client) -> None:
    # Honoured, this header would cut the ~0.3 s generation off with a 504 after 1 ms.
    response = http.post("/v1/chat/completions",
                         json={"model": MODEL, "messages": HELLO, "max_tokens": 20, "ignore_eos": True},
                         headers={"x-envoy-upstream-rq-timeout-ms": "1", "x-envoy-retry-on": "5xx"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 20


def test_stream_without_include_usage_is_counted_exactly(stack: StackInfo, http: httpx.Client) -> None:
    request_id = f"nousage-{uuid.uuid4()}"
    body = {"model": MODEL, "messages": HELLO, "stream": True, "max_tokens": 40, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": request_id}) as response:
        events = [orjson.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert events and not [e for e in events if e.get("usage")]  # the client got no usage chunk
    found = wait_for("the ledger record", lambda: [
        r for r in read_file(stack.log_dir.parent / "usage.jsonl") if r.request_id == request_id], 3.0, interval=0.05)
    record = found[0]
    # extproc asked the pod for its usage (stream_options.include_usage); Envoy's Lua filter dropped the chunk.
    assert not record.usage_estimated and record.input_tokens > 0 and record.output_tokens == 40
