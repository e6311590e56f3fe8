"""API keys kept in Redis, answered from an in-process snapshot that every replica keeps current.

Redis holds only SHA-256 digests, never a key in clear. Three keys share the hash tag ``{keys}``,
so one Lua script changes them together, also on a Redis Cluster:

- ``llmgw:keys:{keys}``: HASH, digest hex -> tenant name (the table);
- ``llmgw:keys:{keys}:version``: a counter that every change bumps;
- ``llmgw:keys:{keys}:log``: STREAM of the last ~10,000 changes, entry ID ``<version>-0``.

Each process polls the counter (``watch``: one ``GET`` a second). When it moved, the process
applies the log entries since its own version to a copy of its snapshot, or, when the log no
longer reaches back that far (a long outage, a lost Redis), reloads the whole table (``HSCAN``
in batches, yielding to the event loop between them). The request path asks the immutable
``KeySnapshot`` in memory (one dict lookup) and never talks to Redis: a flood of random keys
costs no Redis command, and a revocation reaches every replica within about one poll interval.

While Redis is unreachable the last snapshot is kept: a key revoked just before the outage, or
during a partition that hides Redis from this replica only, stays valid until Redis answers
again. With ``max_stale_s`` set, an outage that long replaces the snapshot with an empty one
instead: Redis-held keys are refused (fail closed) until Redis is back.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NoReturn, cast

from redis import asyncio as aioredis
from redis import exceptions as redis_errors
from redis.backoff import NoBackoff
from redis.retry import Retry

from extproc.config import hash_key
from extproc.config.schema import _NAME as TENANT_NAME  # the config's own rule for tenant names

log = logging.getLogger("llmgw.keys")

PREFIX = "llmgw:keys"
DIGEST_BYTES = 32  # SHA-256
SCAN_BATCH = 2_000  # HSCAN COUNT of a reload: the most entries parsed between two awaits
LOG_LENGTH = 10_000  # changes kept in the log (approximately: XADD MAXLEN ~)
FIRST_LOAD_RETRY_S = 0.2  # how often a starting worker asks Redis again for its keys
NO_VERSION = -1  # the empty snapshot's version: any version read from Redis differs


class KeyConflict(Exception):
    """The key is already granted to another tenant (move it by revoking it first)."""


# -- pure core: digests, snapshots, changes -------------------------------------------------------


def digest_of(key_or_digest: str | bytes) -> bytes:
    """The SHA-256 digest a key is stored under: ``bytes`` is a digest already, ``str`` a key in clear."""
    if isinstance(key_or_digest, bytes):
        if len(key_or_digest) != DIGEST_BYTES:
            raise ValueError(f"a key digest is {DIGEST_BYTES} bytes (SHA-256), not {len(key_or_digest)}")
        return key_or_digest
    if not key_or_digest:
        raise ValueError("empty API key")
    return hash_key(key_or_digest)


def parse_digest_hex(text: str) -> bytes:
    """A digest from its 64 hex digits (``llmgw keys revoke --sha256``, the fields in Redis)."""
    try:
        digest = bytes.fromhex(text)
    except ValueError:
        raise ValueError("a key digest is 64 hex digits (SHA-256)") from None
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"a key digest is {2 * DIGEST_BYTES} hex digits (SHA-256), not {len(text)}")
    return digest


def check_tenant_name(tenant: str) -> str:
    """``tenant`` if it is a valid tenant name (the config's rule), else ValueError."""
    if not TENANT_NAME.match(tenant):
        raise ValueError(f"tenant name {tenant!r} must match {TENANT_NAME.pattern}")
    return tenant


def new_api_key() -> str:
    """A fresh random API key (``llmgw keys add``, ``llmgw keygen``, the dev key of ``llmgw up``)."""
    return "sk-llmgw-" + secrets.token_urlsafe(24)


@dataclass(frozen=True, slots=True)
class KeySnapshot:
    """The key table as of one version in Redis: read by the request path, swapped whole."""

    by_digest: MappingProxyType[bytes, str] = field(repr=False)  # SHA-256 digest -> tenant name
    version: int

    @classmethod
    def empty(cls) -> KeySnapshot:
        """No keys: before the first load, or after ``max_stale_s`` without Redis."""
        return cls(MappingProxyType({}), NO_VERSION)

    def tenant_name(self, digest: bytes) -> str | None:
        """The tenant a key digest belongs to, None for an unknown key."""
        return self.by_digest.get(digest)

    def __len__(self) -> int:
        return len(self.by_digest)


class SnapshotBuilder:
    """Collects the table batch by batch (so a reload yields to the event loop between batches)."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.skipped = 0  # fields that are not a digest, or names that are not a tenant name
        self._table: dict[bytes, str] = {}
        # Raw name as Redis sent it -> checked name: each tenant is decoded and checked once, and
        # all its keys share one str object.
        self._names: dict[bytes | str, str] = {}

    def add(self, entries: Iterable[tuple[bytes | str, bytes | str]]) -> None:
        """Add (digest hex, tenant name) pairs as Redis returns them; malformed ones are skipped."""
        for raw_digest, raw_name in entries:
            try:
                name = self._names.get(raw_name)
                if name is None:
                    checked = check_tenant_name(raw_name.decode() if isinstance(raw_name, bytes) else raw_name)
                    name = self._names[raw_name] = self._names.setdefault(checked, checked)
                digest = parse_digest_hex(raw_digest.decode() if isinstance(raw_digest, bytes) else raw_digest)
            except (ValueError, UnicodeDecodeError):
                self.skipped += 1
                continue
            self._table[digest] = name  # HSCAN may return a field twice: the same pair again

    def build(self) -> KeySnapshot:
        """The immutable snapshot."""
        return KeySnapshot(MappingProxyType(self._table), self.version)


@dataclass(frozen=True, slots=True)
class KeyChange:
    """One entry of the change log: a key granted to a tenant, or revoked (``tenant`` None)."""

    version: int
    digest: bytes
    tenant: str | None


def parse_log_entry(entry_id: bytes | str, fields: Mapping[bytes, bytes]) -> KeyChange:
    """A log entry as XRANGE returns it (ID ``<version>-0``, fields ``d`` and ``t``); ValueError if malformed."""
    raw_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    version, _, sequence = raw_id.partition("-")
    if sequence != "0" or b"d" not in fields or b"t" not in fields:
        raise ValueError(f"not a key-table change: {raw_id}")
    tenant = fields[b"t"].decode()
    return KeyChange(int(version), parse_digest_hex(fields[b"d"].decode()),
                     check_tenant_name(tenant) if tenant else None)


def apply_changes(snapshot: KeySnapshot, changes: Sequence[KeyChange]) -> KeySnapshot | None:
    """``snapshot`` with ``changes`` applied (a new snapshot; the old one is untouched).

    None when they do not follow on from its version (the log was trimmed or lost: reload the table).
    """
    if not changes or any(change.version != snapshot.version + i for i, change in enumerate(changes, 1)):
        return None
    table = snapshot.by_digest.copy()  # a dict; dict(proxy) would copy item by item, ~6x slower
    for change in changes:
        if change.tenant is None:
            table.pop(change.digest, None)
        else:
            table[change.digest] = change.tenant
    return KeySnapshot(MappingProxyType(table), changes[-1].version)


# -- Redis shell ------------------------------------------------------------------------------------

# Every change bumps the version and logs itself in the same atomic step. A missing counter (a new
# table, or a Redis that lost its data) starts from the caller's clock in milliseconds, so that a
# counter rebuilt after data loss does not come back to a version some replica already holds.
# KEYS: table, version, log. ARGV: digest hex, tenant, clock ms, log length.
# A log ahead of the counter (a counter reset by hand) cannot take the entry: it is dropped and
# started again, and watchers, finding no entry that follows theirs, reload the table.
_BUMP = """
if redis.call('EXISTS', KEYS[2]) == 0 then redis.call('SET', KEYS[2], ARGV[3]) end
local id = string.format('%d-0', redis.call('INCR', KEYS[2]))
local logged = redis.pcall('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], id, 'd', ARGV[1], 't', ARGV[2])
if type(logged) == 'table' and logged.err then
  redis.call('DEL', KEYS[3])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], id, 'd', ARGV[1], 't', ARGV[2])
end
"""
ADD = """
local owner = redis.call('HGET', KEYS[1], ARGV[1])
if owner == ARGV[2] then return {0} end
if owner then return {-1, owner} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
""" + _BUMP + "return {1}\n"
REVOKE = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
""" + _BUMP + "return 1\n"

# A Redis outage as redis-py reports it, or a table broken by hand (a version that is not a
# number, a key of the wrong type): the watcher logs it once and keeps its snapshot.
WATCH_ERRORS: tuple[type[BaseException], ...] = (redis_errors.RedisError, OSError, TimeoutError, ValueError)


class RedisKeyTable:
    """The key table in Redis: changed by ``llmgw keys``, watched by every gateway process."""

    def __init__(self, client: aioredis.Redis, *, prefix: str = PREFIX, log_length: int = LOG_LENGTH) -> None:
        self.client = client
        self.table = f"{prefix}:{{keys}}"
        self.version_key = f"{self.table}:version"
        self.log_key = f"{self.table}:log"
        self.log_length = log_length
        self.polls = 0  # rounds of ``watch`` finished, answered or not: what a caller can wait on
        self._add = client.register_script(ADD)
        self._revoke = client.register_script(REVOKE)

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 1.0, prefix: str = PREFIX) -> RedisKeyTable:
        """A table on ``redis://host:port/db``; a call over ``timeout_s`` counts as an outage."""
        # One immediate retry on a broken connection (a pooled socket that a Redis restart closed).
        retry = Retry(NoBackoff(), 1, supported_errors=(redis_errors.ConnectionError,))
        from extproc.quota.cluster import client

        return cls(client(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=retry,
                          max_connections=4), prefix=prefix)

    async def aclose(self) -> None:
        """Close the client and its connections."""
        await self.client.aclose()

    def _change_args(self, digest: bytes, tenant: str) -> list[str | int]:
        return [digest.hex(), tenant, time.time_ns() // 1_000_000, self.log_length]

    async def add(self, key_or_digest: str | bytes, tenant: str) -> bool:
        """Grant a key (``str``: in clear, hashed here; ``bytes``: its digest) to ``tenant``.

        True when added, False when the tenant already had it; KeyConflict when another tenant has it.
        """
        digest = digest_of(key_or_digest)
        reply = await self._add(keys=[self.table, self.version_key, self.log_key],
                                args=self._change_args(digest, check_tenant_name(tenant)))
        assert isinstance(reply, list)
        if int(reply[0]) < 0:
            owner = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
            raise KeyConflict(f"key {digest.hex()[:12]} already belongs to tenant {owner!r}; revoke it first")
        return int(reply[0]) == 1

    async def revoke(self, key_or_digest: str | bytes) -> bool:
        """Withdraw a key (``str``: in clear; ``bytes``: its digest); False when it was not there."""
        digest = digest_of(key_or_digest)
        reply = await self._revoke(keys=[self.table, self.version_key, self.log_key],
                                   args=self._change_args(digest, ""))
        return int(reply) == 1

    async def list(self) -> dict[str, str]:
        """Every key as digest hex -> tenant name (no key is ever stored in clear)."""
        return {digest.hex(): tenant for digest, tenant in (await self.snapshot()).by_digest.items()}

    async def version(self) -> int:
        """The table's version counter (0 for a table that never changed)."""
        raw = await self.client.get(self.version_key)
        return int(raw) if raw is not None else 0

    async def snapshot(self) -> KeySnapshot:
        """Load the whole table (HSCAN in batches) into a snapshot.

        The version is read before the scan: a change made during the scan bumps the counter past
        it, so the next ``refresh`` applies it again (harmless), and none is ever missed.
        """
        builder = SnapshotBuilder(await self.version())
        cursor = 0
        while True:
            cursor, batch = await self.client.hscan(self.table, cursor, count=SCAN_BATCH)
            builder.add(cast("dict[bytes, bytes]", batch).items())
            if cursor == 0:
                break
        if builder.skipped:
            log.warning("API keys: %d malformed entries in %s ignored", builder.skipped, self.table)
        return builder.build()

    async def changes_since(self, version: int) -> builtins.list[KeyChange]:  # ``list``: a method here
        """The logged changes after ``version``, oldest first (at most ``log_length``)."""
        entries = cast("builtins.list[tuple[bytes, dict[bytes, bytes]]]",
                       await self.client.xrange(self.log_key, min=f"{version + 1}-0", count=self.log_length))
        return [parse_log_entry(entry_id, fields) for entry_id, fields in entries]

    async def refresh(self, current: KeySnapshot | None) -> KeySnapshot:
        """The table now: ``current`` itself when unchanged, else ``current`` with the logged
        changes applied, else (no ``current``, log trimmed, table lost) the whole table reloaded."""
        if current is not None:
            version = await self.version()
            if version == current.version:
                return current
            if version > current.version:
                try:
                    updated = apply_changes(current, await self.changes_since(current.version))
                except ValueError as error:  # an entry not written by this module
                    log.warning("API keys: unreadable change log (%s); reloading the table", error)
                    updated = None
                if updated is not None:
                    log.debug("API keys: version %d applied from the change log", updated.version)
                    return updated
        fresh = await self.snapshot()
        log.info("API keys: %d keys loaded from Redis (version %d)", len(fresh), fresh.version)
        return fresh

    async def load_first(self, timeout_s: float) -> KeySnapshot | None:
        """The whole table, read before a worker serves its first request; Redis is asked again
        every ``FIRST_LOAD_RETRY_S`` until ``timeout_s``: None if it never answered."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await self.refresh(None)
            except WATCH_ERRORS as error:
                if time.monotonic() >= deadline:
                    log.error("API keys: not loaded within %.0f s (%s: %s); serving without them: their "
                              "requests get 503 until Redis answers", timeout_s, type(error).__name__, error)
                    return None
            await asyncio.sleep(FIRST_LOAD_RETRY_S)

    async def watch(self, on_change: Callable[[KeySnapshot], None], interval_s: float = 1.0, *,
                    max_stale_s: float | None = None, current: KeySnapshot | None = None) -> NoReturn:
        """Call ``on_change`` with each new snapshot: the first load, then every version change.

        Polls the version once per ``interval_s`` (each round, answered or not, counts in ``polls``);
        runs until cancelled. A Redis error is logged
        once per outage and the last snapshot kept; with ``max_stale_s``, an outage that long hands
        ``on_change`` an empty snapshot (no Redis-held key is valid) until Redis answers again.
        ``on_change`` runs on the event loop and should only swap a reference.
        """
        # ``current``: what the caller loaded first, if anything; None: nothing loaded (yet, or since max_stale_s)
        outage_since: float | None = None
        while True:
            try:
                fresh = await self.refresh(current)
                if fresh is not current:
                    current = fresh
                    on_change(current)
                if outage_since is not None:
                    log.warning("API keys: Redis answers again after %.1f s", time.monotonic() - outage_since)
                    outage_since = None
            except WATCH_ERRORS as error:
                if outage_since is None:
                    outage_since = time.monotonic()
                    log.error("API keys: cannot read the key table (%s: %s); keeping the last snapshot "
                              "(%d keys)", type(error).__name__, error, len(current) if current else 0)
                if max_stale_s is not None and current is not None and time.monotonic() - outage_since >= max_stale_s:
                    log.error("API keys: no Redis for %.0f s (max_stale_s); refusing Redis-held keys until "
                              "it is back", max_stale_s)
                    current = None
                    on_change(KeySnapshot.empty())
            self.polls += 1
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # Cancelled inside redis-py, which can turn the cancellation into a TimeoutError
                # (caught above) or swallow it: stop as asked instead of polling on.
                raise asyncio.CancelledError
            await asyncio.sleep(interval_s)
