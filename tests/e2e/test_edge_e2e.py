"""Envoy's edge limits and the answers Envoy makes itself, through the real stack.

Stalled uploads are cut, header limits hold, upgrades are refused, compressed bodies are decoded
before extproc reads them, and every local reply Envoy makes is an OpenAI error
(``local_reply_config`` in envoy/envoy.yaml), while extproc's own replies pass untouched.

The main listener runs envoy.yaml as shipped; the stack adds copies of it with shorter timeouts
(a test cannot wait 60 s) and one whose ext_proc filter talks to a stub server that fails or never
answers. A dead pod and the connection cap get a stack of their own.
"""

from __future__ import annotations

import copy
import gzip
import json
import select
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from extproc import envoyconf
from extproc.launcher import LocalStack, ProcessGroup, StackInfo, free_port
from tests.e2e.conftest import MODEL, small_stack
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
REQUEST_TIMEOUT_S = 2  # request_timeout of the short-timeouts listener (shipped: 60 s)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CHAT_BYTES = json.dumps(CHAT).encode()
FAIL_HEADER = "x-edge-test-fail"  # the stub ext_proc server fails streams that carry it
ERROR_FIELDS = ["message", "type", "param", "code"]  # extproc's order; Envoy's json_format sorts keys


# -- raw HTTP/1.1 (what httpx will not send: stalls, OPTIONS *, upgrades, oversize heads) ----------


class Closed(Exception):
    """The connection closed before a whole reply head arrived."""


@dataclass(frozen=True)
class RawReply:
    """A reply read off a socket."""

    status: int
    headers: dict[str, str]
    body: bytes


def _read_reply(sock: socket.socket) -> RawReply:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise Closed(f"the connection closed without a reply (got {data!r})")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length and (chunk := sock.recv(65536)):
        body += chunk
    return RawReply(int(status_line.split()[1]), headers, body[:length])


def exchange(port: int, head: bytes, body: Iterable[bytes] = (), timeout: float = 30) -> RawReply:
    """Send ``head`` then the ``body`` chunks (stopping early if Envoy answers first); read the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        for chunk in body:
            if select.select([sock], [], [], 0)[0]:  # answered (or closed) before the body ended
                break
            try:
                sock.sendall(chunk)
            except OSError:  # Envoy stopped reading: its reply is waiting
                break
        return _read_reply(sock)


def request_head(method: str, target: str, headers: dict[str, str] | None = None) -> bytes:
    """An HTTP/1.1 request head."""
    lines = [f"{method} {target} HTTP/1.1", "host: gateway", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunked(data: bytes, size: int = 1 << 20) -> Iterator[bytes]:
    """``data`` in HTTP/1.1 chunked framing, then the last chunk."""
    for start in range(0, len(data), size):
        part = data[start:start + size]
        yield b"%x\r\n%s\r\n" % (len(part), part)
    yield b"0\r\n\r\n"


def assert_openai_error(status: int, headers: Any, body: bytes, expected: int, code: str,
                        error_type: str | None = None) -> dict[str, Any]:
    """The reply is ``expected`` with OpenAI's error object, code ``code``; returns the error."""
    assert status == expected, body
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert sorted(error) == sorted(ERROR_FIELDS)
    assert error["code"] == code and error["message"], error
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["type"] in ("invalid_request_error", "server_error"), error
    if error_type is not None:
        assert error["type"] == error_type
    return error


def pod_requests_with_id(stack: StackInfo, request_id: str) -> list[dict[str, Any]]:
    """What the pods received with this x-request-id (the simulator records bodies that are not JSON too)."""
    found = []
    for url in stack.pod_urls["local"]:
        for record in httpx.get(f"{url}/debug/requests").json()["requests"]:
            headers = {k.lower(): v for k, v in record["headers"].items()}
            if headers.get("x-request-id") == request_id:
                found.append({**record, "headers": headers})
    return found


# -- the stack: the shipped listener, and copies of it --------------------------------------------


class _StubExtProc(ext_proc_grpc.ExternalProcessorServicer):
    """An ext_proc server that never answers, or fails the stream when the request asks it to."""

    def Process(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        first = next(request_iterator, None)
        if first is not None and any(h.key == FAIL_HEADER for h in first.request_headers.headers.headers):
            context.abort(grpc.StatusCode.UNAVAILABLE, "told to fail")
        for _ in request_iterator:  # silent until Envoy gives up on the stream
            pass
        yield from ()


def serve_stub() -> None:
    """Run the stub ext_proc server until killed; print ``READY host:port`` once it listens."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(_StubExtProc(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"READY 127.0.0.1:{port}", flush=True)
    server.wait_for_termination()


@dataclass(frozen=True)
class Edge:
    """The stack and the ports of its listeners."""

    stack: StackInfo
    port: int  # envoy.yaml as shipped
    short_timeouts_port: int
    stub_extproc_port: int
    upstream_timeout_port: int


def _named(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(item for item in items if item["name"] == name)


def _listener_copy(config: dict[str, Any], name: str, port: int) -> dict[str, Any]:
    """A copy of the gateway listener on ``port``; returns its HttpConnectionManager config."""
    resources = config["static_resources"]
    listener = copy.deepcopy(_named(resources["listeners"], envoyconf.LISTENER))
    listener["name"] = name
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": port}
    resources["listeners"].append(listener)
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def _edge_patch(short_port: int, stub_port: int, stub_grpc_port: int, upstream_timeout_port: int
                ) -> Callable[..., None]:
    def patch(config: dict[str, Any], pod_urls: dict[str, list[str]]) -> None:
        hasty = _listener_copy(config, "edge_upstream_timeout", upstream_timeout_port)
        hasty["stream_idle_timeout"] = "1s"  # shipped: 300 s
        for route in hasty["route_config"]["virtual_hosts"][0]["routes"]:
            if "route" in route:
                route["route"]["timeout"] = "0.5s"  # a whole answer within 0.5 s (shipped: none)

        short = _listener_copy(config, "edge_short_timeouts", short_port)
        short["request_timeout"] = f"{REQUEST_TIMEOUT_S}s"
        short["request_headers_timeout"] = "1s"

        stubbed = _listener_copy(config, "edge_stub_extproc", stub_port)
        decision = _named(stubbed["http_filters"], "envoy.filters.http.ext_proc")["typed_config"]
        decision["grpc_service"]["envoy_grpc"]["cluster_name"] = "edge_stub_extproc"
        decision["message_timeout"] = "0.5s"
        cluster = copy.deepcopy(_named(config["static_resources"]["clusters"], envoyconf.EXTPROC_CLUSTER))
        cluster["name"] = cluster["load_assignment"]["cluster_name"] = "edge_stub_extproc"
        config["static_resources"]["clusters"].append(cluster)
        envoyconf.set_cluster_address(config, "edge_stub_extproc", "127.0.0.1", stub_grpc_port)

    return patch


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    # The stub runs in a process of its own: a gRPC server's threads in this one would be forked
    # into every child the stacks start (gRPC aborts such children).
    stub = ProcessGroup(tmp_path_factory.mktemp("edge-stub"))
    try:
        child = stub.spawn("stub-extproc", [sys.executable, "-m", "tests.e2e.test_edge_e2e"],
                           env={"PYTHONPATH": str(ROOT)})
        stub_grpc_port = int(stub.wait_ready_line(child, 20).rpartition(":")[2])
        short_port, stub_port, upstream_timeout_port = free_port(), free_port(), free_port()
        # 20 ms a token: a 150-token generation outlives the short request_timeout.
        stack = small_stack(tmp_path_factory, "edge", pods=1, sim_args=("--record", "100", "--decode-base-ms", "20"),
                            envoy_patch=_edge_patch(short_port, stub_port, stub_grpc_port, upstream_timeout_port))
        with stack as info:
            yield Edge(info, int(info.base_url.rpartition(":")[2]), short_port, stub_port, upstream_timeout_port)
    finally:
        stub.stop()


# -- 1. stalled uploads ----------------------------------------------------------------------------


def test_stalled_uploads_are_cut_with_an_openai_408(edge: Edge) -> None:
    json_post = {"content-type": "application/json"}
    stalls = [
        # chunked, stalled halfway through the body (each pins its buffered part until cut)
        request_head("POST", "/v1/chat/completions", {**json_post, "transfer-encoding": "chunked"})
        + b"%x\r\n" % (1 << 20) + b" " * (1 << 20) + b"\r\n",
        # a content-length that never arrives
        request_head("POST", "/v1/chat/completions", {**json_post, "content-length": "100000"}) + b'{"model":',
        # headers that never end (request_headers_timeout)
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n",
    ]
    started = time.monotonic()
    sockets = [socket.create_connection(("127.0.0.1", edge.short_timeouts_port), timeout=30) for _ in stalls]
    try:
        for sock, data in zip(sockets, stalls, strict=True):
            sock.sendall(data)
        replies = [_read_reply(sock) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
    for reply in replies:
        assert_openai_error(reply.status, reply.headers, reply.body, 408, "request_timeout", "invalid_request_error")
        assert reply.headers.get("connection") == "close"
    assert time.monotonic() - started < REQUEST_TIMEOUT_S + 15  # cut by the timeout, not by the test


def test_request_timeout_never_cuts_a_generation(edge: Edge) -> None:
    # request_timeout is disarmed once the request is sent upstream: a stream may outlive it.
    body = {**CHAT, "stream": True, "max_tokens": 150, "ignore_eos": True}
    started = time.monotonic()
    with httpx.stream("POST", f"http://127.0.0.1:{edge.short_timeouts_port}/v1/chat/completions", json=body,
                      timeout=30) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - started > REQUEST_TIMEOUT_S  # it did outlive the timeout
    assert events[-1] == "data: [DONE]"
    assert len(events) > 100


# -- 2. Envoy's own replies: header limits, upgrades, OPTIONS *, the buffer ---------------------------


@pytest.mark.parametrize(("headers", "status"), [
    ({f"x-extra-{i}": "v" for i in range(40)}, 200),  # well within the limits
    ({f"x-extra-{i}": "v" for i in range(70)}, 431),  # over max_headers_count (64)
    ({"x-big": "a" * 40 * 1024}, 431),  # over max_request_headers_kb (32)
], ids=["40-headers", "70-headers", "40-KiB-header"])
def test_header_limits(edge: Edge, headers: dict[str, str], status: int) -> None:
    reply = exchange(edge.port, request_head("GET", "/v1/models", headers))
    if status == 200:
        assert reply.status == 200, reply.body
    else:
        assert_openai_error(reply.status, reply.headers, reply.body, 431, "request_headers_too_large")


@pytest.mark.parametrize("headers", [
    {"connection": "upgrade", "upgrade": "websocket", "sec-websocket-version": "13",
     "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="},
    {"connection": "upgrade", "upgrade": "h2c, websocket"},
], ids=["websocket", "h2c-or-websocket"])
def test_upgrade_attempts_are_refused_with_an_openai_403(edge: Edge, headers: dict[str, str]) -> None:
    reply = exchange(edge.port, request_head("GET", "/v1/chat/completions", headers))
    assert_openai_error(reply.status, reply.headers, reply.body, 403, "upgrade_not_supported")


def test_an_h2c_upgrade_is_ignored_and_served_over_http1(edge: Edge) -> None:
    # Envoy's HTTP/1 codec drops a plain h2c upgrade (RFC 9113 removed it): a normal answer, no 101.
    reply = exchange(edge.port, request_head("GET", "/v1/models", {
        "connection": "upgrade, http2-settings", "upgrade": "h2c", "http2-settings": "AAMAAABkAARAAAAAAAIAAAAA"}))
    assert reply.status == 200
    assert json.loads(reply.body)["object"] == "list"


def test_options_star_is_an_openai_404(edge: Edge) -> None:
    reply = exchange(edge.port, request_head("OPTIONS", "*"))
    error = assert_openai_error(reply.status, reply.headers, reply.body, 404, "unknown_url", "invalid_request_error")
    assert error["message"] == "Unknown request URL: OPTIONS *."


@pytest.mark.parametrize("head", [
    request_head("POST", "/v1/chat/completions", {"transfer-encoding": "gzip, chunked"}),  # Envoy: 501
    b"GET /v1/models HTTP/1.0\r\nhost: gateway\r\n\r\n",  # Envoy: 426
    b"NOT HTTP AT ALL\r\n\r\n",
], ids=["unknown-transfer-coding", "http-1.0", "garbage"])
def test_malformed_http_is_an_openai_400(edge: Edge, head: bytes) -> None:
    reply = exchange(edge.port, head)
    assert_openai_error(reply.status, reply.headers, reply.body, 400, "malformed_request", "invalid_request_error")


def test_a_body_over_envoys_buffer_is_an_openai_413(edge: Edge) -> None:
    # Chunked, so extproc cannot refuse it by content-length: Envoy's buffer (the body limit + 64 KiB) fills first.
    head = request_head("POST", "/v1/chat/completions",
                        {"content-type": "application/json", "transfer-encoding": "chunked"})
    reply = exchange(edge.port, head, chunked(b" " * (33 << 20)))
    assert_openai_error(reply.status, reply.headers, reply.body, 413, "request_too_large", "invalid_request_error")


# -- 3. Content-Encoding -----------------------------------------------------------------------------


def zstd_frame(data: bytes) -> bytes:
    """``data`` as a zstd frame of one raw (stored) block (RFC 8878): no zstd library needed."""
    assert len(data) < 1 << 16
    window = 6 << 3  # Window_Descriptor: 2^(10+6) = 64 KiB
    return b"\x28\xb5\x2f\xfd" + bytes([0, window]) + (1 | len(data) << 3).to_bytes(3, "little") + data


def brotli_stream(data: bytes) -> bytes:
    """``data`` as a brotli stream of one uncompressed meta-block (RFC 7932): no brotli library needed."""
    assert 0 < len(data) <= 1 << 16
    # WBITS=16 (0), ISLAST=0, MNIBBLES=4 (00), MLEN-1 (16 bits), ISUNCOMPRESSED=1, then byte-aligned
    header = (len(data) - 1) << 4 | 1 << 20
    return header.to_bytes(3, "little") + data + b"\x03"  # then an empty last meta-block


@pytest.mark.parametrize(("encoding", "encode", "extra"), [
    ("gzip", gzip.compress, {}),
    ("gzip", gzip.compress, {"cache-control": "no-transform"}),  # the client may not opt out
    ("br", brotli_stream, {}),
    ("zstd", zstd_frame, {}),
], ids=["gzip", "gzip-no-transform", "br", "zstd"])
def test_encoded_json_is_decoded_before_extproc(edge: Edge, encoding: str, encode: Callable[[bytes], bytes],
                                                extra: dict[str, str]) -> None:
    request_id = f"edge-{uuid.uuid4()}"
    response = httpx.post(f"{edge.stack.base_url}/v1/chat/completions", content=encode(CHAT_BYTES), timeout=30,
                          headers={"content-type": "application/json", "content-encoding": encoding,
                                   "x-request-id": request_id, **extra})
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"
    [seen] = pod_requests_with_id(edge.stack, request_id)
    assert "content-encoding" not in seen["headers"]  # the pod got plain JSON
    assert seen["body"]["model"] == MODEL


def test_a_plain_body_labelled_gzip_is_an_openai_4xx_that_never_reaches_a_pod(edge: Edge) -> None:
    request_id = f"edge-{uuid.uuid4()}"
    response = httpx.post(f"{edge.stack.base_url}/v1/chat/completions", content=CHAT_BYTES, timeout=30,
                          headers={"content-type": "application/json", "content-encoding": "gzip",
                                   "x-request-id": request_id})
    assert 400 <= response.status_code < 500
    assert_openai_error(response.status_code, response.headers, response.content, response.status_code,
                        response.json()["error"]["code"], "invalid_request_error")
    assert pod_requests_with_id(edge.stack, request_id) == []  # extproc answered it: no pod saw garbage


def test_a_decompression_bomb_is_an_openai_413(edge: Edge) -> None:
    bomb = gzip.compress(bytes(40 << 20), compresslevel=9)  # ~40 KB that decode to 40 MiB
    response = httpx.post(f"{edge.stack.base_url}/v1/chat/completions", content=bomb, timeout=30,
                          headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert_openai_error(response.status_code, response.headers, response.content, 413, "request_too_large")


def test_an_unsupported_encoding_is_extprocs_415(edge: Edge) -> None:
    response = httpx.post(f"{edge.stack.base_url}/v1/chat/completions", content=CHAT_BYTES, timeout=30,
                          headers={"content-type": "application/json", "content-encoding": "deflate"})
    error = assert_openai_error(response.status_code, response.headers, response.content, 415,
                                "unsupported_media_type")
    assert list(error) == ERROR_FIELDS  # extproc's own reply


# -- 4. upstream and ext_proc failures, and extproc's own replies ----------------------------------


def test_an_upstream_timeout_is_an_openai_504(edge: Edge) -> None:
    # 100 tokens at 20 ms: the whole (non-streamed) answer takes 2 s, past the patched route timeout.
    response = httpx.post(f"http://127.0.0.1:{edge.upstream_timeout_port}/v1/chat/completions", timeout=30,
                          json={**CHAT, "max_tokens": 100, "ignore_eos": True}, headers={"x-request-id": "edge-slow"})
    assert_openai_error(response.status_code, response.headers, response.content, 504, "upstream_timeout",
                        "server_error")
    assert response.headers.get_list("x-request-id") == ["edge-slow"]


def test_an_idle_stream_is_an_openai_408(edge: Edge) -> None:
    head = request_head("POST", "/v1/chat/completions", {"content-type": "application/json", "content-length": "50"})
    reply = exchange(edge.upstream_timeout_port, head + b'{"model":')  # then nothing: stream_idle_timeout
    assert_openai_error(reply.status, reply.headers, reply.body, 408, "stream_idle_timeout", "invalid_request_error")


@pytest.mark.parametrize(("headers", "status", "code"), [
    ({FAIL_HEADER: "1"}, 503, "service_unavailable"),  # the stream fails: status_on_error
    ({}, 504, "gateway_timeout"),  # no answer within message_timeout
], ids=["extproc-fails", "extproc-silent"])
def test_ext_proc_failures_are_openai_errors(edge: Edge, headers: dict[str, str], status: int, code: str) -> None:
    response = httpx.post(f"http://127.0.0.1:{edge.stub_extproc_port}/v1/chat/completions", json=CHAT,
                          headers=headers, timeout=30)
    assert_openai_error(response.status_code, response.headers, response.content, status, code, "server_error")


def test_extprocs_own_replies_keep_their_exact_bodies(edge: Edge) -> None:
    # Envoy sends them as local replies too; local_reply_config must leave them alone.
    unknown = httpx.get(f"{edge.stack.base_url}/nope", timeout=30)
    assert unknown.status_code == 404
    assert unknown.headers["content-type"] == "application/json"
    assert unknown.content == (b'{"error":{"message":"Unknown request URL: GET /nope.",'
                               b'"type":"invalid_request_error","param":null,"code":"unknown_url"}}')

    too_large = exchange(edge.port, request_head("POST", "/v1/chat/completions",
                                                 {"content-type": "application/json", "content-length": "900000000"}))
    error = assert_openai_error(too_large.status, too_large.headers, too_large.body, 413, "request_too_large")
    assert list(error) == ERROR_FIELDS and "900000000 bytes" in error["message"]  # extproc's, by content-length

    models = httpx.get(f"{edge.stack.base_url}/v1/models", timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


# -- 5. a dead pod, and the connection cap (a stack of their own) -----------------------------------


MAX_CONNECTIONS = 3


def _cap_connections(config: dict[str, Any], pod_urls: dict[str, list[str]]) -> None:
    monitors = config["overload_manager"]["resource_monitors"]
    _named(monitors, "envoy.resource_monitors.global_downstream_max_connections")["typed_config"][
        "max_active_downstream_connections"] = MAX_CONNECTIONS


@pytest.fixture(scope="module")
def lone_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, StackInfo]]:
    stack = small_stack(tmp_path_factory, "edge-lone", pods=1, envoy_patch=_cap_connections, restart=False)
    with stack as info:
        yield stack, info


def test_a_dead_pod_is_an_openai_503(lone_pod: tuple[LocalStack, StackInfo]) -> None:
    stack, info = lone_pod
    pod = next(child for child in stack.group.children if child.name == "pod-local-1")
    pod.proc.kill()
    pod.proc.wait(10)
    response = httpx.post(f"{info.base_url}/v1/chat/completions", json=CHAT, timeout=30,
                          headers={"x-request-id": "edge-dead-pod"})
    assert_openai_error(response.status_code, response.headers, response.content, 503, "upstream_unavailable",
                        "server_error")
    assert response.headers.get_list("x-request-id") == ["edge-dead-pod"]  # once, not once per layer


def test_connections_past_the_cap_are_closed(lone_pod: tuple[LocalStack, StackInfo]) -> None:
    port = int(lone_pod[1].base_url.rpartition(":")[2])
    models = request_head("GET", "/v1/models")

    def served() -> socket.socket | None:
        """A kept-alive connection that got an answer, or None if Envoy closed it at once."""
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            sock.sendall(models)
            if _read_reply(sock).status == 200:
                return sock
        except (Closed, OSError):
            pass
        sock.close()
        return None

    def wait_served() -> socket.socket:
        # A connection closed just before may still be counted.
        return wait_for("a connection accepted under the cap", served, 10.0, interval=0.05)

    held = [wait_served() for _ in range(MAX_CONNECTIONS)]
    try:
        assert served() is None  # over the cap: closed without an answer
        held.pop().close()
        held.append(wait_served())  # a slot freed: served again
    finally:
        for sock in held:
            sock.close()


if __name__ == "__main__":  # the stub ext_proc server of the `edge` fixture
    serve_stub()
