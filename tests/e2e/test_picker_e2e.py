"""Least in-flight picking through the real stack, made deterministic: one Envoy worker and one
extproc process, so every request is counted by the same picker."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import httpx
import orjson
import pytest

from extproc.launcher import StackInfo
from tests.e2e.conftest import MODEL, BackgroundStream, small_stack
from tests.helpers import wait_for


@pytest.fixture(scope="module")
def single_worker_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    with small_stack(tmp_path_factory, "picker", pods=2, sim_args=("--record", "100"), metrics_port=0) as info:
        yield info


def _endpoint_of(stack: StackInfo, request_id: str) -> str:
    for url in stack.pod_urls["local"]:
        for record in httpx.get(f"{url}/debug/requests").json()["requests"]:
            headers = {k.lower(): v for k, v in record["headers"].items()}
            if headers.get("x-request-id") == request_id:
                return headers["x-gateway-destination-endpoint"].split(",")[0]  # the pick, then the fallback
    raise AssertionError(f"no pod saw {request_id}")


def _settled(stack: StackInfo) -> float:
    """Requests the gateway has settled (their access-log entries came back): the count of the
    GenAI duration histogram, summed over its labels."""
    assert stack.metrics_url is not None
    text = httpx.get(stack.metrics_url, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("gen_ai_client_operation_duration_seconds_count"))


def test_requests_avoid_the_pod_with_a_stream_in_flight_and_release_it(single_worker_stack: StackInfo) -> None:
    base = single_worker_stack.base_url
    tag = uuid.uuid4().hex[:8]
    baseline = _settled(single_worker_stack)
    for round_ in range(3):  # later rounds would tie (and pick at random) if a hung-up stream leaked its count
        long_id = f"long-{tag}-{round_}"
        # ~25 s of decoding; leaving the block hangs up, and the gateway must release the pod's count.
        with BackgroundStream(base, 2000, {"x-request-id": long_id}), httpx.Client(base_url=base, timeout=30) as client:
            busy = _endpoint_of(single_worker_stack, long_id)
            for i in range(6):
                short_id = f"short-{tag}-{round_}-{i}"
                response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                                       headers={"x-request-id": short_id})
                assert response.status_code == 200
                assert _endpoint_of(single_worker_stack, short_id) != busy  # the idle pod has fewer in flight
        # The hung-up stream's pick is released once its access-log entry is settled: the next
        # round starts after that (7 requests a round), or it would find the two pods tied.
        settled = baseline + 7 * (round_ + 1)
        wait_for("the round's requests settled", lambda settled=settled: _settled(single_worker_stack) >= settled)


SHED_KEY = "sk-e2e-shed"
SHED_CONFIG = {
    "pools": [{"name": "local", "simulate": 1, "shed": {"batch": 0.5, "default": 20, "realtime": 40}}],
    "tenants": [{"name": "shed", "keys": [{"env": "SHED_KEY"}], "qos": ["balanced", "batch", "realtime"]}],
    "endpoint_picker": {"scrape": {"interval_s": 0.1}},
}


@pytest.fixture(scope="module")
def one_slot_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    # One sequence at a time: every other request waits in the pod's queue (vllm:num_requests_waiting).
    with small_stack(tmp_path_factory, "shed", pods=1, extra_config=SHED_CONFIG,
                     sim_args=("--max-num-seqs", "1"), env={"SHED_KEY": SHED_KEY}) as info:
        yield info


def _ask(base: str, qos: str, timeout: float, max_tokens: int = 1) -> httpx.Response | None:
    """A request in class ``qos``; None when the client gave up waiting (it was forwarded and queued)."""
    try:
        return httpx.post(f"{base}/v1/completions", timeout=timeout,
                          json={"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True},
                          headers={"authorization": f"Bearer {SHED_KEY}", "x-llmgw-qos": qos})
    except httpx.TimeoutException:
        return None



def test_an_overloaded_pool_sheds_batch_first_and_stops_when_its_queue_drains(one_slot_pod: StackInfo) -> None:
    base = one_slot_pod.base_url
    # Four long requests on a one-slot pod: one runs, three wait (~2 s of decoding each).
    load = [threading.Thread(target=_ask, args=(base, "balanced", 60, 150)) for _ in range(4)]
    for thread in load:
        thread.start()
    refused = wait_for("a batch request shed",
                       lambda: r if (r := _ask(base, "batch", 0.3)) is not None and r.status_code == 429 else None)
    assert refused.json()["error"]["code"] == "pool_overloaded" and refused.headers["retry-after"] == "1"
    assert "batch requests are shed past 0.5" in refused.json()["error"]["message"]
    served = _ask(base, "realtime", 60)  # not refused: it queues behind the load and is served
    assert served is not None and served.status_code == 200
    for thread in load:
        thread.join(60)
    # The queue drained: batch is admitted again once the next scrape says so.
    wait_for("the condition", lambda: r if (r := _ask(base, "batch", 5)) is not None and r.status_code == 200 else None)


def test_a_session_returns_to_the_pod_holding_its_prefix(single_worker_stack: StackInfo) -> None:
    base = single_worker_stack.base_url
    tag = uuid.uuid4().hex[:8]
    system = f"[{tag}] You are the assistant of ACME's support desk. Answer kindly and briefly. " * 12
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "My order is late."}]
    pods = []
    with httpx.Client(base_url=base, timeout=30) as client:
        for turn in range(4):
            request_id = f"session-{tag}-{turn}"
            response = client.post("/v1/chat/completions", headers={"x-request-id": request_id},
                                   json={"model": MODEL, "messages": messages, "max_tokens": 4})
            assert response.status_code == 200
            pods.append(_endpoint_of(single_worker_stack, request_id))
            messages += [{"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"Follow-up number {turn}."}]
    assert len(set(pods)) == 1, pods


LORA_CONFIG = {
    "pools": [{"name": "local", "simulate": 2, "picker": {"weights": {"lora": 4}}}],
    "models": [{"name": MODEL, "pool": "local"}, {"name": "sql-lora", "pool": "local", "lora": True},
               {"name": "chat-lora", "pool": "local", "lora": True}],
    "endpoint_picker": {"scrape": {"interval_s": 0.1}},
}


@pytest.fixture(scope="module")
def lora_pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    # One adapter per batch (vLLM's --max-loras 1): a second adapter waits for the first to finish.
    with small_stack(tmp_path_factory, "lora", pods=2, extra_config=LORA_CONFIG,
                     sim_args=("--max-loras", "1", "--record", "100")) as info:
        yield info


def _adapter_request(base: str, model: str, request_id: str, max_tokens: int) -> None:
    response = httpx.post(f"{base}/v1/chat/completions", timeout=60, headers={"x-request-id": request_id},
                          json={"model": model, "messages": [{"role": "user", "content": "q"}],
                                "max_tokens": max_tokens, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["model"] == model


def test_adapters_go_where_they_are_loaded_or_where_there_is_room(lora_pods: StackInfo) -> None:
    base, tag = lora_pods.base_url, uuid.uuid4().hex[:8]
    snapshot = lora_pods.pod_snapshot  # the node's scrape, as the gateway's workers read it
    assert snapshot is not None and snapshot.parent == lora_pods.config_path.parent  # in the stack's run dir
    busy = threading.Thread(target=_adapter_request, args=(base, "sql-lora", f"sql-{tag}", 600))
    busy.start()
    try:
        sql_pod = wait_for("a pod running sql-lora", lambda: next(
            (p["endpoint"] for p in orjson.loads(snapshot.read_bytes())["pods"] if "sql-lora" in p["running_adapters"]),
            None) if snapshot.exists() else None)
        for i in range(3):
            _adapter_request(base, "chat-lora", f"chat-{tag}-{i}", 1)  # would wait behind sql-lora there
            assert _endpoint_of(lora_pods, f"chat-{tag}-{i}") != sql_pod
            _adapter_request(base, "sql-lora", f"sql-{tag}-{i}", 1)  # joins the batch holding its adapter
            assert _endpoint_of(lora_pods, f"sql-{tag}-{i}") == sql_pod
    finally:
        busy.join(60)



@pytest.fixture(scope="module")
def queued_pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    with small_stack(tmp_path_factory, "queued", pods=2,
                     extra_config={"endpoint_picker": {"scrape": {"interval_s": 0.1}}},
                     sim_args=("--max-num-seqs", "1", "--record", "100")) as info:
        yield info


def test_a_pod_with_a_queue_is_avoided_though_this_gateway_sent_it_nothing(queued_pods: StackInfo) -> None:
    """The queue comes from elsewhere (another gateway, a batch job): only the scraped
    vllm:num_requests_waiting tells the picker, not its own in-flight count."""
    base, tag = queued_pods.base_url, uuid.uuid4().hex[:8]
    urls = queued_pods.pod_urls["local"]
    snapshot = queued_pods.pod_snapshot
    assert snapshot is not None
    loaded = urls[0].removeprefix("http://")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 150, "ignore_eos": True}
    direct = [threading.Thread(target=httpx.post, args=(f"{urls[0]}/v1/completions",),
                               kwargs={"json": body, "timeout": 60}) for _ in range(3)]
    for thread in direct:
        thread.start()
    try:
        wait_for("the condition", lambda: True if snapshot.exists() and any(
            p["endpoint"] == loaded and p["waiting"] >= 1 for p in orjson.loads(snapshot.read_bytes())["pods"])
            else None)
        with httpx.Client(base_url=base, timeout=30) as client:
            for i in range(5):
                request_id = f"queued-{tag}-{i}"
                response = client.post("/v1/completions", headers={"x-request-id": request_id},
                                       json={"model": MODEL, "prompt": "x", "max_tokens": 1})
                assert response.status_code == 200
                assert _endpoint_of(queued_pods, request_id) != loaded
    finally:
        for thread in direct:
            thread.join(60)
