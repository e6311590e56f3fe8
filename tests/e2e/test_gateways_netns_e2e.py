"""Gateways on several nodes: two `llmgw up` stacks (Envoy, extproc, a simulated pod), each in a
network namespace of its own that the test creates, share one Redis Cluster bound to the bridge
between them. A tenant's rpm and concurrency hold exactly across both; a key revoked is refused
by both within seconds; the ledger counts each request once; an answer cached on one is served
by the other, its paraphrase too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from extproc.ledger import read_stream
from llmgw_testing.netns import Bridge, Node
from llmgw_testing.redis_cluster import RedisCluster
from llmgw_testing.redis_server import redis_binary
from tests.e2e.conftest import MODEL, BackgroundStream
from tests.e2e.test_cli_up import STARTUP_S, Launched
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(300)
LLMGW = str(Path(sys.executable).with_name("llmgw"))
PORT = 10000  # each namespace has its own ports: the same one on both


def _config(redis_url: str) -> dict[str, object]:
    return {
        "redis_url": redis_url,
        "pools": [{"name": "local", "simulate": 1}],
        "models": [{"name": MODEL, "pool": "local", "cache": {"ttl_s": 300, "semantic": {}}}],
        "tenants": [{"name": "shared", "limits": {"rpm": 10}}, {"name": "solo", "limits": {"concurrency": 1}},
                    {"name": "open"}],
    }


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisCluster, list[str]]]:
    binary = redis_binary()
    assert binary is not None
    root = tmp_path_factory.mktemp("netns")
    with Bridge.create(2) as bridge:
        cluster = RedisCluster(binary, root / "redis", masters=3, host=bridge.host)
        launched: list[Launched] = []
        try:
            cluster.start()
            config = root / "llmgw.yaml"
            config.write_text(yaml.safe_dump(_config(cluster.url)))
            env = {k: v for k, v in os.environ.items() if k != "LLMGW_DEV_KEY"}
            for index, node in enumerate(bridge.nodes):
                argv = node.wrap([sys.executable, "-m", "extproc.cli", "up", "--config", str(config),
                                  "--port", str(PORT), "--host", "0.0.0.0", "--workers", "1",
                                  "--run-dir", str(root / f"run-{index}")])
                launched.append(Launched.start(argv, root / f"stderr-{index}.txt", env=env))
            for gateway in launched:
                gateway.read_until("Ctrl-C stops everything", STARTUP_S)
            yield cluster, [_url(node) for node in bridge.nodes]
        finally:
            for gateway in launched:
                gateway.kill()
            cluster.stop()


def _url(node: Node) -> str:
    return f"http://{node.address}:{PORT}"


def _add_key(cluster: RedisCluster, tenant: str) -> str:
    key = f"sk-netns-{uuid.uuid4().hex}"
    subprocess.run([LLMGW, "keys", "add", "--tenant", tenant, "--key", key, "--redis-url", cluster.url],
                   capture_output=True, text=True, timeout=30, check=True, env={**os.environ, "LLMGW_REDIS_URL": ""})
    return key


def _chat(base_url: str, key: str, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {key}", "x-request-id": f"netns-{uuid.uuid4().hex}"})


def _known_everywhere(urls: list[str], key: str) -> None:
    wait_for("the key known on every gateway", lambda: all(
        httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=10).status_code == 200
        for url in urls), 15, interval=0.2)


def test_rpm_and_concurrency_hold_exactly_across_gateways(nodes: tuple[RedisCluster, list[str]]) -> None:
    cluster, urls = nodes
    shared = _add_key(cluster, "shared")
    _known_everywhere(urls, shared)
    answers = [_chat(urls[n % 2], shared) for n in range(16)]  # alternating gateways
    assert [a.status_code for a in answers].count(200) == 10  # rpm 10, across both
    assert {a.status_code for a in answers[10:]} == {429}
    solo = _add_key(cluster, "solo")
    _known_everywhere(urls, solo)
    with BackgroundStream(urls[0], max_tokens=400, headers={"authorization": f"Bearer {solo}"}) as stream:
        refused = _chat(urls[1], solo)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        stream.join()
    wait_for("the slot back, seen from the other gateway", lambda: _chat(urls[1], solo).status_code == 200, 15)
    # The ledger holds each answered request once, whichever gateway settled it.
    sent = {a.request.headers["x-request-id"] for a in answers if a.status_code == 200}
    wait_for("every request in the ledger", lambda: sent <= {r.request_id for r in read_stream(cluster.url)}, 30,
             interval=0.2)
    counted = [r.request_id for r in read_stream(cluster.url) if r.request_id in sent]
    assert sorted(counted) == sorted(sent)


def test_a_key_revoked_on_one_is_refused_by_all(nodes: tuple[RedisCluster, list[str]]) -> None:
    cluster, urls = nodes
    key = _add_key(cluster, "open")
    _known_everywhere(urls, key)
    subprocess.run([LLMGW, "keys", "revoke", "--key", key, "--redis-url", cluster.url], capture_output=True,
                   text=True, timeout=30, check=True, env={**os.environ, "LLMGW_REDIS_URL": ""})
    revoked = time.monotonic()
    wait_for("the key refused everywhere", lambda: all(_chat(url, key).status_code == 401 for url in urls), 15,
             interval=0.1)
    assert time.monotonic() - revoked < 6.0  # keys.poll_s is 1 s; a loaded machine takes longer


def test_an_answer_cached_on_one_gateway_is_served_by_the_other(nodes: tuple[RedisCluster, list[str]]) -> None:
    cluster, urls = nodes
    key = _add_key(cluster, "open")
    _known_everywhere(urls, key)
    topic = uuid.uuid4().hex[:8]
    question = f"What is the capital of France? (ref {topic})"
    first = _chat(urls[0], key, temperature=0, messages=[{"role": "user", "content": question}])
    assert first.status_code == 200 and first.headers.get("x-llmgw-cache") == "miss"
    same = wait_for("the exact answer on the other gateway", lambda: (lambda r: r if r.headers.get(
        "x-llmgw-cache") == "hit" else None)(_chat(urls[1], key, temperature=0,
                                                  messages=[{"role": "user", "content": question}])), 15, interval=0.1)
    answer = first.json()["choices"][0]["message"]["content"]
    assert same.json()["choices"][0]["message"]["content"] == answer
    reworded = question.lower().rstrip("?") + " ?"  # the same words: the semantic index's match
    hit = wait_for("the paraphrase on the other gateway", lambda: (lambda r: r if r.headers.get(
        "x-llmgw-cache") == "hit" else None)(_chat(urls[1], key, temperature=0,
                                                  messages=[{"role": "user", "content": reworded}])), 15, interval=0.1)
    assert hit.json()["choices"][0]["message"]["content"] == answer
    assert "semantic" in hit.headers.get("x-llmgw-cache-match", "")
