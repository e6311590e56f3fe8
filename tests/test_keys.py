"""API keys in Redis: the pure snapshot, the table and its watcher against a real Redis, and ``llmgw keys``."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import redis

from extproc.config import hash_key
from extproc.keys import (
    NO_VERSION,
    KeyChange,
    KeyConflict,
    KeySnapshot,
    RedisKeyTable,
    SnapshotBuilder,
    apply_changes,
    digest_of,
    parse_digest_hex,
    parse_log_entry,
)
from llmgw_testing.redis_server import RedisServer
from tests.helpers import eventually

KEY_A, KEY_B, KEY_C = "sk-team-a-1", "sk-team-b-1", "sk-team-c-1"
LLMGW = Path(sys.executable).parent / "llmgw"


@pytest.fixture
async def table(redis_server: RedisServer, request: pytest.FixtureRequest) -> AsyncIterator[RedisKeyTable]:
    keys = RedisKeyTable.from_url(redis_server.url, prefix=f"test:{request.node.name}")
    yield keys
    await keys.aclose()


class Replica:
    """One gateway process's view: the snapshot its watcher last handed over."""

    def __init__(self) -> None:
        self.snapshot = KeySnapshot.empty()
        self.changes = 0

    def on_change(self, snapshot: KeySnapshot) -> None:
        self.snapshot = snapshot
        self.changes += 1


@pytest.fixture
async def start_watcher() -> AsyncIterator[Callable[..., Replica]]:
    """Start ``table.watch`` for a new replica; every watcher is cancelled at the end of the test."""
    tasks: list[asyncio.Task[None]] = []

    def start(table: RedisKeyTable, interval_s: float = 1.0, **options: float) -> Replica:
        replica = Replica()
        tasks.append(asyncio.create_task(table.watch(replica.on_change, interval_s, **options)))
        return replica

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def polled(table: RedisKeyTable, rounds: int) -> None:
    """Wait until the watcher of ``table`` has finished ``rounds`` more polls (a failed one counts)."""
    target = table.polls + rounds
    await eventually(lambda: table.polls >= target, what=f"{rounds} more polls of the key table")


async def _until_done(call: Callable[[], Awaitable[object]], within_s: float) -> None:
    """Run ``call`` until it does not fail for want of Redis (a server just restarted may be slow)."""
    async def done() -> bool:
        try:
            await call()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            return False
        return True

    await eventually(done, within_s, what="a call to the restarted Redis", interval=0.05)


# -- pure core ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "digest"),
    [
        ("sk-1", hash_key("sk-1")),  # str: a key in clear, hashed
        (hash_key("sk-1"), hash_key("sk-1")),  # bytes: a digest, as is
    ],
    ids=["key", "digest"],
)
def test_digest_of(value: str | bytes, digest: bytes) -> None:
    assert digest_of(value) == digest


@pytest.mark.parametrize("value", ["", b"short", hash_key("x") + b"!"], ids=["empty-key", "short", "long"])
def test_digest_of_refuses(value: str | bytes) -> None:
    with pytest.raises(ValueError):
        digest_of(value)


@pytest.mark.parametrize(
    "text",
    ["", "zz" * 32, "ab" * 31, "ab" * 33],
    ids=["empty", "not-hex", "31-bytes", "33-bytes"],
)
def test_parse_digest_hex_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="hex digits"):
        parse_digest_hex(text)


def test_builder_skips_malformed_entries_and_shares_names() -> None:
    builder = SnapshotBuilder(version=7)
    builder.add([
        (hash_key(KEY_A).hex().encode(), b"team-a"),
        (hash_key(KEY_B).hex(), "team-a"),
        (b"not-a-digest", b"team-a"),  # skipped: not 64 hex digits
        (hash_key("sk-c").hex().encode(), b"bad name!"),  # skipped: not a tenant name
    ])
    snapshot = builder.build()
    assert (builder.skipped, len(snapshot), snapshot.version) == (2, 2, 7)
    assert snapshot.tenant_name(hash_key(KEY_A)) == snapshot.tenant_name(hash_key(KEY_B)) == "team-a"
    assert snapshot.tenant_name(hash_key("sk-c")) is None
    names = {id(name) for name in snapshot.by_digest.values()}
    assert len(names) == 1  # one str per tenant, however many keys it has
    with pytest.raises(TypeError):
        snapshot.by_digest[hash_key("sk-new")] = "team-a"  # type: ignore[index]
    assert hash_key(KEY_A).hex() not in repr(snapshot)


def _snapshot(version: int, **tenants_by_key: str) -> KeySnapshot:
    builder = SnapshotBuilder(version)
    builder.add((hash_key(key).hex(), tenant) for key, tenant in tenants_by_key.items())
    return builder.build()


A, B, C = hash_key("sk-a"), hash_key("sk-b"), hash_key("sk-c")


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ([KeyChange(6, C, "team-c")], {A: "team-a", B: "team-b", C: "team-c"}),
        ([KeyChange(6, A, None)], {B: "team-b"}),  # revoked
        ([KeyChange(6, A, None), KeyChange(7, A, "team-b")], {A: "team-b", B: "team-b"}),  # in order
        ([KeyChange(6, C, None)], {A: "team-a", B: "team-b"}),  # revoking an absent key: no-op
        ([KeyChange(7, C, "team-c")], None),  # 6 is missing: the log was trimmed, reload
        ([KeyChange(5, C, "team-c")], None),  # already applied or a table rebuilt: reload
        ([KeyChange(6, C, "team-c"), KeyChange(8, A, None)], None),  # a hole
        ([], None),  # the version moved but the log is gone: reload
    ],
    ids=["add", "revoke", "revoke-then-regrant", "revoke-absent", "gap-first", "behind", "hole", "no-log"],
)
def test_apply_changes(changes: list[KeyChange], expected: dict[bytes, str] | None) -> None:
    before = _snapshot(5, **{"sk-a": "team-a", "sk-b": "team-b"})
    after = apply_changes(before, changes)
    if expected is None:
        assert after is None
        return
    assert after is not None
    assert dict(after.by_digest) == expected
    assert after.version == changes[-1].version
    assert {digest: after.tenant_name(digest) for digest in (A, B, C)} == {d: expected.get(d) for d in (A, B, C)}
    assert dict(before.by_digest) == {A: "team-a", B: "team-b"}  # the old snapshot is untouched
    assert before.tenant_name(C) is None


@pytest.mark.parametrize(
    ("entry_id", "fields", "change"),
    [
        (b"12-0", {b"d": A.hex().encode(), b"t": b"team-a"}, KeyChange(12, A, "team-a")),
        (b"13-0", {b"d": A.hex().encode(), b"t": b""}, KeyChange(13, A, None)),  # revoked
        (b"14-1", {b"d": A.hex().encode(), b"t": b"team-a"}, None),  # not an ID this module writes
        (b"15-0", {b"d": b"xyz", b"t": b"team-a"}, None),
        (b"16-0", {b"d": A.hex().encode(), b"t": b"bad name"}, None),
        (b"17-0", {b"d": A.hex().encode()}, None),
    ],
    ids=["add", "revoke", "sequence", "digest", "tenant", "missing-field"],
)
def test_parse_log_entry(entry_id: bytes, fields: dict[bytes, bytes], change: KeyChange | None) -> None:
    if change is None:
        with pytest.raises(ValueError):
            parse_log_entry(entry_id, fields)
    else:
        assert parse_log_entry(entry_id, fields) == change


def test_empty_snapshot() -> None:
    snapshot = KeySnapshot.empty()
    assert (len(snapshot), snapshot.version, snapshot.tenant_name(hash_key(KEY_A))) == (0, NO_VERSION, None)


# -- the table in Redis ---------------------------------------------------------------------------


async def test_add_revoke_list_and_version(table: RedisKeyTable) -> None:
    assert await table.version() == 0
    assert await table.add(KEY_A, "team-a") is True
    first = await table.version()
    assert await table.add(hash_key(KEY_A), "team-a") is False  # already granted: no change, no bump
    assert await table.version() == first
    with pytest.raises(KeyConflict, match="team-a"):
        await table.add(KEY_A, "team-b")
    assert await table.add(KEY_B, "team-b") is True
    assert await table.version() == first + 1

    snapshot = await table.snapshot()
    assert snapshot.version == first + 1
    assert snapshot.tenant_name(hash_key(KEY_A)) == "team-a"
    assert snapshot.tenant_name(hash_key(KEY_B)) == "team-b"
    assert await table.list() == {hash_key(KEY_A).hex(): "team-a", hash_key(KEY_B).hex(): "team-b"}

    assert await table.revoke(KEY_A) is True
    assert await table.revoke(hash_key(KEY_A)) is False  # gone already: no bump
    assert await table.version() == first + 2
    assert (await table.snapshot()).tenant_name(hash_key(KEY_A)) is None


async def test_redis_never_holds_a_key_in_clear(table: RedisKeyTable, redis_server: RedisServer) -> None:
    await table.add(KEY_A, "team-a")
    client = redis.Redis.from_url(redis_server.url)
    try:
        dump = [(name, client.dump(name)) for name in client.scan_iter(match=f"{table.table}*")]
    finally:
        client.close()
    assert {name.decode() for name, _ in dump} == {table.table, table.version_key, table.log_key}
    assert all(KEY_A.encode() not in value for _, value in dump if value)


async def test_malformed_entries_are_ignored(table: RedisKeyTable, caplog: pytest.LogCaptureFixture) -> None:
    await table.add(KEY_A, "team-a")
    await table.client.hset(table.table, "oops", "team-x")  # written by hand, not by `llmgw keys`
    with caplog.at_level(logging.WARNING, logger="llmgw.keys"):
        snapshot = await table.snapshot()
    assert len(snapshot) == 1
    assert "1 malformed entries" in caplog.text


async def test_watcher_rides_out_a_table_broken_by_hand(
        table: RedisKeyTable, start_watcher: Callable[..., Replica], caplog: pytest.LogCaptureFixture) -> None:
    await table.add(KEY_A, "team-a")
    replica = start_watcher(table, interval_s=0.05)
    await eventually(lambda: len(replica.snapshot) == 1, 2)
    with caplog.at_level(logging.ERROR, logger="llmgw.keys"):
        await table.client.set(table.version_key, "not-a-number")
        await polled(table, 6)  # five at least read the broken version
        assert caplog.text.count("cannot read the key table (ValueError") == 1
    assert replica.snapshot.tenant_name(hash_key(KEY_A)) == "team-a"  # kept
    await table.client.set(table.version_key, 1)  # behind the log: the next change starts a new one
    assert await table.revoke(KEY_A) is True  # version 2, below the replica's: reload
    await eventually(lambda: len(replica.snapshot) == 0, 2)


async def test_watcher_started_while_redis_is_down_loads_when_it_comes_up(
        durable_redis_server: RedisServer, start_watcher: Callable[..., Replica]) -> None:
    durable_redis_server.stop()
    keys = RedisKeyTable.from_url(durable_redis_server.url, timeout_s=0.2)
    try:
        replica = start_watcher(keys, interval_s=0.05, max_stale_s=0.1)
        await polled(keys, 6)  # six failed polls, five intervals apart: past max_stale_s
        assert (replica.changes, len(replica.snapshot)) == (0, 0)  # nothing to hand over yet
        durable_redis_server.start()
        await keys.add(KEY_A, "team-a")
        await eventually(lambda: replica.snapshot.tenant_name(hash_key(KEY_A)) == "team-a", 2)
    finally:
        await keys.aclose()


async def test_revocation_reaches_every_replica_within_2s(
        redis_server: RedisServer, request: pytest.FixtureRequest, start_watcher: Callable[..., Replica]) -> None:
    prefix = f"test:{request.node.name}"
    # Two replicas, each with its own client, and the admin's: three processes in production.
    admin, one, two = (RedisKeyTable.from_url(redis_server.url, prefix=prefix) for _ in range(3))
    try:
        await admin.add(KEY_A, "team-a")
        replicas = [start_watcher(one), start_watcher(two)]
        await eventually(lambda: all(r.snapshot.tenant_name(hash_key(KEY_A)) == "team-a" for r in replicas), 2)

        await admin.revoke(KEY_A)
        took = await eventually(lambda: all(r.snapshot.tenant_name(hash_key(KEY_A)) is None for r in replicas), 2)
        assert took < 2  # one poll interval (1 s) plus the reload
        await admin.add(KEY_B, "team-b")
        await eventually(lambda: all(r.snapshot.tenant_name(hash_key(KEY_B)) == "team-b" for r in replicas), 2)
    finally:
        for keys in (admin, one, two):
            await keys.aclose()


async def test_unchanged_table_is_not_reloaded(table: RedisKeyTable, start_watcher: Callable[..., Replica]) -> None:
    await table.add(KEY_A, "team-a")
    replica = start_watcher(table, interval_s=0.05)
    await eventually(lambda: replica.changes == 1, 2)
    await polled(table, 6)  # six polls, same version
    assert replica.changes == 1


async def test_refresh_applies_the_log_and_reloads_when_it_does_not_reach_back(
        table: RedisKeyTable, caplog: pytest.LogCaptureFixture) -> None:
    await table.add(KEY_A, "team-a")
    with caplog.at_level(logging.INFO, logger="llmgw.keys"):
        first = await table.refresh(None)
        assert "1 keys loaded from Redis" in caplog.text
        caplog.clear()
        assert await table.refresh(first) is first  # unchanged: the same object, nothing to hand over
        await table.add(KEY_B, "team-b")
        await table.revoke(KEY_A)
        second = await table.refresh(first)
        assert (second.version, dict(second.by_digest)) == (first.version + 2, {hash_key(KEY_B): "team-b"})
        assert "loaded from Redis" not in caplog.text  # the two changes came from the log

        await table.add(KEY_C, "team-c")
        await table.client.delete(table.log_key)  # trimmed while this replica was away: change 3 is gone
        await table.revoke(KEY_B)
        third = await table.refresh(second)
        assert (third.version, dict(third.by_digest)) == (first.version + 4, {hash_key(KEY_C): "team-c"})
        assert "1 keys loaded from Redis" in caplog.text  # the whole table instead


def _commands_processed(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.info("stats")["total_commands_processed"])
    finally:
        client.close()


async def test_random_key_flood_costs_no_redis_command(table: RedisKeyTable, redis_server: RedisServer) -> None:
    for i in range(100):
        await table.add(f"sk-valid-{i}", "team-a")
    snapshot = await table.snapshot()
    flood = [os.urandom(32) for _ in range(10_000)]

    before_baseline = _commands_processed(redis_server.url)
    baseline = _commands_processed(redis_server.url) - before_baseline  # what reading the counter costs
    before = _commands_processed(redis_server.url)
    answers = [snapshot.tenant_name(digest) for digest in flood]
    after = _commands_processed(redis_server.url)

    assert answers == [None] * len(flood)
    assert after - before == baseline  # not one command for 10,000 unknown keys
    assert snapshot.tenant_name(hash_key("sk-valid-7")) == "team-a"


async def test_outage_keeps_the_last_snapshot_and_resumes(
        durable_redis_server: RedisServer, start_watcher: Callable[..., Replica],
        caplog: pytest.LogCaptureFixture) -> None:
    keys = RedisKeyTable.from_url(durable_redis_server.url, timeout_s=0.2)
    try:
        await keys.add(KEY_A, "team-a")
        await keys.add(KEY_B, "team-b")
        replica = start_watcher(keys, interval_s=0.05)
        await eventually(lambda: len(replica.snapshot) == 2, 2)

        with caplog.at_level(logging.INFO, logger="llmgw.keys"):
            durable_redis_server.stop()
            await polled(keys, 10)  # ten failed polls
            errors = [r for r in caplog.records if r.name == "llmgw.keys" and r.levelno == logging.ERROR]
            assert len(errors) == 1  # logged once per outage, not once per poll
            assert "keeping the last snapshot (2 keys)" in errors[0].getMessage()
            assert replica.snapshot.tenant_name(hash_key(KEY_A)) == "team-a"  # kept, documented

            durable_redis_server.start()  # same port; the append-only file brings the table back
            await _until_done(lambda: keys.revoke(KEY_A), 10)  # the client's 0.2 s timeout, on a loaded machine
            await eventually(lambda: replica.snapshot.tenant_name(hash_key(KEY_A)) is None, 2)
            assert replica.snapshot.tenant_name(hash_key(KEY_B)) == "team-b"
            assert "Redis answers again" in caplog.text
    finally:
        await keys.aclose()


async def test_max_stale_refuses_redis_keys_during_a_long_outage(
        durable_redis_server: RedisServer, start_watcher: Callable[..., Replica]) -> None:
    keys = RedisKeyTable.from_url(durable_redis_server.url, timeout_s=0.2)
    try:
        await keys.add(KEY_A, "team-a")
        replica = start_watcher(keys, interval_s=0.05, max_stale_s=0.3)
        await eventually(lambda: len(replica.snapshot) == 1, 2)

        durable_redis_server.stop()
        took = await eventually(lambda: len(replica.snapshot) == 0, 2)  # fail closed after max_stale_s
        assert took >= 0.3
        durable_redis_server.start()
        await eventually(lambda: replica.snapshot.tenant_name(hash_key(KEY_A)) == "team-a", 2)
    finally:
        await keys.aclose()


async def test_table_lost_with_its_redis_starts_a_new_version(
        own_redis_server: RedisServer, start_watcher: Callable[..., Replica]) -> None:
    # A Redis without persistence comes back empty: every replica must drop the keys (the table is
    # gone), and versions made afterwards must not repeat one a replica already holds.
    server = own_redis_server
    keys = RedisKeyTable.from_url(server.url, timeout_s=0.2)
    try:
        await keys.add(KEY_A, "team-a")
        replica = start_watcher(keys, interval_s=0.05)
        await eventually(lambda: len(replica.snapshot) == 1, 2)
        old_version = replica.snapshot.version

        server.stop()
        server.start()
        await eventually(lambda: len(replica.snapshot) == 0, 2)
        await keys.add(KEY_B, "team-b")
        await eventually(lambda: replica.snapshot.tenant_name(hash_key(KEY_B)) == "team-b", 2)
        assert replica.snapshot.version > old_version
    finally:
        await keys.aclose()


# -- llmgw keys -----------------------------------------------------------------------------------


def _llmgw(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "LLMGW_REDIS_URL"} | (env or {})
    return subprocess.run([str(LLMGW), "keys", *args], capture_output=True, text=True, env=environment,
                          input=stdin, timeout=60)


def test_cli_end_to_end(durable_redis_server: RedisServer) -> None:
    url = durable_redis_server.url
    given = _llmgw("add", "--tenant", "team-a", "--key", KEY_A, "--redis-url", url)
    assert given.returncode == 0, given.stderr
    assert f"added: {hash_key(KEY_A).hex()[:12]} -> team-a" in given.stdout

    generated = _llmgw("add", "--tenant", "team-b", env={"LLMGW_REDIS_URL": url})  # the URL from the env
    assert generated.returncode == 0, generated.stderr
    new_keys = re.findall(r"sk-llmgw-[A-Za-z0-9_-]+", generated.stdout)
    assert len(new_keys) == 1 and generated.stdout.count(new_keys[0]) == 1  # printed once
    new_key = new_keys[0]

    from_stdin = _llmgw("add", "--tenant", "team-c", "--key", "-", "--redis-url", url, stdin=KEY_B + "\n")
    assert from_stdin.returncode == 0, from_stdin.stderr

    conflict = _llmgw("add", "--tenant", "team-c", "--key", KEY_A, "--redis-url", url)
    assert conflict.returncode == 1 and "already belongs to tenant 'team-a'" in conflict.stderr

    listing = _llmgw("list", "--redis-url", url)
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.splitlines() == [
        f"{hash_key(KEY_A).hex()[:12]}  team-a",
        f"{hash_key(new_key).hex()[:12]}  team-b",
        f"{hash_key(KEY_B).hex()[:12]}  team-c",
        "3 keys",
    ]

    by_key = _llmgw("revoke", "--key", KEY_A, "--redis-url", url)
    by_digest = _llmgw("revoke", "--sha256", hash_key(new_key).hex(), "--redis-url", url)
    again = _llmgw("revoke", "--key", KEY_A, "--redis-url", url)
    assert (by_key.returncode, by_digest.returncode, again.returncode) == (0, 0, 1)
    assert "no key" in again.stderr
    assert _llmgw("list", "--redis-url", url).stdout.splitlines() == [f"{hash_key(KEY_B).hex()[:12]}  team-c",
                                                                      "1 keys"]

    everything = [given, from_stdin, conflict, listing, by_key, by_digest, again]
    for run in everything:  # no key in clear, anywhere, except the one line of the generating `add`
        for key in (KEY_A, KEY_B, new_key):
            assert key not in run.stdout + run.stderr
    assert new_key not in generated.stderr


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("list",), 2, "no Redis: pass --redis-url"),
        (("revoke", "--sha256", "abc", "--redis-url", "redis://127.0.0.1:1/0"), 2, "64 hex digits"),
        (("add", "--tenant", "bad name", "--redis-url", "redis://127.0.0.1:1/0"), 2, "must match"),
        (("list", "--redis-url", "redis://127.0.0.1:1/0"), 1, "Redis unreachable"),  # port 1: refused
    ],
    ids=["no-url", "bad-digest", "bad-tenant", "unreachable"],
)
def test_cli_errors(args: tuple[str, ...], code: int, message: str) -> None:
    result = _llmgw(*args)
    assert result.returncode == code
    assert message in result.stderr
