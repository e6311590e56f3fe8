"""End to end on a Redis Cluster (3 primaries): every tenant served, whichever node holds its
slot; keys added in the cluster with the CLI work; the ledger counts each request once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis.crc import key_slot

from extproc.launcher import StackInfo
from extproc.ledger import read_stream
from llmgw_testing.redis_cluster import RedisCluster
from llmgw_testing.redis_server import redis_binary
from tests.e2e.conftest import MODEL, small_stack
from tests.helpers import wait_for

LLMGW = str(Path(sys.executable).with_name("llmgw"))
TENANTS = [f"team-{i}" for i in range(6)]


@pytest.fixture(scope="module")
def cluster_stack(redis_cluster: RedisCluster, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[StackInfo]:
    extra = {"redis_url": redis_cluster.url,
             "tenants": [{"name": name, "keys": [{"env": f"KEY_{i}"}], "limits": {"rpm": 1000, "concurrency": 4}}
                         for i, name in enumerate(TENANTS)] + [{"name": "keyed", "limits": {"rpm": 1000}}]}
    with small_stack(tmp_path_factory, "cluster-stack", pods=1, extra_config=extra, workers=2,
                     env={f"KEY_{i}": f"sk-cluster-{i}" for i in range(len(TENANTS))}) as info:
        yield info


def _ask(info: StackInfo, key: str, request_id: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", **({"x-request-id": request_id} if request_id else {})}
    return httpx.post(f"{info.base_url}/v1/chat/completions", headers=headers, timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def test_every_tenant_is_served_whichever_node_holds_its_slot(cluster_stack: StackInfo,
                                                              redis_cluster: RedisCluster) -> None:
    sent = {}
    for i, tenant in enumerate(TENANTS):
        request_id = f"cluster-{uuid.uuid4().hex}"
        response = _ask(cluster_stack, f"sk-cluster-{i}", request_id)
        assert response.status_code == 200, (tenant, response.text)
        assert response.headers["x-ratelimit-remaining-requests"] == "999"
        sent[request_id] = tenant
    # The ledger (one stream, one slot) holds each once.
    wait_for("every record in the ledger", lambda: set(sent) <= {r.request_id for r in read_stream(redis_cluster.url)},
             30, interval=0.2)
    counted = [r.request_id for r in read_stream(redis_cluster.url) if r.request_id in sent]
    assert sorted(counted) == sorted(sent)


def test_a_key_added_in_the_cluster_works(cluster_stack: StackInfo, redis_cluster: RedisCluster) -> None:
    key = f"sk-keyed-{uuid.uuid4().hex}"
    subprocess.run([LLMGW, "keys", "add", "--tenant", "keyed", "--key", key, "--redis-url", redis_cluster.url],
                   capture_output=True, text=True, timeout=30, check=True, env={**os.environ, "LLMGW_REDIS_URL": ""})
    wait_for("the key works on both workers", lambda: all(_ask(cluster_stack, key).status_code == 200
                                                           for _ in range(6)), 15)


def _gauge(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


@pytest.mark.timeout(180)
def test_a_primary_killed_under_load_costs_no_request_and_no_ledger_record(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # 3 primaries with a replica each. Three tenants send requests without pause; the primary of
    # one tenant's slot (not the ledger's) is killed. Its replica takes over within seconds;
    # meanwhile that tenant is admitted locally (quota.on_store_error: local). Every request is
    # answered 200, each once in the ledger, and the gateway is back on Redis.
    binary = redis_binary()
    assert binary is not None
    cluster = RedisCluster(binary, tmp_path_factory.mktemp("redis-failover"), masters=3, replicas=1,
                           node_timeout_ms=1000)
    cluster.start()
    try:
        ledger_primary = cluster.primary_of(key_slot(b"llmgw:usage"))
        names = (f"ten-{uuid.uuid4().hex[:6]}" for _ in iter(int, 1))
        tenants = [next(name for name in names if cluster.primary_of(key_slot(
            f"llmgw:quota:{{{name}}}".encode())) is not ledger_primary)]
        tenants += [next(names) for _ in range(2)]
        victim = cluster.primary_of(key_slot(f"llmgw:quota:{{{tenants[0]}}}".encode()))
        extra = {"redis_url": cluster.url, "tenants": [
            {"name": name, "keys": [{"env": f"FAILOVER_KEY_{i}"}], "limits": {"rpm": 100_000}}
            for i, name in enumerate(tenants)]}
        with small_stack(tmp_path_factory, "failover-stack", pods=1, extra_config=extra, metrics_port=0,
                         env={f"FAILOVER_KEY_{i}": f"sk-failover-{i}" for i in range(3)}) as info:
            sent: dict[str, int] = {}
            stop = threading.Event()

            def load(index: int) -> None:
                while not stop.is_set():
                    request_id = f"failover-{uuid.uuid4().hex}"
                    sent[request_id] = _ask(info, f"sk-failover-{index}", request_id).status_code

            threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
            for thread in threads:
                thread.start()
            try:
                wait_for("traffic", lambda: len(sent) >= 30, 30)
                victim.stop()
                assert info.metrics_url is not None
                wait_for("local admissions during the failover", lambda: _gauge(
                    httpx.get(info.metrics_url, timeout=5).text, "llmgw_quota_local_admissions_total") > 0, 30)
                wait_for("back on Redis", lambda: _gauge(
                    httpx.get(info.metrics_url, timeout=5).text, "llmgw_quota_store_degraded") == 0, 30)
                settled = len(sent)
                wait_for("more traffic on the new primary", lambda: len(sent) >= settled + 30, 30)
            finally:
                stop.set()
                for thread in threads:
                    thread.join(30)
            assert set(sent.values()) == {200}, {s for s in sent.values() if s != 200}
            wait_for("every request in the ledger", lambda: set(sent) <= {
                r.request_id for r in read_stream(cluster.url)}, 30, interval=0.5)
            counted = [r.request_id for r in read_stream(cluster.url) if r.request_id in sent]
            assert len(counted) == len(sent)
    finally:
        cluster.stop()
