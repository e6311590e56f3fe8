"""Both stores, the same behaviour: MemoryStore on a shared file, RedisStore on a real redis-server."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from extproc.quota.cluster import client
from extproc.quota.limits import DAY_MS, Admission, Lease, LimitKind, Limits, Quota, Verdict, month_of
from extproc.quota.memory import MemoryStore
from extproc.quota.redis_store import _PRELUDE, RedisStore
from extproc.quota.store import QuotaStore
from llmgw_testing.redis_cluster import RedisCluster
from llmgw_testing.redis_server import RedisServer
from tests.helpers import eventually
from tests.quota.workers import Job, open_store, run_processes

MakeStore = Callable[..., QuotaStore]


@pytest.fixture(params=["memory", "redis", "cluster"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the store under test keeps its state: a SQLite file, the shared Redis, or the shared
    Redis Cluster (3 primaries: each tenant's keys on the primary of its slot)."""
    if request.param == "memory":
        return str(tmp_path / "quota.sqlite")
    if request.param == "cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        return cluster.url
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


class StoreClock:
    """The clock the stores on ``target`` read. A MemoryStore's follows ``time.time`` and ``reach``
    moves it ahead; Redis's (``TIME`` in the scripts) cannot be moved, so ``reach`` waits for it."""

    def __init__(self, target: str) -> None:
        self._redis = client(target) if target.startswith(("redis://", "redis+cluster://")) else None
        self._ahead_ms = 0

    def __call__(self) -> float:
        """Seconds, like ``time.time`` (what ``MemoryStore(clock=...)`` takes)."""
        return (time.time_ns() // 1_000_000 + self._ahead_ms) / 1000

    async def reach(self, ms: int) -> None:
        """Return once the stores' clock reads ``ms`` (a lease's ``expires_ms``, say) or later."""
        redis = self._redis
        if redis is None:
            # One millisecond more: MemoryStore truncates seconds * 1000 to whole milliseconds.
            self._ahead_ms = max(self._ahead_ms, ms + 1 - time.time_ns() // 1_000_000)
            return

        async def reached() -> bool:
            seconds, microseconds = await redis.time()
            return seconds * 1000 + microseconds // 1000 >= ms  # `now` as the scripts' prelude reads it

        await eventually(reached, what=f"Redis's clock at {ms} ms")

    async def close(self) -> None:
        """Close the Redis client."""
        if self._redis is not None:
            await self._redis.aclose()


@pytest.fixture
async def store_clock(target: str) -> AsyncIterator[StoreClock]:
    """The clock of the stores ``make_store`` opens."""
    clock = StoreClock(target)
    yield clock
    await clock.close()


@pytest.fixture
async def make_store(target: str, store_clock: StoreClock) -> AsyncIterator[MakeStore]:
    """Opens stores on ``target`` (several may share it, like worker processes); closes them after."""
    stores: list[QuotaStore] = []

    def make(lease_ttl_s: float = 60.0) -> QuotaStore:
        if target.startswith(("redis://", "redis+cluster://")):
            stores.append(open_store(target, lease_ttl_s))
        else:
            stores.append(MemoryStore(target, lease_ttl_s=lease_ttl_s, clock=store_clock))
        return stores[-1]

    yield make
    for store in stores:
        await store.close()


@pytest.fixture
def tenant() -> str:
    """A tenant of the test's own, with braces that must not break the Redis Cluster hash tag."""
    return f"}}t{{-{uuid.uuid4().hex[:8]}"


def ask(tenant: str, tokens: int = 0, qos: str = "") -> Admission:
    """An admission with a fresh lease id."""
    return Admission(tenant, uuid.uuid4().hex, tokens, qos)


async def admit_all(store: QuotaStore, tenant: str, quota: Quota, tokens: list[int], qos: str = "") -> list[Lease]:
    """Admit one request per entry of ``tokens`` in order; the leases of those admitted."""
    leases = []
    for count in tokens:
        decision = await store.admit(ask(tenant, count, qos), quota)
        if decision.lease is not None:
            leases.append(decision.lease)
    return leases


def remaining_tokens(decision: Verdict) -> int:
    """The TPM figure's remaining tokens (the test fails if there is none)."""
    figure = decision.tightest(LimitKind.TOKENS)
    assert figure is not None
    return figure.remaining


async def test_rpm_then_refusal_with_headers(make_store: MakeStore, tenant: str) -> None:
    store = make_store()
    quota = Quota(Limits(rpm=3))
    assert len(await admit_all(store, tenant, quota, [0] * 5)) == 3  # exactly the limit
    decision = await store.admit(ask(tenant), quota)
    assert (decision.admitted, decision.refused_by, decision.refused_scope) == (False, LimitKind.REQUESTS, "tenant")
    assert decision.retry_after_ms is not None and 59_000 <= decision.retry_after_ms <= 61_000  # the window
    headers = dict(decision.headers())
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("3", "0")
    assert headers["retry-after"] in {"60", "61"}


async def test_tpm_and_a_request_too_large(make_store: MakeStore, tenant: str) -> None:
    store = make_store()
    quota = Quota(Limits(tpm=1000))
    assert len(await admit_all(store, tenant, quota, [300, 300, 300, 300])) == 3  # the 4th would make 1200
    decision = await store.admit(ask(tenant, 100), quota)
    assert decision.admitted and remaining_tokens(decision) == 0  # 100 fits exactly
    too_large = await store.admit(ask(tenant, 1001), quota)
    assert (too_large.refused_by, too_large.retry_after_ms) == (LimitKind.TOKENS, None)  # waiting cannot help


async def test_concurrency_leases_release_and_expire(make_store: MakeStore, store_clock: StoreClock,
                                                     tenant: str) -> None:
    store = make_store(lease_ttl_s=0.4)
    quota = Quota(Limits(concurrency=2))
    first, second = await admit_all(store, tenant, quota, [0, 0])
    refused = await store.admit(ask(tenant), quota)
    assert (refused.refused_by, refused.retry_after_ms) == (LimitKind.CONCURRENCY, 1000)
    await store.release(first)
    third = (await store.admit(ask(tenant), quota)).lease
    assert third is not None  # the released slot is free again
    await store.release(first)  # a second release changes nothing
    assert not (await store.admit(ask(tenant), quota)).admitted
    # Nobody released `second` or `third` (their worker "died"): once past their expiry, they are gone.
    await store_clock.reach(third.expires_ms)
    assert len(await admit_all(store, tenant, quota, [0, 0, 0])) == 2
    assert await store.renew(second) is None  # expired leases cannot be renewed


async def test_renew_keeps_a_long_stream_alive(make_store: MakeStore, store_clock: StoreClock, tenant: str) -> None:
    store = make_store(lease_ttl_s=0.4)
    quota = Quota(Limits(concurrency=1))
    lease = (await store.admit(ask(tenant), quota)).lease
    assert lease is not None
    for _ in range(3):  # 0.75 s in all, longer than the TTL
        await store_clock.reach(lease.expires_ms - 150)  # 0.25 s into the lease's 0.4
        renewed = await store.renew(lease)
        assert renewed is not None and renewed.expires_ms > lease.expires_ms
        lease = renewed
    assert not (await store.admit(ask(tenant), quota)).admitted  # still held
    await store.release(lease)
    assert (await store.admit(ask(tenant), quota)).admitted


async def test_reconcile_moves_counters_to_actual_usage(make_store: MakeStore, tenant: str) -> None:
    store = make_store()
    quota = Quota(Limits(tpm=1000, daily_tokens=5000))
    (lease,) = await admit_all(store, tenant, quota, [600])
    assert not (await store.admit(ask(tenant, 600), quota)).admitted  # 600 + 600 > 1000
    await store.reconcile(lease, 100)
    await store.reconcile(lease, 100)  # idempotent: the charge is set, not added to
    decision = await store.admit(ask(tenant, 600), quota)
    assert decision.admitted and remaining_tokens(decision) == 300  # 1000 - 100 - 600
    await store.release(lease, 400)  # the final usage: +300 more
    figures = (await store.admit(ask(tenant, 0), quota)).figures
    remaining = {figure.kind: figure.remaining for figure in figures}
    assert remaining == {LimitKind.TOKENS: 0, LimitKind.DAILY_TOKENS: 4000}  # 1000 - 400 - 600; 5000 - 1000
    await store.reconcile(lease, 0)  # after release: a no-op
    remaining = {f.kind: f.remaining for f in (await store.admit(ask(tenant, 0), quota)).figures}
    assert remaining[LimitKind.TOKENS] == 0


async def test_daily_budget(make_store: MakeStore, tenant: str) -> None:
    store = make_store()
    quota = Quota(Limits(daily_tokens=1000))
    (lease,) = await admit_all(store, tenant, quota, [600])
    refused = await store.admit(ask(tenant, 600), quota)
    assert refused.refused_by is LimitKind.DAILY_TOKENS
    assert refused.retry_after_ms is not None and 0 < refused.retry_after_ms <= DAY_MS  # until midnight UTC
    await store.release(lease, 300)
    assert (await store.admit(ask(tenant, 600), quota)).admitted  # 300 + 600 <= 1000


@pytest.mark.parametrize("kind", [LimitKind.DAILY_COST, LimitKind.MONTHLY_COST], ids=["daily", "monthly"])
async def test_spending_budget_reserves_then_reconciles_cost(make_store: MakeStore, tenant: str,
                                                             kind: LimitKind) -> None:
    store = make_store()
    limits = Limits(daily_cost=1000) if kind is LimitKind.DAILY_COST else Limits(monthly_cost=1000)
    quota = Quota(limits)  # micro-dollars

    def spend(cost: int) -> Admission:
        return Admission(tenant, uuid.uuid4().hex, 10, reserve_cost=cost)

    first = await store.admit(spend(600), quota)
    assert first.admitted and first.lease is not None and first.lease.reserved_cost == 600
    refused = await store.admit(spend(600), quota)
    assert (refused.admitted, refused.refused_by) == (False, kind)  # 600 reserved + 600 > 1000
    assert refused.retry_after_ms is not None and refused.retry_after_ms > 0  # until the period resets
    assert (await store.admit(spend(1001), quota)).retry_after_ms is None  # can never fit: no wait helps
    await store.release(first.lease, 10, 250)  # it really cost 250
    second = await store.admit(spend(600), quota)
    assert second.admitted  # 250 + 600 <= 1000
    figure = next(f for f in second.figures if f.kind is kind)
    assert figure.remaining == 150
    assert second.lease is not None
    await store.release(second.lease, 10, 0)  # a refund goes back too
    assert (await store.admit(spend(750), quota)).admitted  # 250 + 750


async def test_qos_class_has_its_own_limits(make_store: MakeStore, tenant: str) -> None:
    store = make_store()
    quota = Quota(tenant=Limits(rpm=5), qos=Limits(rpm=2))
    assert len(await admit_all(store, tenant, quota, [0] * 3, qos="batch")) == 2  # the class's limit
    refused = await store.admit(ask(tenant, qos="batch"), quota)
    assert (refused.refused_scope, refused.refused_by) == ("qos", LimitKind.REQUESTS)
    interactive = Quota(tenant=Limits(rpm=5), qos=Limits(rpm=10))  # each class has its own Quota
    assert len(await admit_all(store, tenant, interactive, [0] * 5, qos="interactive")) == 3  # the tenant's 5 - 2
    assert not (await store.admit(ask(tenant), interactive)).admitted  # no class: the tenant limit alone


async def test_two_stores_share_one_state(make_store: MakeStore, tenant: str) -> None:
    quota = Quota(Limits(rpm=4))
    one, two = make_store(), make_store()
    results = await asyncio.gather(*(store.admit(ask(tenant), quota) for store in (one, two) * 4))
    assert sum(decision.admitted for decision in results) == 4  # one limit, not one per store


@pytest.mark.timeout(60)
def test_rpm_exact_across_processes(target: str) -> None:
    tenant = f"mp-{uuid.uuid4().hex[:8]}"
    jobs = [Job(target, tenant, Quota(Limits(rpm=100)), requests=125, seed=seed) for seed in range(4)]
    admitted = sum(result >= 0 for results in run_processes(jobs) for result in results)
    assert admitted == 100  # 500 concurrent requests from 4 processes, rpm=100


@pytest.mark.timeout(60)
def test_tpm_within_one_request_across_processes(target: str) -> None:
    tenant = f"mp-{uuid.uuid4().hex[:8]}"
    tpm, max_reserve = 20_000, 200
    jobs = [Job(target, tenant, Quota(Limits(tpm=tpm)), requests=100, seed=seed, max_reserve=max_reserve)
            for seed in range(4)]
    tokens = sum(result for results in run_processes(jobs) for result in results if result > 0)
    assert tpm - max_reserve < tokens <= tpm  # 400 requests of 1-200 tokens: within one request of the limit


@pytest.mark.timeout(60)
def test_no_leaked_lease_across_processes(target: str) -> None:
    tenant = f"mp-{uuid.uuid4().hex[:8]}"
    quota = Quota(Limits(concurrency=20))
    jobs = [Job(target, tenant, quota, requests=100, seed=seed, hold_s=0.005) for seed in range(4)]
    admitted = sum(result >= 0 for results in run_processes(jobs) for result in results)
    assert admitted >= 20  # at least the first wave

    async def free_slots() -> int:
        store = open_store(target)
        try:
            return len(await admit_all(store, tenant, quota, [0] * 21))
        finally:
            await store.close()

    assert asyncio.run(free_slots()) == 20  # every lease was released: all 20 slots free again


async def test_noscript_recovery(redis_server: RedisServer, tenant: str) -> None:
    store = RedisStore.from_url(redis_server.url)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        quota = Quota(Limits(rpm=3))
        assert len(await admit_all(store, tenant, quota, [0, 0])) == 2
        await admin.script_flush()  # as after a restart or failover
        assert len(await admit_all(store, tenant, quota, [0, 0])) == 1  # reloaded; the count went on
    finally:
        await store.close()
        await admin.aclose()


async def test_redis_keys_are_hash_tagged_and_expire(redis_server: RedisServer, tenant: str) -> None:
    store = RedisStore.from_url(redis_server.url)
    admin = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        await store.admit(ask(tenant, 10, qos="batch"), Quota(Limits(rpm=5), Limits(rpm=5)))
        keys = await admin.keys(f"llmgw:quota:{{{tenant.replace('{', '%7B').replace('}', '%7D')}}}:*")
        assert len(keys) == 9  # open + 4 per scope, two scopes
        slots = {key_slot(str(key).encode()) for key in keys}
        assert len(slots) == 1  # one Redis Cluster slot: one script may touch them all
        ttls = [await admin.pttl(key) for key in keys]
        assert all(ttl > 0 for ttl in ttls)  # nothing lives forever
    finally:
        await store.close()
        await admin.aclose()




async def test_the_scripts_calendar_matches_python(redis_server: RedisServer) -> None:
    # The Lua prelude computes UTC months itself (Redis's clock); it must agree with limits.month_of.
    script = _PRELUDE + """
local out = {}
for i = 1, #ARGV do
  local day = tonumber(ARGV[i])
  local m = month_of_day(day)
  out[#out + 1] = m
  out[#out + 1] = month_first_day(m + 1)
end
return out
"""
    days = list(range(-800, 80_000, 37)) + [19_782, 20_055, 20_056, 47_541]  # 1967 .. 2189, leap days
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        reply = await admin.eval(script, 0, *days)
    finally:
        await admin.aclose()
    expected = []
    for day in days:
        index, next_start = month_of(day * DAY_MS + 12 * 3_600_000)
        expected += [index, next_start // DAY_MS]
    assert reply == expected


@pytest.mark.parametrize("lag", [61, 200],
                         ids=["a bucket just left: purged by the cursor", "quiet for long: recounted"])
async def test_redis_window_forgets_buckets_that_left(redis_server: RedisServer, tenant: str, lag: int) -> None:
    # White box: the script keeps a running sum 'n' and a purge cursor 'p' beside the buckets.
    # Move this tenant's three requests back in time, as if they were admitted `lag` seconds ago.
    store = RedisStore.from_url(redis_server.url)
    admin = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        quota = Quota(Limits(rpm=10))
        assert len(await admit_all(store, tenant, quota, [0, 0, 0])) == 3
        key = f"llmgw:quota:{{{tenant.replace('{', '%7B').replace('}', '%7D')}}}:t:rq"
        window = await admin.hgetall(key)
        buckets = {int(k): int(v) for k, v in window.items() if k.isdigit()}
        bucket = max(buckets)  # (the three may straddle a second)
        assert (sum(buckets.values()), int(window["n"])) == (3, 3)
        await admin.delete(key)
        await admin.hset(key, mapping={str(bucket - lag): 3, "n": 3, "p": bucket - lag})
        decision = await store.admit(ask(tenant), quota)
        figure = decision.tightest(LimitKind.REQUESTS)
        assert figure is not None and figure.remaining == 9  # the old three no longer count
        window = await admin.hgetall(key)
        assert str(bucket - lag) not in window and int(window["n"]) == 1
    finally:
        await store.close()
        await admin.aclose()
