"""``on_store_error``: a Redis that stops and comes back, with a local share or a 503 meanwhile."""

from __future__ import annotations

import logging
import uuid

import pytest

from extproc.quota.fallback import FallbackStore, OnStoreError
from extproc.quota.limits import Admission, Limits, Quota, Verdict
from extproc.quota.memory import MemoryStore
from extproc.quota.redis_store import RedisStore
from extproc.quota.store import StoreUnavailable
from llmgw_testing.redis_server import RedisServer

QUOTA = Quota(Limits(rpm=10, concurrency=10))


def ask(tenant: str) -> Admission:
    """An admission with a fresh lease id."""
    return Admission(tenant, uuid.uuid4().hex, 0)


class Clock:
    """A monotonic clock that moves only when told (``FallbackStore``'s ``retry_s`` runs on it)."""

    def __init__(self) -> None:
        self.s = 0.0

    def __call__(self) -> float:
        return self.s


async def test_local_share_while_redis_is_down(own_redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    store = FallbackStore(RedisStore.from_url(own_redis_server.url, timeout_s=0.3), MemoryStore(),
                          OnStoreError.LOCAL, replicas=2, retry_s=0.2, clock=clock)
    try:
        before = await store.admit(ask("acme"), QUOTA)
        assert before.lease is not None and before.lease.store == "redis"
        own_redis_server.stop()

        with caplog.at_level(logging.ERROR, logger="llmgw.quota"):
            outage = [await store.admit(ask("acme"), QUOTA) for _ in range(8)]
        assert sum(decision.admitted for decision in outage) == 5  # this replica's share: 10 // 2
        assert {decision.lease.store for decision in outage if decision.lease} == {"memory"}
        assert len([r for r in caplog.records if "unavailable" in r.message]) == 1  # loud, once per outage
        assert (store.stats.outages, store.stats.local_admissions, store.stats.in_outage) == (1, 8, True)

        await store.release(before.lease)  # Redis is down: counted, not raised; the lease expires there
        assert store.stats.lost_settlements == 1
        local_lease = next(decision.lease for decision in outage if decision.lease)
        await store.release(local_lease, 5)  # a local lease goes back to the local store

        own_redis_server.start()  # same port; the server has forgotten the script (NOSCRIPT path)
        await store.admit(ask("acme"), QUOTA)
        assert store.stats.local_admissions == 9  # Redis is back, but retry_s has not passed
        clock.s += 0.2  # retry_s later: the next admission asks Redis again
        after = await store.admit(ask("acme"), QUOTA)
        assert after.lease is not None and after.lease.store == "redis"
        assert not store.stats.in_outage
    finally:
        await store.close()


async def test_fail_closed_raises_for_a_503(own_redis_server: RedisServer) -> None:
    store = FallbackStore(RedisStore.from_url(own_redis_server.url, timeout_s=0.3), MemoryStore(),
                          OnStoreError.FAIL_CLOSED, retry_s=0.2)
    try:
        assert (await store.admit(ask("acme"), QUOTA)).admitted
        own_redis_server.stop()
        for _ in range(2):  # the first call finds the outage, the second is refused without a timeout
            with pytest.raises(StoreUnavailable):
                await store.admit(ask("acme"), QUOTA)
        assert (store.stats.outages, store.stats.local_admissions) == (1, 0)
    finally:
        await store.close()


def test_stores_need_distinct_names() -> None:
    with pytest.raises(ValueError, match="different names"):
        FallbackStore(MemoryStore(), MemoryStore(), OnStoreError.LOCAL)


async def test_an_outage_of_one_failure_domain_leaves_the_others_on_the_primary() -> None:
    # A Redis Cluster: the primary of one tenant's slot is away; the other tenant's primary answers.
    class Split(MemoryStore):
        name = "split"

        def domain(self, tenant: str) -> str:
            return "node-a" if tenant == "on-a" else "node-b"

        async def admit(self, admission: Admission, quota: Quota) -> Verdict:
            if admission.tenant == "on-a":
                raise StoreUnavailable("node-a is down")
            return await super().admit(admission, quota)

    store = FallbackStore(Split(), MemoryStore(), OnStoreError.LOCAL)
    quota = Quota(Limits(rpm=100))
    assert (await store.admit(Admission("on-a", "l1", 0), quota)).lease.store == "memory"  # type: ignore[union-attr]
    assert (await store.admit(Admission("on-b", "l2", 0), quota)).lease.store == "split"  # type: ignore[union-attr]
    assert store.stats.in_outage and store.stats.local_admissions == 1
