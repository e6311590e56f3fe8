"""Least in-flight picking through the real stack, made deterministic: one Envoy worker and one
extproc process, so every request is counted by the same picker."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from extproc.launcher import StackInfo
from tests.e2e.conftest import MODEL, BackgroundStream, small_stack


@pytest.fixture(scope="module")
def single_worker_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    with small_stack(tmp_path_factory, "picker", pods=2, sim_args=("--record", "100")) as info:
        yield info


def _endpoint_of(stack: StackInfo, request_id: str) -> str:
    for url in stack.pod_urls["local"]:
        for record in httpx.get(f"{url}/debug/requests").json()["requests"]:
            headers = {k.lower(): v for k, v in record["headers"].items()}
            if headers.get("x-request-id") == request_id:
                return headers["x-gateway-destination-endpoint"].split(",")[0]  # the pick, then the fallback
    raise AssertionError(f"no pod saw {request_id}")


def test_requests_avoid_the_pod_with_a_stream_in_flight_and_release_it(single_worker_stack: StackInfo) -> None:
    base = single_worker_stack.base_url
    tag = uuid.uuid4().hex[:8]
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
        time.sleep(0.2)  # the ext_proc stream closes when Envoy sees the client go
