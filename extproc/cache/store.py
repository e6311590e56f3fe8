"""The response cache: stored answers in Redis (or the node's SQLite file), behind a Bloom filter.

Penetration guard: every process keeps a Bloom filter (m = 1 MiB, k = 3) of the keys that
exist. A lookup for a key the filter has never seen is a miss without a round trip to the store:
a flood of never-seen prompts never reaches Redis. The filter stays correct across processes and
replicas because every store is announced: a Redis Stream (``llmgw:rc:added``, capped) that each
process tails, or, without Redis, the SQLite table's rowids. At start a process fills its filter
from the store (a SCAN, or the table) before it tails, and reads the stream's position first, so
a key stored meanwhile is not lost. A Bloom filter forgets nothing: expired keys stay in it as
false positives (one wasted round trip each) until the process restarts.

Hot-key allow-list: the answers of the keys hit most often (at least ``min_hits`` times in the
current window: counts halve every ``hot_window`` hits; at most ``hot_keys`` of them) are kept in
the process and answered from there, without a round trip: the reference papers' "top 1000 hot
keys" layer (<50 us), which also spares the one Redis shard that would otherwise hold a key every
replica asks for at once. A kept answer is dropped when it stops being fresh, and when any process
stores the key again (the announcement), so it never outlives the stored one.

Each entry is kept ``ttl_s + stale_ttl_s`` and carries the time it stops being fresh: a fresh
lookup ignores a stale copy, which stays for the fallback path (``stale``). Values are the
compact JSON of ``extproc.cache.answers``.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import struct
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

from extproc.cache.filters import BloomFilter, CuckooFilter

log = logging.getLogger("llmgw.cache")
CACHE_PATH_ENV = "LLMGW_CACHE_PATH"
_FRESH = struct.Struct(">Q")  # fresh-until, epoch milliseconds, before the stored answer


class CacheBackend(Protocol):
    """Where entries live. ``get`` returns (value, fresh-until in epoch ms) or None."""

    async def get(self, key: bytes) -> tuple[bytes, int] | None:
        """The entry under ``key``."""
        ...

    async def put(self, key: bytes, value: bytes, fresh_until_ms: int, keep_ms: int) -> None:
        """Store an entry for ``keep_ms`` and announce its key."""
        ...

    async def known(self) -> list[bytes]:
        """Every key stored now; the announcements after this call are ``added`` from here on."""
        ...

    async def added(self) -> list[bytes]:
        """Keys announced since the last call (may wait up to a second for one)."""
        ...

    async def share(self, record: bytes) -> None:
        """Announce ``record`` (a semantic-cache prompt) to every process."""
        ...

    async def shared(self) -> list[bytes]:
        """Records announced since the last call; the first call returns every one kept (may wait
        up to a second for one)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


@dataclass
class CacheCounters:
    """What the cache did, for the metrics."""

    filtered: int = 0  # misses the Bloom filter answered (no round trip)
    misses: int = 0  # misses the store answered (a Bloom false positive, or an expired entry)
    hits: int = 0
    stored: int = 0
    errors: int = 0  # the store failed: a miss
    warmed: int = 0  # hot keys fetched from a pod in the background (``Warmer``)
    hot: int = 0  # hits answered from the hot-key allow-list (no round trip), also counted in ``hits``
    shadow: int = 0  # paraphrase hits a shadow-mode semantic cache found and did not serve


HOT_KEYS = 1000
HOT_MIN_HITS = 3
HOT_WINDOW = 10_000  # hits after which every count halves: what was hot an hour ago fades


class HotKeys:
    """The hot-key allow-list: the keys hit at least ``min_hits`` times lately, with their answers,
    at most ``size`` (the least recently used leaves first). Counts are kept for at most
    8 x ``size`` keys and halve every ``window`` hits."""

    def __init__(self, size: int = HOT_KEYS, min_hits: int = HOT_MIN_HITS, window: int = HOT_WINDOW) -> None:
        self.size = size
        self.min_hits = min_hits
        self.window = window
        self.kept: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()  # key -> (answer, fresh-until ms)
        self._counts: dict[bytes, int] = {}
        self._hits = 0

    def get(self, key: bytes, now_ms: float) -> bytes | None:
        """The kept fresh answer of ``key``, or None."""
        entry = self.kept.get(key)
        if entry is None:
            return None
        if entry[1] <= now_ms:
            del self.kept[key]
            return None
        self.kept.move_to_end(key)
        return entry[0]

    def hit(self, key: bytes, value: bytes, fresh_until_ms: int) -> None:
        """``key`` was found in the store: count it, and keep its answer once it is hot."""
        if self.size <= 0:
            return
        count = self._counts[key] = self._counts.get(key, 0) + 1
        self._hits += 1
        if self._hits >= self.window or len(self._counts) > 8 * self.size:
            self._decay()
        if count >= self.min_hits:
            self.kept[key] = (value, fresh_until_ms)
            self.kept.move_to_end(key)
            while len(self.kept) > self.size:
                self.kept.popitem(last=False)

    def forget(self, key: bytes) -> None:
        """``key`` was stored again: its kept answer may be older than the stored one."""
        self.kept.pop(key, None)

    def _decay(self) -> None:
        self._hits = 0
        self._counts = {key: count // 2 for key, count in self._counts.items() if count > 1}


class ResponseCache:
    """Lookups through the Bloom filter, stores announced to every process."""

    def __init__(self, backend: CacheBackend, bloom: BloomFilter | None = None,
                 clock: Callable[[], float] = time.time, guard: bool = True,
                 hot: HotKeys | None = None) -> None:
        self.backend = backend
        self.bloom = bloom or BloomFilter()
        self.guard = guard  # False: the filter is kept but not consulted (every lookup reaches the store)
        # Keys that missed and have not been stored since: a key found here misses again ("hot").
        # A cuckoo filter, as keys leave it when their answer is stored.
        self.missing = CuckooFilter(capacity=1 << 16)
        self.counters = CacheCounters()
        self.hot_keys = hot if hot is not None else HotKeys()
        self.listeners: list[Callable[[list[bytes]], None]] = []  # told of every key stored, by any process
        self._clock = clock
        self.ready = asyncio.Event()  # the filter holds every key stored before the process started

    async def lookup(self, key: bytes) -> bytes | None:
        """A fresh stored answer, or None (a miss: never an exception, a failing store is a miss)."""
        kept = self.hot_keys.get(key, self._clock() * 1000)
        if kept is not None:  # on the allow-list: no filter, no round trip
            self.counters.hits += 1
            self.counters.hot += 1
            return kept
        if self.guard and key not in self.bloom and self.ready.is_set():
            self.counters.filtered += 1
            self._missed(key)
            return None
        try:
            entry = await self.backend.get(key)
        except Exception as error:  # noqa: BLE001 (a cache that fails is a miss, logged)
            self.counters.errors += 1
            log.warning("response cache lookup failed: %s", str(error) or type(error).__name__)
            return None
        if entry is None or entry[1] <= self._clock() * 1000:
            self.counters.misses += 1
            self._missed(key)
            return None
        self.counters.hits += 1
        self.hot_keys.hit(key, entry[0], entry[1])
        return entry[0]

    def hot(self, key: bytes) -> bool:
        """The key missed before, and nothing was stored under it since."""
        return key in self.missing

    def _missed(self, key: bytes) -> None:
        if key not in self.missing and not self.missing.is_full:
            self.missing.add(key)

    async def stale(self, key: bytes) -> bytes | None:
        """A stored answer, fresh or not (the fallback path's last resort)."""
        if key not in self.bloom and self.ready.is_set():
            return None
        try:
            entry = await self.backend.get(key)
        except Exception:  # noqa: BLE001 (the caller answers 503 instead)
            return None
        return None if entry is None else entry[0]

    async def store(self, key: bytes, value: bytes, ttl_s: float, stale_ttl_s: float) -> None:
        """Keep ``value`` fresh for ``ttl_s``, then stale for ``stale_ttl_s`` more."""
        now_ms = int(self._clock() * 1000)
        await self.backend.put(key, value, now_ms + int(ttl_s * 1000), max(1, int((ttl_s + stale_ttl_s) * 1000)))
        self.bloom.add(key)
        self.hot_keys.forget(key)
        self.counters.stored += 1
        if key in self.missing:
            self.missing.remove(key)
        for listener in self.listeners:  # this process at once; the others when the store announces it
            listener([key])

    async def share(self, record: bytes) -> None:
        """Announce ``record`` to every process (``follow_shared``); a failure is logged."""
        try:
            await self.backend.share(record)
        except Exception as error:  # noqa: BLE001 (the other processes miss one prompt)
            log.warning("response cache: cannot share a prompt: %s", str(error) or type(error).__name__)

    async def follow_shared(self, handle: Callable[[list[bytes]], Awaitable[None]]) -> None:
        """Hand every shared record, those kept from before this process first, to ``handle``, forever."""
        while True:
            _raise_if_cancelled()
            try:
                records = await self.backend.shared()
                if records:
                    await handle(records)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 (a gap: those prompts are not matched here)
                log.warning("response cache: shared prompts interrupted: %s", str(error) or type(error).__name__)
                await asyncio.sleep(1.0)

    async def follow(self) -> None:
        """Fill the filter with the keys stored so far, then add each one announced, forever."""
        while not self.ready.is_set():
            _raise_if_cancelled()
            try:
                self.bloom.add_many(await self.backend.known())
                self.ready.set()
                log.info("response cache: %d keys known", self.bloom.count)
            except Exception as error:  # noqa: BLE001 (lookups go to the store until the filter is filled)
                log.warning("response cache: cannot read the stored keys yet: %s", str(error) or type(error).__name__)
                await asyncio.sleep(1.0)
        while True:
            _raise_if_cancelled()
            try:
                added = await self.backend.added()
                self.bloom.add_many(added)
                for key in added:  # stored by another process: no longer missing here, nor kept as it was
                    if key in self.missing:
                        self.missing.remove(key)
                    self.hot_keys.forget(key)
                for listener in self.listeners:
                    listener(added)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 (a gap: those keys are misses until announced again)
                log.warning("response cache: announcements interrupted: %s", str(error) or type(error).__name__)
                await asyncio.sleep(1.0)


def _raise_if_cancelled() -> None:
    """Raise CancelledError if this task was cancelled. redis-py (8.1) swallows a cancellation that
    arrives before a command has started, returning as if it had run: a loop around one would go
    on forever after ``cancel()``."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


# -- Redis -----------------------------------------------------------------------------------------

ENTRY_PREFIX = b"llmgw:rc:e:"
ADDED_STREAM = b"llmgw:rc:added"
ADDED_MAXLEN = 1_000_000  # announcements kept: far more than a process can fall behind
SHARED_STREAM = b"llmgw:rc:prompts"
SHARED_MAXLEN = 100_000  # semantic-cache prompts kept for processes that start later


class RedisBackend:
    """Entries as strings with a TTL; announcements on a capped stream. Lookups share the quota
    path's pipelined connection style (one connection, hiredis); the scan and the tail use redis-py."""

    def __init__(self, url: str, timeout_s: float = 0.5) -> None:
        from extproc.quota.cluster import client, pipelined

        self._fast = pipelined(url, timeout_s=timeout_s)
        self._slow = client(url, socket_timeout=5.0)
        self._last_id = b"$"
        self._shared_id: bytes | None = None  # None: not read yet (the first read starts at the oldest)

    async def get(self, key: bytes) -> tuple[bytes, int] | None:
        """See ``CacheBackend.get``."""
        value = await self._fast.call(b"GET", ENTRY_PREFIX + key)
        if value is None or len(value) < _FRESH.size:
            return None
        return value[_FRESH.size:], _FRESH.unpack_from(value)[0]

    async def put(self, key: bytes, value: bytes, fresh_until_ms: int, keep_ms: int) -> None:
        """See ``CacheBackend.put``."""
        await asyncio.gather(
            self._fast.call(b"SET", ENTRY_PREFIX + key, _FRESH.pack(fresh_until_ms) + value, b"PX", keep_ms),
            self._fast.call(b"XADD", ADDED_STREAM, b"MAXLEN", b"~", ADDED_MAXLEN, b"*", b"k", key))

    async def known(self) -> list[bytes]:
        """See ``CacheBackend.known``: the stream's position first, then a SCAN."""
        newest = cast("list[tuple[bytes, dict[bytes, bytes]]]", await self._slow.xrevrange(ADDED_STREAM, count=1))
        self._last_id = newest[0][0] if newest else b"0-0"
        keys = []
        async for name in self._slow.scan_iter(match=ENTRY_PREFIX + b"*", count=1000):
            keys.append(bytes(name)[len(ENTRY_PREFIX):])
        return keys

    async def added(self) -> list[bytes]:
        """See ``CacheBackend.added``: XREAD, blocking up to a second."""
        keys, self._last_id = await self._read(ADDED_STREAM, self._last_id, b"k", block=True)
        return keys

    async def _read(self, stream: bytes, after: bytes, field: bytes, block: bool) -> tuple[list[bytes], bytes]:
        """The ``field`` of up to 1000 entries of ``stream`` after ``after`` (waiting up to a second
        for one if ``block``), and the id of the last entry read (``after`` if none)."""
        reply = cast("list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] | None",
                     await self._slow.xread({stream: after}, count=1000, block=1000 if block else None))
        values = []
        for _, entries in reply or ():
            for entry_id, fields in entries:
                after = entry_id
                if field in fields:
                    values.append(fields[field])
        return values, after

    async def share(self, record: bytes) -> None:
        """See ``CacheBackend.share``."""
        await self._fast.call(b"XADD", SHARED_STREAM, b"MAXLEN", b"~", SHARED_MAXLEN, b"*", b"r", record)

    async def shared(self) -> list[bytes]:
        """See ``CacheBackend.shared``: the kept ones in pages, then XREAD, blocking up to a second."""
        first = self._shared_id is None
        records, self._shared_id = await self._read(SHARED_STREAM, self._shared_id or b"0-0", b"r", block=not first)
        return records

    async def close(self) -> None:
        """See ``CacheBackend.close``."""
        await self._slow.aclose()
        await self._fast.close()


# -- SQLite (no Redis) -------------------------------------------------------------------------------

# AUTOINCREMENT: a sequence number is never reused, even after the newest entry is purged.
_SCHEMA = """CREATE TABLE IF NOT EXISTS entry (seq INTEGER PRIMARY KEY AUTOINCREMENT, key BLOB NOT NULL UNIQUE,
    value BLOB NOT NULL, fresh_until INTEGER NOT NULL, expires INTEGER NOT NULL)"""
_SHARED_SCHEMA = "CREATE TABLE IF NOT EXISTS shared (seq INTEGER PRIMARY KEY AUTOINCREMENT, record BLOB NOT NULL)"
SHARED_KEPT = 100_000  # semantic-cache prompts kept for processes that start later
POLL_S = 0.05  # how often a process looks for keys and prompts its neighbours stored (an indexed SELECT)
PURGE_S = 60.0


class SqliteBackend:
    """Entries in a SQLite file shared by the node's workers (``:memory:`` without a path: this
    process alone); a replaced entry gets a new sequence number, so they order the announcements."""

    def __init__(self, path: str | Path | None = None, clock: Callable[[], float] = time.time) -> None:
        from extproc.quota.memory import _use_wal

        self._db = sqlite3.connect(":memory:" if path is None else str(path), timeout=5.0, isolation_level=None)
        if path is not None:
            _use_wal(self._db, 5.0)
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.execute(_SCHEMA)
        self._db.execute(_SHARED_SCHEMA)
        self._clock = clock
        self._seq = 0
        self._shared_seq = 0
        self._purged = 0.0

    async def get(self, key: bytes) -> tuple[bytes, int] | None:
        """See ``CacheBackend.get``."""
        row = self._db.execute("SELECT value, fresh_until FROM entry WHERE key=? AND expires>?",
                               (key, int(self._clock() * 1000))).fetchone()
        return None if row is None else (bytes(row[0]), int(row[1]))

    async def put(self, key: bytes, value: bytes, fresh_until_ms: int, keep_ms: int) -> None:
        """See ``CacheBackend.put``."""
        now_ms = int(self._clock() * 1000)
        self._db.execute("INSERT OR REPLACE INTO entry (key, value, fresh_until, expires) VALUES (?, ?, ?, ?)",
                         (key, value, fresh_until_ms, now_ms + keep_ms))

    async def known(self) -> list[bytes]:
        """See ``CacheBackend.known``."""
        return self._since()

    async def added(self) -> list[bytes]:
        """See ``CacheBackend.added``: polls the table."""
        keys = self._since()
        if not keys:
            await asyncio.sleep(POLL_S)
        now = self._clock()
        if now - self._purged > PURGE_S:
            self._purged = now
            self._db.execute("DELETE FROM entry WHERE expires<=?", (int(now * 1000),))
        return keys

    async def share(self, record: bytes) -> None:
        """See ``CacheBackend.share``."""
        seq = self._db.execute("INSERT INTO shared (record) VALUES (?)", (record,)).lastrowid
        if seq is not None and seq % 1000 == 0:
            self._db.execute("DELETE FROM shared WHERE seq<=?", (seq - SHARED_KEPT,))

    async def shared(self) -> list[bytes]:
        """See ``CacheBackend.shared``: polls the table."""
        rows = self._db.execute("SELECT seq, record FROM shared WHERE seq>? ORDER BY seq LIMIT 1000",
                                (self._shared_seq,)).fetchall()
        if not rows:
            await asyncio.sleep(POLL_S)
            return []
        self._shared_seq = rows[-1][0]
        return [bytes(record) for _, record in rows]

    def _since(self) -> list[bytes]:
        rows = self._db.execute("SELECT seq, key FROM entry WHERE seq>? ORDER BY seq", (self._seq,)).fetchall()
        if rows:
            self._seq = rows[-1][0]
        return [bytes(key) for _, key in rows]

    async def close(self) -> None:
        """See ``CacheBackend.close``."""
        self._db.close()
