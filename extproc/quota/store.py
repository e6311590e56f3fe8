"""The ``QuotaStore`` protocol: where quota state lives (Redis, or this node), behind one async API."""

from __future__ import annotations

from typing import Protocol

from extproc.quota.limits import Admission, Lease, Quota, Verdict


class StoreUnavailable(Exception):
    """The store cannot be reached (connection refused, timeout): the caller answers 503.

    Stores raise it for outages only; a bug (a bad script, a wrong type) surfaces as itself.
    """


class QuotaStore(Protocol):
    """Admits requests against a ``Quota`` and keeps their charges and leases.

    Each call is one atomic step (one Redis round trip for ``RedisStore``). Every store reads its
    own clock: Redis its server time, so replicas with skewed clocks still share one window.
    """

    name: str

    async def admit(self, admission: Admission, quota: Quota) -> Verdict:
        """Admit ``admission`` under every limit of ``quota``, charging all of them, or none."""
        ...

    async def reconcile(self, lease: Lease, actual_tokens: int, actual_cost: int | None = None) -> None:
        """Make the lease's charge ``actual_tokens`` (TPM and daily counters move by the difference)
        and, when given, ``actual_cost`` micro-dollars (the budgets move likewise).

        Idempotent: the charge is set, not added to. A no-op once the lease is released or expired.
        """
        ...

    async def release(self, lease: Lease, actual_tokens: int | None = None, actual_cost: int | None = None) -> None:
        """Free the lease's concurrency slot, reconciling to the actual usage first when given."""
        ...

    async def renew(self, lease: Lease) -> Lease | None:
        """Push the lease's expiry one TTL from now (long streams); ``None`` if it already expired."""
        ...

    async def close(self) -> None:
        """Release connections and files."""
        ...


def tag(name: str) -> str:
    """``name`` made safe inside a key: no braces (they delimit Redis Cluster hash tags), no colons."""
    return name.replace("%", "%25").replace("{", "%7B").replace("}", "%7D").replace(":", "%3A")
