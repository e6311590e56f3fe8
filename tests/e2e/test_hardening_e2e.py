"""A hostile client and an operator pulling plugs, through the real stack: large bodies never stall
another tenant, refusals hold no memory, deep JSON is a 400 that leaks no slot, and dead or hung
pods stop getting traffic while their requests are retried elsewhere."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from extproc.launcher import LocalStack, StackInfo
from tests.e2e.conftest import MODEL, small_stack
from tests.helpers import wait_for

BIG_KEY, SMALL_KEY, SOLO_KEY, FREE_KEY = "sk-big-tenant", "sk-small-tenant", "sk-solo-tenant", "sk-free-tenant"
TENANTS = [
    {"name": "big", "keys": [{"env": "HARD_BIG_KEY"}], "limits": {"rpm": 100000, "concurrency": 100}},
    {"name": "small", "keys": [{"env": "HARD_SMALL_KEY"}], "limits": {"rpm": 100000, "concurrency": 100}},
    {"name": "solo", "keys": [{"env": "HARD_SOLO_KEY"}], "limits": {"concurrency": 1}},
    {"name": "free", "keys": [{"env": "HARD_FREE_KEY"}]},
    {"name": "ledgered", "keys": [{"env": "HARD_LEDGER_KEY"}], "limits": {"rpm": 1}},
]
LEDGER_KEY = "sk-ledgered-tenant"
KEYS_ENV = {"HARD_BIG_KEY": BIG_KEY, "HARD_SMALL_KEY": SMALL_KEY, "HARD_SOLO_KEY": SOLO_KEY,
            "HARD_FREE_KEY": FREE_KEY, "HARD_LEDGER_KEY": LEDGER_KEY}
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StackInfo, LocalStack]]:
    extra = {"server": {"max_body_bytes": 8 << 20},
             "models": [{"name": MODEL, "pool": "local", "aliases": ["gpt-4o-mini"]}], "tenants": TENANTS}
    # An instant pod: the small requests' latency is the gateway's own.
    stack = small_stack(tmp_path_factory, "hardening", pods=1, extra_config=extra, workers=2, envoy_concurrency=2,
                        env=KEYS_ENV, sim_args=("--time-scale", "0"))
    with stack as info:
        yield info, stack


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


# Sends one body N times at once from its own process (a client in this process would share the
# GIL with the small tenant's clients and slow them itself), and prints each answer as JSON.
BIG_SENDER = """
import http.client, json, sys, threading
host, port, key, path, count = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
body = open(path, "rb").read()
answers = []
def send():
    connection = http.client.HTTPConnection(host, port, timeout=60)
    connection.request("POST", "/v1/chat/completions", body, {
        "authorization": "Bearer " + key, "content-type": "application/json"})
    response = connection.getresponse()
    answers.append({"status": response.status, "body": json.loads(response.read())})
threads = [threading.Thread(target=send) for _ in range(count)]
sys.stdin.readline()  # go
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps(answers))
"""


def _large_bodies_round(info: StackInfo, big: Path) -> tuple[float, list[str], list[dict[str, object]]]:
    """One round: 4 large bodies at once from their own process while 4 clients of another tenant
    send small requests; the small requests' p99 (s), their errors, the large bodies' answers."""
    host, _, port = info.base_url.removeprefix("http://").rpartition(":")
    sender = subprocess.Popen([sys.executable, "-c", BIG_SENDER, host, port, BIG_KEY, str(big), "4"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    go = threading.Barrier(4 + 1)  # 4 small clients (warmed up), this thread
    latencies: list[float] = []
    errors: list[str] = []
    pacer = threading.Event()  # never set: its wait() paces each small client

    def send_small(client: httpx.Client, i: int) -> float:
        began = time.perf_counter()
        if i % 2:
            response = client.get("/v1/models", headers=_auth(SMALL_KEY))
        else:
            response = client.post("/v1/chat/completions", headers=_auth(SMALL_KEY),
                                   json={"model": MODEL, "messages": HELLO, "max_tokens": 1})
        if response.status_code != 200:
            errors.append(f"{response.status_code} {response.text[:200]}")
        return time.perf_counter() - began

    def small_tenant(n: int) -> None:
        # Another tenant's steady traffic (4 clients, up to ~100 requests/s in all), not a flood
        # that would measure the machine's saturation instead of the gateway's fairness.
        with httpx.Client(base_url=info.base_url, timeout=30) as client:
            send_small(client, n)  # a warm connection before the clock starts
            go.wait()
            sent = 0
            while sender.poll() is None or sent < 10:
                latencies.append(send_small(client, n + sent))
                sent += 1
                pacer.wait(0.04)

    smalls = [threading.Thread(target=small_tenant, args=(n,)) for n in range(4)]
    for thread in smalls:
        thread.start()
    go.wait()
    answers, _ = sender.communicate("go\n", timeout=120)
    for thread in smalls:
        thread.join()
    latencies.sort()
    return latencies[max(0, int(len(latencies) * 0.99) - 1)], errors, orjson.loads(answers)


def test_large_bodies_of_one_tenant_do_not_stall_another(stack: tuple[StackInfo, LocalStack],
                                                         tmp_path: Path) -> None:
    info, _ = stack
    # ~5 MB each: 100,000 tools and a model nobody serves, as the hostile client sent them.
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
             for i in range(100_000)]
    big = tmp_path / "big.json"
    big.write_bytes(orjson.dumps({"model": "no-such-model", "messages": HELLO, "tools": tools}))
    assert big.stat().st_size > 5_000_000
    p99s = []
    for _ in range(3):  # the median of 3 rounds, as bench.fairness reports it
        p99, errors, big_answers = _large_bodies_round(info, big)
        assert errors == []  # the other tenant: not one error
        # Each large body is refused for its tools, or (too much already queued for the helper
        # process) with a retryable 503; on a starved machine Envoy's 2 s ext_proc timeout may
        # answer first, as an OpenAI error too.
        assert len(big_answers) == 4
        for answer in big_answers:
            error = answer["body"]["error"]  # type: ignore[index]
            assert answer["status"] in (400, 503, 504) and error["message"]
            assert answer["status"] != 400 or error["param"] == "tools"
        p99s.append(p99)
    p99s.sort()
    # The target is 100 ms: `python -m bench.fairness` measures it (median p99 67 ms on a
    # quiet 2-core machine, 1.2 s with large bodies parsed on the loop). Beside a CPU hog it is
    # ~100-150 ms here: gRPC still hands each 5 MB body to the worker's event loop (~2.5 ms/MB of
    # copies in grpc and protobuf), which no helper process can take off it. Before this change
    # the same traffic saw 2 s and 504s: that stall is what this guards against. The figure itself
    # is the benchmark's: on a shared CI machine one round took 791 ms and the median 260 ms.
    assert p99s[1] <= 1.0, f"median p99 {p99s[1] * 1000:.0f} ms (rounds: {[round(p * 1000) for p in p99s]})"


def test_rejected_bodies_hold_no_memory(stack: tuple[StackInfo, LocalStack]) -> None:
    info, local = stack
    workers = [c.pid for c in local.group.children if c.name.startswith("extproc")]
    body = orjson.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x" * (1 << 20)}]})
    with httpx.Client(base_url=info.base_url, timeout=30) as client:
        for _ in range(20):  # warm: allocator arenas, the helper process
            client.post("/v1/chat/completions", content=body,
                        headers={**_auth(BIG_KEY), "content-type": "application/json"})
        before = {pid: _rss_kib(pid) for pid in workers}
        for _ in range(200):
            response = client.post("/v1/chat/completions", content=body,
                                   headers={**_auth(BIG_KEY), "content-type": "application/json"})
            assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    growth_mib = {pid: (_rss_kib(pid) - before[pid]) / 1024 for pid in workers}
    # Kept bodies grew a worker ~210 MB (200 x 1 MB); the allocator's own noise reached 40.9 MB once,
    # beside a CPU hog: the bound sits between the two.
    assert all(g < 100 for g in growth_mib.values()), growth_mib


@pytest.mark.parametrize("key", [SOLO_KEY, FREE_KEY], ids=["limited", "unlimited"])
def test_deep_json_is_a_400_and_leaks_no_slot(stack: tuple[StackInfo, LocalStack], key: str) -> None:
    info, _ = stack
    with httpx.Client(base_url=info.base_url, timeout=30) as client:
        for depth in (100, 300, 1000):
            deep = (b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a"}],"metadata":{"x":'
                    + b"[" * depth + b"]" * depth + b"}}")
            response = client.post("/v1/chat/completions", content=deep,
                                   headers={**_auth(key), "content-type": "application/json"})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] in ("invalid_value", "invalid_json") and error["param"] in ("metadata.x", None) \
                or error["param"].startswith("metadata.x[0]"), error
            # The solo tenant's one concurrency slot is free: the next request is served well within
            # the lease's 60 s TTL, which is what would free a leaked slot. The previous loop's
            # served request frees it by its access-log entry, which a CPU hog can delay past the
            # client's next request (a 429 with retry-after); so it waits on the condition.
            def served() -> bool:
                ok = client.post("/v1/chat/completions", headers=_auth(key),
                                 json={"model": "gpt-4o-mini", "messages": HELLO, "max_tokens": 1})
                assert ok.status_code in (200, 429), ok.text
                return ok.status_code == 200

            wait_for(f"a request of {key} served after the depth-{depth} 400", served, timeout=10.0, interval=0.05)


# -- pods that die or hang ----------------------------------------------------------------------

def _start_sim(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A simulated pod this test owns (not supervised by the stack, so it stays dead when killed)."""
    proc = subprocess.Popen([sys.executable, "-m", "llmgw_sim", "--host", "127.0.0.1", "--port", "0",
                             "--model", MODEL], stdout=subprocess.PIPE, stderr=open(tmp / "own-pod.log", "ab"))
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("READY "), line
    return proc, line.split()[1].removeprefix("http://")


def _primary_of_seen(pod_url: str, request_ids: set[str]) -> list[str]:
    """The endpoint extproc picked first, for each of ``request_ids`` that reached ``pod_url``."""
    seen = []
    for record in httpx.get(f"{pod_url}/debug/requests", timeout=10).json()["requests"]:
        headers = {k.lower(): v for k, v in record["headers"].items()}
        if headers.get("x-request-id") in request_ids:
            seen.append(headers["x-gateway-destination-endpoint"].split(",")[0])
    return seen


def test_a_dead_pod_is_retried_around_then_gets_no_traffic(tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = Path(tmp_path_factory.mktemp("dead-pod"))
    own, own_address = _start_sim(tmp)
    try:
        extra = {"pools": [{"name": "local", "simulate": 1, "endpoints": [own_address]}]}
        with small_stack(tmp_path_factory, "deadpod", pods=1, extra_config=extra,
                         sim_args=("--record", "400")) as info:
            live_url = info.pod_urls["local"][0]
            with httpx.Client(base_url=info.base_url, timeout=30) as client:
                def ask() -> tuple[str, int]:
                    request_id = f"dead-{uuid.uuid4()}"
                    response = client.post("/v1/chat/completions", headers={"x-request-id": request_id},
                                           json={"model": MODEL, "messages": HELLO, "max_tokens": 1})
                    return request_id, response.status_code

                assert all(ask()[1] == 200 for _ in range(10))
                own.kill()
                own.wait()
                killed_at = time.monotonic()
                statuses = [ask() for _ in range(100)]
                failed = [s for _, s in statuses if s != 200]
                assert len(failed) <= 1, failed  # the target: <= 1% of the next 100
                # Requests sent 2 s after the kill: extproc never picks the dead pod first.
                while time.monotonic() - killed_at < 2.0:
                    ask()
                late = {ask()[0] for _ in range(40)}
                primaries = _primary_of_seen(live_url, late)
                assert len(primaries) == 40 and own_address not in primaries
    finally:
        if own.poll() is None:
            own.kill()
            own.wait()


class HungPod:
    """A pod that answers its health probe and its scrapes (idle, as attractive as the live pod, so
    that the picker does send it requests) but never answers a request (accepts, then silence)."""

    def __init__(self) -> None:
        self.requests = 0
        self._loop = asyncio.new_event_loop()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(asyncio.start_server(self._serve, sock=self._sock))
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._answer(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET /health"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
                continue
            if head.startswith((b"GET /metrics", b"GET /v1/models")):
                idle = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"
                models = b'{"object":"list","data":[{"id":"' + MODEL.encode() + b'"}]}'
                body = idle if head.startswith(b"GET /metrics") else models
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
                continue
            if head.startswith(b"POST "):  # an inference request (not the scrape of /metrics, /v1/models)
                self.requests += 1
            await reader.read()  # hold the connection open, answer nothing

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._sock.close()


def test_a_hung_pod_costs_one_first_byte_timeout_then_is_avoided(tmp_path_factory: pytest.TempPathFactory) -> None:
    hung = HungPod()
    try:
        extra = {"pools": [{"name": "local", "simulate": 1, "endpoints": [hung.address], "first_byte_timeout_s": 1}]}
        with small_stack(tmp_path_factory, "hungpod", pods=1, extra_config=extra) as info:
            with httpx.Client(base_url=info.base_url, timeout=30) as client:
                latencies = []
                for stream in [False, True] * 15:
                    began = time.monotonic()
                    response = client.post("/v1/chat/completions", json={
                        "model": MODEL, "messages": HELLO, "max_tokens": 2, "stream": stream})
                    latencies.append(time.monotonic() - began)
                    assert response.status_code == 200, response.text  # retried on the live pod
            # The hung pod held at most a first-byte timeout per request it got, and after the
            # first it was ejected (2 s, then 4 s...): a few requests in 30, not half of them.
            assert 1 <= hung.requests <= 6, hung.requests
            assert max(latencies) < 1 + 5, latencies
            assert sum(latency > 0.9 for latency in latencies) == hung.requests
    finally:
        hung.close()


def test_pool_timeouts_are_rendered_into_envoy(tmp_path_factory: pytest.TempPathFactory) -> None:
    from extproc import envoyconf
    from extproc.config import GatewaySpec
    from extproc.envoybuild.addresses import LOCAL
    from extproc.envoybuild.bootstrap import bootstrap
    from extproc.envoybuild.output import data

    spec = GatewaySpec.model_validate({
        "envoy": {"stream_idle_timeout_s": 42}, "models": [{"name": "m", "pool": "fast"}],
        "pools": [{"name": "fast", "endpoints": ["10.0.0.1:8000"], "first_byte_timeout_s": 2.5},
                  {"name": "slow", "endpoints": ["10.0.0.2:8000", "10.0.0.1:8000"]}]})
    rendered = data(bootstrap(spec, LOCAL))  # as `llmgw up` builds it
    manager = rendered["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert manager["stream_idle_timeout"] == "42s"
    routes = {r.get("name"): r for r in manager["route_config"]["virtual_hosts"][0]["routes"]}
    assert routes["direct-fast"]["route"]["retry_policy"]["per_try_idle_timeout"] == "2.500s"
    assert routes["direct-slow"]["route"]["retry_policy"]["per_try_idle_timeout"] == "120s"  # the default
    pods = rendered["static_resources"]["clusters"]
    cluster = next(c for c in pods if c["name"] == "llm_pods")
    endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    addresses = [e["endpoint"]["address"]["socket_address"] for e in endpoints]
    assert [(a["address"], a["port_value"]) for a in addresses] == [("10.0.0.1", 8000), ("10.0.0.2", 8000)]
    path = envoyconf.write(rendered, Path(tmp_path_factory.mktemp("render")) / "envoy.yaml")
    check = envoyconf.validate(path)
    assert check.returncode == 0, check.stderr[-2000:]
    assert os.path.getsize(path) > 0


def test_ledger_and_llmgw_usage_show_served_and_rejected_apart(stack: tuple[StackInfo, LocalStack]) -> None:
    info, _ = stack
    statuses = []
    with httpx.Client(base_url=info.base_url, timeout=30) as client:
        for model in (MODEL, MODEL, MODEL, "no-such-model"):
            statuses.append(client.post("/v1/chat/completions", headers=_auth(LEDGER_KEY), json={
                "model": model, "messages": HELLO, "max_tokens": 1}).status_code)
        # Without a known key nothing is recorded: no tenant to bill, and a flood must not fill the ledger.
        assert client.post("/v1/chat/completions", headers=_auth("sk-nobody"), json={
            "model": MODEL, "messages": HELLO}).status_code == 401
    assert statuses == [200, 429, 429, 404]
    ledger_file = info.log_dir.parent / "usage.jsonl"
    deadline = time.monotonic() + 10
    while True:
        result = subprocess.run([sys.executable, "-m", "extproc.cli", "usage", "--file", str(ledger_file),
                                 "--tenant", "ledgered", "--format", "json"], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        rows = orjson.loads(result.stdout)
        if sum(r["requests"] for r in rows) == 1 and sum(r["rejected"] for r in rows) == 3:
            break
        assert time.monotonic() < deadline, rows
    by_model = {r["model"]: r for r in rows}
    assert (by_model[MODEL]["requests"], by_model[MODEL]["rejected"]) == (1, 2)
    assert (by_model["no-such-model"]["requests"], by_model["no-such-model"]["rejected"]) == (0, 1)
