"""When extproc cannot be reached, Envoy fails closed: 503, and nothing reaches a pod."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from extproc.launcher import LocalStack, StackInfo, StackOptions, free_port

MODEL = "llama-3-8b-instruct"


def _point_extproc_at(port: int) -> Any:
    def patch(config: dict[str, Any], pod_urls: dict[str, list[str]]) -> None:
        for cluster in config["static_resources"]["clusters"]:
            if cluster["name"] == "llmgw_extproc":
                endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
                endpoint["address"]["socket_address"]["port_value"] = port

    return patch


@pytest.fixture(scope="module")
def stack_without_extproc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    run_dir = Path(tmp_path_factory.mktemp("failclosed"))
    config = run_dir / "llmgw.yaml"
    config.write_text(yaml.safe_dump({"pools": [{"name": "local", "simulate": 1}],
                                      "models": [{"name": MODEL, "pool": "local"}]}))
    dead_port = free_port()  # nobody listens there: every ext_proc stream fails to open
    options = StackOptions(config_path=config, run_dir=run_dir, port=free_port(), workers=1, envoy_concurrency=1,
                           sim_args=("--record", "10"), log_level="WARNING", envoy_patch=_point_extproc_at(dead_port))
    with LocalStack(options) as info:
        yield info


def test_unreachable_extproc_is_503_and_nothing_is_forwarded(stack_without_extproc: StackInfo) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.post(f"{stack_without_extproc.base_url}/v1/chat/completions", json=body, timeout=10,
                          headers={"x-llmgw-route": "direct", "x-gateway-destination-endpoint":
                                   stack_without_extproc.pod_urls["local"][0].removeprefix("http://")})
    assert response.status_code == 503
    pod = stack_without_extproc.pod_urls["local"][0]
    assert httpx.get(f"{pod}/debug/requests").json()["requests"] == []  # fail closed: not even a forged route
