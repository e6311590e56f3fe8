"""When extproc cannot be reached, Envoy fails closed: 503, and nothing reaches a pod."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from extproc import envoyconf
from extproc.launcher import StackInfo, free_port
from tests.e2e.conftest import MODEL, small_stack


def _point_extproc_at(port: int) -> Any:
    def patch(config: dict[str, Any], pod_urls: dict[str, list[str]]) -> None:
        envoyconf.set_cluster_address(config, envoyconf.EXTPROC_CLUSTER, "127.0.0.1", port)

    return patch


@pytest.fixture(scope="module")
def stack_without_extproc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    dead_port = free_port()  # nobody listens there: every ext_proc stream fails to open
    with small_stack(tmp_path_factory, "failclosed", pods=1, sim_args=("--record", "10"),
                     envoy_patch=_point_extproc_at(dead_port)) as info:
        yield info


def test_unreachable_extproc_is_503_and_nothing_is_forwarded(stack_without_extproc: StackInfo) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.post(f"{stack_without_extproc.base_url}/v1/chat/completions", json=body, timeout=10,
                          headers={"x-llmgw-route": "direct", "x-gateway-destination-endpoint":
                                   stack_without_extproc.pod_urls["local"][0].removeprefix("http://")})
    assert response.status_code == 503
    pod = stack_without_extproc.pod_urls["local"][0]
    assert httpx.get(f"{pod}/debug/requests").json()["requests"] == []  # fail closed: not even a forged route
