"""The pool gauges autoscalers read (``llmgw_pool_*``): each pool's queue, running requests and
KV-cache use over its pods' last scrape, set whenever pod state lands (``PodStates.on_update``)."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from extproc.routing.engines import VLLM
from extproc.routing.podstate import (
    PodState,
    PodStates,
    PoolLoad,
    gather_forever,
    pool_loads,
)
from extproc.telemetry.metrics import MULTIPROC_ENV, GatewayMetrics
from tests.helpers import eventually

REPO = Path(__file__).resolve().parents[1]
NAN = math.nan


def state(endpoint: str, waiting: float = 0.0, running: float = 0.0, kv_usage: float = 0.0,
          scraped_at: float = 100.0) -> PodState:
    return PodState(endpoint=endpoint, scraped_at=scraped_at, waiting=waiting, running=running, kv_usage=kv_usage,
                    prefix_queries=0.0, prefix_hits=0.0, running_adapters=frozenset(),
                    waiting_adapters=frozenset(), max_lora=0, models=frozenset())


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) < 1e-9


def gauge(metrics: GatewayMetrics | CollectorRegistry, name: str, pool: str) -> float | None:
    registry = metrics.registry if isinstance(metrics, GatewayMetrics) else metrics
    return registry.get_sample_value(name, {"llmgw_pool": pool})


STATES = {
    "10.0.0.1:8000": state("10.0.0.1:8000", waiting=3, running=8, kv_usage=0.5),
    "10.0.0.2:8000": state("10.0.0.2:8000", waiting=5, running=16, kv_usage=0.9),
    "10.0.0.9:8000": state("10.0.0.9:8000", waiting=100, running=1, kv_usage=1.0),  # another pool's pod
}


@pytest.mark.parametrize(("endpoints", "expected"), [
    pytest.param(["10.0.0.1:8000", "10.0.0.2:8000"], PoolLoad(2, 2, 8, 24, 0.7),
                 id="sums-queues-and-running-means-kv"),
    # An unknown pod is left out of the load (unknown is not idle), and counted apart.
    pytest.param(["10.0.0.1:8000", "10.0.0.3:8000"], PoolLoad(2, 1, 3, 8, 0.5), id="unknown-pod-left-out"),
    # With no pod known the load is unknown: NaN, never a reassuring 0 that would scale a pool down.
    pytest.param(["10.0.0.3:8000", "10.0.0.4:8000"], PoolLoad(2, 0, NAN, NAN, NAN), id="none-known-is-nan"),
    pytest.param(["10.0.0.1:8000", "10.0.0.1:8000"], PoolLoad(1, 1, 3, 8, 0.5), id="a-pod-listed-twice-counts-once"),
    pytest.param([], PoolLoad(0, 0, NAN, NAN, NAN), id="no-endpoints"),
])
def test_pool_loads(endpoints: list[str], expected: PoolLoad) -> None:
    load = pool_loads(STATES, {"general": endpoints})["general"]
    assert (load.pods, load.pods_known) == (expected.pods, expected.pods_known)
    for field in ("waiting", "running", "kv_usage_mean"):
        assert same(getattr(load, field), getattr(expected, field)), field


def test_pod_states_tell_on_update_what_is_fresh() -> None:
    now = [100.0]
    heard: list[dict[str, PodState]] = []
    states = PodStates(stale_after_s=4.0, clock=lambda: now[0], on_update=lambda fresh: heard.append(dict(fresh)))
    states.update([state("a:1", waiting=2), state("b:1", waiting=1)])
    assert sorted(heard[-1]) == ["a:1", "b:1"]
    now[0] = 103.0
    states.update([state("a:1", waiting=7, scraped_at=103.0)])  # b is 3 s old: still fresh
    assert heard[-1]["a:1"].waiting == 7 and "b:1" in heard[-1]
    now[0] = 105.0
    states.update([])  # b is now 5 s old: stale, and no longer handed on
    assert sorted(heard[-1]) == ["a:1"]
    assert len(heard) == 3


def test_pod_states_without_a_hook_behave_as_before() -> None:
    states = PodStates(stale_after_s=4.0, clock=lambda: 100.0)
    states.update([state("a:1", waiting=2)])
    assert states.get("a:1") is not None and list(states.snapshot()) == ["a:1"]


def test_gauges_follow_each_update_and_a_config_reload() -> None:
    metrics = GatewayMetrics()
    pools: dict[str, list[str]] = {"general": ["10.0.0.1:8000", "10.0.0.2:8000"], "big": ["10.0.0.9:8000"]}
    states = PodStates(stale_after_s=4.0, clock=lambda: 100.0, on_update=metrics.pool_feed(lambda: pools))
    states.update(STATES.values())
    assert gauge(metrics, "llmgw_pool_queue_depth", "general") == 8
    assert gauge(metrics, "llmgw_pool_requests_running", "general") == 24
    assert same(gauge(metrics, "llmgw_pool_kv_cache_usage_ratio", "general") or 0.0, 0.7)
    assert gauge(metrics, "llmgw_pool_pods_known", "general") == 2
    assert gauge(metrics, "llmgw_pool_queue_depth", "big") == 100

    pools = {"general": ["10.0.0.1:8000", "10.0.0.3:8000"]}  # reloaded: a pod replaced, pool `big` gone
    states.update([])
    assert gauge(metrics, "llmgw_pool_queue_depth", "general") == 3  # the new pod is not known yet
    assert gauge(metrics, "llmgw_pool_pods_known", "general") == 1
    assert math.isnan(gauge(metrics, "llmgw_pool_queue_depth", "big") or 0.0)  # unknown, not 0
    assert gauge(metrics, "llmgw_pool_pods_known", "big") == 0


VLLM_METRICS = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 6.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 12.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75
"""


async def test_a_scrape_landing_sets_the_gauges(tmp_path: Path) -> None:
    """Through the real shell: a pod's /metrics scraped by ``gather_forever`` reaches the gauges."""
    async def pod_metrics(_: web.Request) -> web.Response:
        return web.Response(text=VLLM_METRICS)

    async def pod_models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_get("/metrics", pod_metrics)
    app.router.add_get("/v1/models", pod_models)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    endpoint = f"127.0.0.1:{server.port}"
    metrics = GatewayMetrics()
    states = PodStates(stale_after_s=5.0, on_update=metrics.pool_feed(lambda: {"general": [endpoint]}))
    task = asyncio.create_task(gather_forever(lambda: {endpoint: VLLM}, tmp_path / "pods.json", 0.05, states))
    try:
        await eventually(lambda: gauge(metrics, "llmgw_pool_pods_known", "general") == 1, 5,
                         what="the scrape reaching the gauges")
        assert gauge(metrics, "llmgw_pool_queue_depth", "general") == 6
        assert gauge(metrics, "llmgw_pool_requests_running", "general") == 12
        assert gauge(metrics, "llmgw_pool_kv_cache_usage_ratio", "general") == 0.75
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.close()


_WORKER = """
import sys
from extproc.routing.podstate import PoolLoad
from extproc.telemetry.metrics import GatewayMetrics
GatewayMetrics().pools({"general": PoolLoad(2, 2, float(sys.argv[1]), 1.0, 0.5)})
"""


def test_workers_of_a_node_report_the_most_recent_value(tmp_path: Path) -> None:
    """Several extproc workers each set the gauge from the node's shared snapshot; the node's
    /metrics (their files summed by the launcher) shows the latest, not a sum or a stale maximum."""
    env = {**os.environ, MULTIPROC_ENV: str(tmp_path)}
    for waiting in ("9", "4"):  # a worker that saw a long queue, then one that sees it drained
        subprocess.run([sys.executable, "-c", _WORKER, waiting], env=env, cwd=REPO, check=True, timeout=60)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    assert gauge(registry, "llmgw_pool_queue_depth", "general") == 4


def test_every_pool_of_the_config_gets_a_load() -> None:
    assert sorted(pool_loads({}, {"a": ["10.0.0.1:1"], "b": []})) == ["a", "b"]
