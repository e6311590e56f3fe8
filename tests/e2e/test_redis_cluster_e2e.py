"""End to end on a Redis Cluster (3 primaries): every tenant served, whichever node holds its
slot; keys added in the cluster with the CLI work; the ledger counts each request once."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc.launcher import StackInfo
from extproc.ledger import read_stream
from llmgw_testing.redis_cluster import RedisCluster
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
