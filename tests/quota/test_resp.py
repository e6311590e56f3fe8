"""``PipelinedConnection`` against a real redis-server: order, errors, timeouts, outages, uvloop."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop

from extproc.quota.resp import PipelinedConnection, RedisReplyError
from llmgw_testing.redis_server import RedisServer


async def test_many_concurrent_callers_each_get_their_own_reply(redis_server: RedisServer) -> None:
    connection = PipelinedConnection(redis_server.url)
    try:
        replies = await asyncio.gather(*(connection.call("ECHO", f"caller-{i}") for i in range(2000)))
        assert replies == [f"caller-{i}".encode() for i in range(2000)]  # FIFO matching never mixes them up
    finally:
        await connection.close()


async def test_an_error_reply_fails_only_its_own_call(redis_server: RedisServer) -> None:
    connection = PipelinedConnection(redis_server.url)
    try:
        results = await asyncio.gather(connection.call("ECHO", "a"), connection.call("NOSUCHCOMMAND"),
                                       connection.call("ECHO", "b"), return_exceptions=True)
        assert results[0] == b"a" and results[2] == b"b"
        assert isinstance(results[1], RedisReplyError) and "unknown command" in str(results[1]).lower()
    finally:
        await connection.close()


async def test_calls_go_together_in_order_and_an_error_reply_comes_back_in_its_place(
        redis_server: RedisServer) -> None:
    connection = PipelinedConnection(redis_server.url)
    key = f"calls-{time.monotonic_ns()}"
    try:
        replies = await connection.calls([("SET", key, "1"), ("NOSUCHCOMMAND",), ("INCR", key), ("WAIT", 0, 0)])
        assert replies[0] == b"OK" and replies[2] == 2 and replies[3] == 0  # no replica: WAIT counts none
        assert isinstance(replies[1], RedisReplyError)
    finally:
        await connection.close()


async def test_deferred_calls_are_written_within_the_batch_interval(redis_server: RedisServer) -> None:
    connection = PipelinedConnection(redis_server.url, batch_s=0.05)
    try:
        started = time.monotonic()
        assert await connection.call("ECHO", "later", later=True) == b"later"
        assert 0.04 <= time.monotonic() - started < 0.5
        # An urgent call takes the deferred ones along at once.
        deferred = asyncio.ensure_future(connection.call("ECHO", "deferred", later=True))
        await asyncio.sleep(0)  # one turn of the loop, not a wait: the deferred call is queued, unwritten
        started = time.monotonic()
        assert await connection.call("ECHO", "now") == b"now"
        assert await deferred == b"deferred"
        assert time.monotonic() - started < 0.04
    finally:
        await connection.close()


async def test_a_late_reply_breaks_the_connection_and_the_next_call_reconnects(redis_server: RedisServer) -> None:
    connection = PipelinedConnection(redis_server.url, timeout_s=0.2)
    admin = PipelinedConnection(redis_server.url, timeout_s=5.0)
    try:
        assert await connection.call("PING") == b"PONG"
        # Answered at once, then Redis holds every client's commands for 0.5 s: the next reply is late.
        assert await admin.call("CLIENT", "PAUSE", "500") == b"OK"
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await connection.call("PING")
        assert time.monotonic() - started < 0.45  # the caller is not held past its timeout
        assert await admin.call("PING") == b"PONG"  # answered when the pause ends
        assert await connection.call("ECHO", "again") == b"again"
    finally:
        await connection.close()
        await admin.close()


async def test_outage_then_recovery(own_redis_server: RedisServer) -> None:
    connection = PipelinedConnection(own_redis_server.url, timeout_s=0.3)
    try:
        assert await connection.call("SET", "k", "v") == b"OK"
        own_redis_server.stop()
        # Whether or not the connection has seen it close yet, the call fails as an outage.
        with pytest.raises((ConnectionError, TimeoutError)):
            await connection.call("PING")
        own_redis_server.start()
        assert await connection.call("PING") == b"PONG"
    finally:
        await connection.close()


def test_works_on_uvloop(redis_server: RedisServer) -> None:
    # The extproc server runs on uvloop, whose transports are not asyncio.Transport subclasses.
    async def main() -> list[bytes]:
        connection = PipelinedConnection(redis_server.url)
        try:
            return list(await asyncio.gather(*(connection.call("ECHO", str(i)) for i in range(100))))
        finally:
            await connection.close()

    assert uvloop.run(main()) == [str(i).encode() for i in range(100)]


async def test_wrong_password_is_a_reply_error_not_an_outage(redis_server: RedisServer) -> None:
    url = redis_server.url.replace("redis://", "redis://:wrong@")
    connection = PipelinedConnection(url)
    with pytest.raises(RedisReplyError):
        await connection.call("PING")
    await connection.close()
