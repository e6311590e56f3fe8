"""The response cache's store: fresh and stale entries, the Bloom-filter guard in front of the
backend, a failing backend as a miss, and keys announced between processes, on a shared SQLite
file and on a real Redis."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import redis

from extproc.cache.store import ENTRY_PREFIX, CacheBackend, HotKeys, RedisBackend, ResponseCache, SqliteBackend
from llmgw_testing.redis_server import RedisServer
from tests.helpers import eventually

VALUE = b'{"kind":"chat","model":"m","choices":[],"usage":{}}'
T0 = 1_700_000_000.0


def digests(n: int, seed: int) -> list[bytes]:
    """``n`` distinct 32-byte keys, the same on every run (standing in for ``cache_key``)."""
    blob = random.Random(seed).randbytes(32 * n)
    return [blob[i:i + 32] for i in range(0, len(blob), 32)]


class FakeClock:
    """Epoch seconds that move only when the test says so."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class CountingBackend:
    """A backend that counts the lookups reaching it and hands everything to ``inner``."""

    def __init__(self, inner: CacheBackend) -> None:
        self.inner = inner
        self.gets = 0

    async def get(self, key: bytes) -> tuple[bytes, int] | None:
        self.gets += 1
        return await self.inner.get(key)

    async def put(self, key: bytes, value: bytes, fresh_until_ms: int, keep_ms: int) -> None:
        await self.inner.put(key, value, fresh_until_ms, keep_ms)

    async def known(self) -> list[bytes]:
        return await self.inner.known()

    async def added(self) -> list[bytes]:
        return await self.inner.added()

    async def close(self) -> None:
        await self.inner.close()


class BrokenBackend(CountingBackend):
    """Stores, but every lookup fails the way an unreachable store does."""

    def __init__(self, inner: CacheBackend, error: Exception) -> None:
        super().__init__(inner)
        self.error = error

    async def get(self, key: bytes) -> tuple[bytes, int] | None:
        self.gets += 1
        raise self.error



class Processes:
    """The test's gateway processes: one ``ResponseCache`` each and its ``follow()`` task."""

    def __init__(self) -> None:
        self.backends: list[CacheBackend] = []
        self.tasks: list[asyncio.Task[None]] = []

    def cache(self, backend: CacheBackend, clock: Callable[[], float] = time.time) -> ResponseCache:
        self.backends.append(backend)
        return ResponseCache(backend, clock=clock)

    async def follow(self, cache: ResponseCache, within_s: float = 3.0) -> None:
        """Start ``cache.follow()`` and wait until its filter holds every key stored so far."""
        self.tasks.append(asyncio.create_task(cache.follow()))
        await eventually(cache.ready.is_set, within_s)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for backend in self.backends:
            await backend.close()


@pytest.fixture
async def processes() -> AsyncIterator[Processes]:
    running = Processes()
    yield running
    await running.stop()  # the follow tasks first, then the connections they use


@pytest.fixture
def admin(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain redis-py client, to look at what the cache left in Redis."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


# --- SQLite: one file shared by the node's processes ----------------------------------------------


async def test_sqlite_file_shares_answers_between_processes(tmp_path, processes: Processes) -> None:
    path = tmp_path / "cache.db"
    a = processes.cache(SqliteBackend(path))
    b = processes.cache(SqliteBackend(path))
    before, after = digests(2, seed=1)

    await a.store(before, b"answer-before", ttl_s=60, stale_ttl_s=600)
    await processes.follow(b)
    assert before in b.bloom  # read from the table when B started
    assert after not in b.bloom

    await a.store(after, b"answer-after", ttl_s=60, stale_ttl_s=600)
    await eventually(lambda: after in b.bloom, timeout=2.0)  # B polls the table every POLL_S
    assert await b.lookup(before) == b"answer-before"
    assert await b.lookup(after) == b"answer-after"
    assert (b.counters.hits, b.counters.misses, b.counters.filtered) == (2, 0, 0)


@pytest.mark.parametrize(("elapsed_s", "fresh", "stale"), [
    pytest.param(0.0, True, True, id="just-stored"),
    pytest.param(59.999, True, True, id="last-fresh-millisecond"),
    pytest.param(60.0, False, True, id="ttl-over-stale-only"),
    pytest.param(359.999, False, True, id="last-stale-millisecond"),
    pytest.param(360.0, False, False, id="ttl-plus-stale-ttl-over-gone"),
])
async def test_entry_is_fresh_then_stale_then_gone(tmp_path, processes: Processes, elapsed_s: float,
                                                   fresh: bool, stale: bool) -> None:
    clock = FakeClock()
    cache = processes.cache(SqliteBackend(tmp_path / "cache.db", clock=clock), clock=clock)
    key, = digests(1, seed=2)
    await cache.store(key, VALUE, ttl_s=60, stale_ttl_s=300)

    clock.now += elapsed_s
    assert await cache.lookup(key) == (VALUE if fresh else None)
    assert await cache.stale(key) == (VALUE if stale else None)
    # A stale or expired entry is a miss the store answered: the filter still holds its key.
    assert (cache.counters.hits, cache.counters.misses) == ((1, 0) if fresh else (0, 1))


# --- the guard ------------------------------------------------------------------------------------


async def test_ready_filter_answers_never_stored_keys_without_the_backend(processes: Processes) -> None:
    backend = CountingBackend(SqliteBackend())
    cache = processes.cache(backend)
    stored = digests(10, seed=3)
    for key in stored:
        await cache.store(key, VALUE, ttl_s=60, stale_ttl_s=600)
    await processes.follow(cache)

    flood = digests(1000, seed=4)
    assert [await cache.lookup(key) for key in flood] == [None] * len(flood)
    assert [await cache.stale(key) for key in flood[:100]] == [None] * 100
    assert backend.gets == 0  # not one round trip for 1000 prompts never answered
    assert (cache.counters.filtered, cache.counters.misses, cache.counters.errors) == (1000, 0, 0)

    assert await cache.lookup(stored[7]) == VALUE
    assert backend.gets == 1  # a stored key still goes to the store


async def test_lookups_reach_the_backend_until_the_filter_is_filled(processes: Processes) -> None:
    backend = CountingBackend(SqliteBackend())
    cache = processes.cache(backend)  # not following yet: the filter knows nothing
    earlier, = digests(1, seed=5)
    await backend.put(earlier, VALUE, int((time.time() + 60) * 1000), 600_000)  # another process stored it

    assert not cache.ready.is_set()
    assert await cache.lookup(earlier) == VALUE  # found although this process's filter lacks it
    assert [await cache.lookup(key) for key in digests(10, seed=6)] == [None] * 10
    assert backend.gets == 11
    assert (cache.counters.hits, cache.counters.misses, cache.counters.filtered) == (1, 10, 0)

    await processes.follow(cache)
    assert earlier in cache.bloom
    assert await cache.lookup(digests(1, seed=7)[0]) is None
    assert (backend.gets, cache.counters.filtered) == (11, 1)  # filled: an unknown key stays here


@pytest.mark.parametrize("error", [
    pytest.param(ConnectionError("redis: connection refused"), id="outage"),
    pytest.param(TimeoutError(), id="timeout"),
])
async def test_failing_backend_is_a_miss_and_counted(processes: Processes, error: Exception) -> None:
    backend = BrokenBackend(SqliteBackend(), error)
    cache = processes.cache(backend)
    key, = digests(1, seed=8)
    await cache.store(key, VALUE, ttl_s=60, stale_ttl_s=600)

    assert await cache.lookup(key) is None
    assert await cache.stale(key) is None
    assert backend.gets == 2
    assert (cache.counters.errors, cache.counters.hits, cache.counters.misses) == (1, 0, 0)


@pytest.mark.parametrize(("error", "logged"), [
    pytest.param(ConnectionError("redis: connection refused"), "redis: connection refused", id="with-message"),
    pytest.param(TimeoutError(), "TimeoutError", id="without-message"),
])
async def test_failing_lookup_logs_what_failed(processes: Processes, caplog: pytest.LogCaptureFixture,
                                               error: Exception, logged: str) -> None:
    cache = processes.cache(BrokenBackend(SqliteBackend(), error))
    with caplog.at_level(logging.WARNING, logger="llmgw.cache"):
        assert await cache.lookup(digests(1, seed=8)[0]) is None
    assert caplog.messages == [f"response cache lookup failed: {logged}"]


# --- Redis ----------------------------------------------------------------------------------------


async def test_redis_process_started_later_finds_keys_stored_before_and_after(
        redis_server: RedisServer, processes: Processes) -> None:
    a = processes.cache(RedisBackend(redis_server.url))
    before, after = os.urandom(32), os.urandom(32)  # the session's Redis outlives this test
    await a.store(before, b"answer-before", ttl_s=60, stale_ttl_s=600)

    b = processes.cache(RedisBackend(redis_server.url))
    await processes.follow(b)
    # Found by the SCAN: B reads the stream only after its newest entry at start, which is `before`'s.
    assert before in b.bloom
    assert after not in b.bloom

    await a.store(after, b"answer-after", ttl_s=60, stale_ttl_s=600)
    await eventually(lambda: after in b.bloom, timeout=2.0)  # announced on the stream, XREAD wakes at once
    assert await b.lookup(before) == b"answer-before"
    assert await b.lookup(after) == b"answer-after"
    assert (b.counters.hits, b.counters.misses, b.counters.filtered) == (2, 0, 0)


async def test_redis_entry_is_kept_ttl_plus_stale_ttl_with_its_fresh_until(
        redis_server: RedisServer, processes: Processes, admin: redis.Redis) -> None:
    clock = FakeClock(time.time())
    cache = processes.cache(RedisBackend(redis_server.url), clock=clock)
    key = os.urandom(32)
    await cache.store(key, VALUE, ttl_s=60, stale_ttl_s=600)

    assert 655_000 < admin.pttl(ENTRY_PREFIX + key) <= 660_000  # PX ttl + stale ttl
    raw = admin.get(ENTRY_PREFIX + key)
    assert raw is not None
    assert int.from_bytes(raw[:8], "big") == int(clock.now * 1000) + 60_000  # fresh until, epoch ms
    assert raw[8:] == VALUE

    assert await cache.lookup(key) == VALUE
    clock.now += 60
    assert await cache.lookup(key) is None  # Redis still keeps it: stale
    assert await cache.stale(key) == VALUE


def get_calls(admin: redis.Redis) -> int:
    return int(admin.info("commandstats").get("cmdstat_get", {}).get("calls", 0))


async def test_redis_flood_of_unknown_keys_sends_no_get(
        redis_server: RedisServer, processes: Processes, admin: redis.Redis) -> None:
    cache = processes.cache(RedisBackend(redis_server.url))
    stored = os.urandom(32)
    await cache.store(stored, VALUE, ttl_s=60, stale_ttl_s=600)
    await processes.follow(cache)

    before = get_calls(admin)
    flood = digests(500, seed=9)
    assert [await cache.lookup(key) for key in flood] == [None] * len(flood)
    assert get_calls(admin) == before  # not one GET for 500 prompts never answered
    assert cache.counters.filtered == 500

    assert await cache.lookup(stored) == VALUE
    assert get_calls(admin) == before + 1  # the counter does see a lookup that reaches Redis


async def test_redis_close_releases_every_connection(own_redis_server: RedisServer) -> None:
    admin = redis.Redis.from_url(own_redis_server.url)
    try:
        def connected() -> int:
            return int(admin.info("clients")["connected_clients"])

        baseline = connected()  # this admin client
        backend = RedisBackend(own_redis_server.url)
        await ResponseCache(backend).store(os.urandom(32), VALUE, ttl_s=60, stale_ttl_s=600)  # the fast one
        await backend.known()  # the redis-py one
        assert connected() == baseline + 2

        await backend.close()
        await eventually(lambda: connected() == baseline, timeout=0.5)
    finally:
        admin.close()


# --- the hot-key allow-list -----------------------------------------------------------------------


def test_hot_keys_keep_an_answer_once_hit_min_hits_times() -> None:
    hot = HotKeys(size=2, min_hits=3)
    a, b, c = digests(3, seed=20)
    hot.hit(a, b"A", fresh_until_ms=1000)
    hot.hit(a, b"A", fresh_until_ms=1000)
    assert hot.get(a, now_ms=0) is None  # two hits: not hot yet
    hot.hit(a, b"A", fresh_until_ms=1000)
    assert hot.get(a, now_ms=0) == b"A"
    assert hot.get(a, now_ms=1000) is None  # no longer fresh: dropped
    assert a not in hot.kept

    for key in (a, b, c):  # three hot keys in a list of two: the least recently used leaves
        for _ in range(3):
            hot.hit(key, key[:1], fresh_until_ms=5000)
    assert list(hot.kept) == [b, c]
    hot.forget(b)
    assert list(hot.kept) == [c]


def test_hot_key_counts_halve_every_window() -> None:
    hot = HotKeys(size=10, min_hits=3, window=4)
    old, new = digests(2, seed=21)
    hot.hit(old, b"x", 10)
    hot.hit(old, b"x", 10)
    hot.hit(new, b"y", 10)
    hot.hit(new, b"y", 10)  # the window's 4th hit: old 2 -> 1, new 2 -> 1
    hot.hit(old, b"x", 10)
    assert hot.get(old, 0) is None  # 2 after the decay, not the 3 it would have been


def test_hot_keys_of_size_zero_keep_nothing() -> None:
    hot = HotKeys(size=0)
    key, = digests(1, seed=22)
    for _ in range(10):
        hot.hit(key, b"x", 10)
    assert hot.get(key, 0) is None and not hot.kept


async def test_hot_key_is_answered_without_a_round_trip(processes: Processes) -> None:
    backend = CountingBackend(SqliteBackend())
    clock = FakeClock(time.time())
    cache = ResponseCache(backend, clock=clock, hot=HotKeys(min_hits=3))
    processes.backends.append(backend)
    key, = digests(1, seed=23)
    await cache.store(key, VALUE, ttl_s=60, stale_ttl_s=600)
    await processes.follow(cache)

    assert [await cache.lookup(key) for _ in range(10)] == [VALUE] * 10
    assert backend.gets == 3  # until it is hot; then from the process
    assert (cache.counters.hits, cache.counters.hot) == (10, 7)

    clock.now += 60  # no longer fresh: neither the kept copy nor the stored one answers
    assert await cache.lookup(key) is None
    assert backend.gets == 4


@pytest.mark.parametrize("shared", ["redis_server", "redis_cluster"])
async def test_hot_key_stored_again_by_another_process_is_fetched_again(
        shared: str, request: pytest.FixtureRequest, processes: Processes) -> None:
    # On one Redis or a cluster (the announcement stream lives on one primary, the key on another):
    # what each process keeps of a hot key converges on what was stored last.
    url = request.getfixturevalue(shared).url
    a = processes.cache(RedisBackend(url))
    b = processes.cache(RedisBackend(url))
    await processes.follow(b)
    key = os.urandom(32)
    await a.store(key, b"first", ttl_s=60, stale_ttl_s=600)
    await eventually(lambda: key in b.bloom, timeout=2.0)
    for _ in range(5):
        assert await b.lookup(key) == b"first"
    assert key in b.hot_keys.kept

    await a.store(key, b"second", ttl_s=60, stale_ttl_s=600)  # e.g. after the first expired
    await eventually(lambda: key not in b.hot_keys.kept, timeout=2.0)  # the announcement drops it
    assert await b.lookup(key) == b"second"


class SwallowingBackend(CountingBackend):
    """Answers ``added`` and ``shared`` even when cancelled, as redis-py 8.1 does with a command
    cancelled before it started: the cancellation is lost unless the caller looks for it."""

    def __init__(self, inner: CacheBackend) -> None:
        super().__init__(inner)
        self.calls = {"added": 0, "shared": 0}

    async def _swallowing(self) -> list[bytes]:
        try:
            await asyncio.sleep(0.001)  # the command's round trip, where the cancellation lands
        except asyncio.CancelledError:
            pass
        return []

    async def added(self) -> list[bytes]:
        self.calls["added"] += 1
        return await self._swallowing()

    async def shared(self) -> list[bytes]:
        self.calls["shared"] += 1
        return await self._swallowing()


async def test_following_stops_when_cancelled_even_if_the_backend_swallows_it() -> None:
    backend = SwallowingBackend(SqliteBackend())
    cache = ResponseCache(backend)
    follower = asyncio.create_task(cache.follow())
    sharer = asyncio.create_task(cache.follow_shared(lambda records: asyncio.sleep(0)))
    # Both loops are going round: each has asked the backend twice.
    await eventually(lambda: min(backend.calls.values()) >= 2, timeout=2.0, what="both loops polling")
    follower.cancel()
    sharer.cancel()
    done, _ = await asyncio.wait({follower, sharer}, timeout=2.0)
    assert done == {follower, sharer} and follower.cancelled() and sharer.cancelled()
    await backend.close()
