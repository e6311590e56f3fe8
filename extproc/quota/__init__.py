"""Quotas: limits per tenant and QoS class, admitted against a store (Redis, or this node)."""

from extproc.quota.fallback import FallbackStats, FallbackStore, OnStoreError
from extproc.quota.limits import Admission, Figure, Lease, LimitKind, Limits, Quota, Verdict
from extproc.quota.memory import MemoryStore
from extproc.quota.store import QuotaStore, StoreUnavailable

__all__ = [
    "Admission", "Verdict", "FallbackStats", "FallbackStore", "Figure", "Lease", "LimitKind", "Limits",
    "MemoryStore", "OnStoreError", "Quota", "QuotaStore", "StoreUnavailable",
]
