"""``FallbackStore``: what happens to admissions while the shared store (Redis) is unreachable.

``on_store_error: local`` admits against a local store, each replica enforcing its share of the
limits (the limit divided by the replica count), logging loudly once per outage and counting every
fallback; ``fail_closed`` raises ``StoreUnavailable`` so that the caller answers 503.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from extproc.quota.limits import Admission, Lease, Quota, Verdict
from extproc.quota.store import QuotaStore, StoreUnavailable

log = logging.getLogger("llmgw.quota")


class OnStoreError(StrEnum):
    """The config's ``on_store_error``."""

    LOCAL = "local"
    FAIL_CLOSED = "fail_closed"


@dataclass(slots=True)
class FallbackStats:
    """Counters for the metrics exporter: outages seen, admissions decided locally, calls lost."""

    outages: int = 0
    local_admissions: int = 0
    lost_settlements: int = 0  # reconcile/release/renew of a primary lease that did not reach it
    in_outage: bool = False


class FallbackStore:
    """The primary store while it answers; a local share of the limits (or 503) while it does not.

    After a failure the primary is not asked again for ``retry_s``, so an outage costs one
    timeout per ``retry_s`` rather than one per request. Outages are kept per failure domain, as
    the primary names them (``domain(tenant)``: a Redis Cluster's primary of the tenant's slot): a
    tenant whose keys live on a primary that answers is never decided locally. One Redis is one
    domain.
    """

    def __init__(self, primary: QuotaStore, local: QuotaStore, mode: OnStoreError, *, replicas: int = 1,
                 retry_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1 ({replicas})")
        if primary.name == local.name:
            raise ValueError("the primary and local stores need different names (leases are routed by it)")
        self.primary, self.local, self.mode, self.replicas = primary, local, mode, replicas
        self.name = f"{primary.name}+{local.name}"
        self.stats = FallbackStats()
        self._retry_s = retry_s
        self._clock = clock
        self._down_until: dict[str, float] = {}  # failure domain -> when to ask the primary again
        self._domain: Callable[[str], str] = getattr(primary, "domain", lambda tenant: "")

    def _failed(self, error: StoreUnavailable, domain: str) -> None:
        self._down_until[domain] = self._clock() + self._retry_s
        if not self.stats.in_outage:
            self.stats.in_outage = True
            self.stats.outages += 1
            action = (f"each replica enforces 1/{self.replicas} of the limits locally"
                      if self.mode is OnStoreError.LOCAL else "admissions fail closed (503)")
            log.error("quota store %s unavailable, %s: %s", self.primary.name, action, error)

    def _recovered(self, domain: str) -> None:
        if self._down_until.pop(domain, None) is not None and not self._down_until and self.stats.in_outage:
            self.stats.in_outage = False
            log.warning("quota store %s is back after %d local admissions", self.primary.name,
                        self.stats.local_admissions)

    async def admit(self, admission: Admission, quota: Quota) -> Verdict:
        """See ``QuotaStore.admit``; raises ``StoreUnavailable`` only in ``fail_closed`` mode."""
        domain = self._domain(admission.tenant)
        if self._clock() >= self._down_until.get(domain, 0.0):
            try:
                decision = await self.primary.admit(admission, quota)
            except StoreUnavailable as error:
                self._failed(error, domain)
            else:
                self._recovered(domain)
                return decision
        if self.mode is OnStoreError.FAIL_CLOSED:
            raise StoreUnavailable(f"quota store {self.primary.name} unavailable")
        self.stats.local_admissions += 1
        return await self.local.admit(admission, quota.share(self.replicas))

    def _lost(self, error: StoreUnavailable, lease: Lease) -> None:
        # The primary's lease expires by its TTL there; its reconciliation is lost (and counted).
        self.stats.lost_settlements += 1
        self._failed(error, self._domain(lease.tenant))

    async def reconcile(self, lease: Lease, actual_tokens: int, actual_cost: int | None = None) -> None:
        """See ``QuotaStore.reconcile``; a primary that cannot be reached is counted, not raised."""
        if lease.store == self.local.name:
            return await self.local.reconcile(lease, actual_tokens, actual_cost)
        try:
            await self.primary.reconcile(lease, actual_tokens, actual_cost)
        except StoreUnavailable as error:
            self._lost(error, lease)

    async def release(self, lease: Lease, actual_tokens: int | None = None, actual_cost: int | None = None) -> None:
        """See ``QuotaStore.release``; a primary lease that cannot be reached expires by its TTL."""
        if lease.store == self.local.name:
            return await self.local.release(lease, actual_tokens, actual_cost)
        try:
            await self.primary.release(lease, actual_tokens, actual_cost)
        except StoreUnavailable as error:
            self._lost(error, lease)

    async def renew(self, lease: Lease) -> Lease | None:
        """See ``QuotaStore.renew``; while the primary is unreachable the lease is kept as it was."""
        if lease.store == self.local.name:
            return await self.local.renew(lease)
        try:
            return await self.primary.renew(lease)
        except StoreUnavailable as error:
            self._lost(error, lease)
            return lease

    async def close(self) -> None:
        """Close both stores."""
        await self.primary.close()
        await self.local.close()
