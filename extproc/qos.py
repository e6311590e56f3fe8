"""Which QoS class a request runs in: the one its client asks for (``x-llmgw-qos``), if its
tenant may use it, else the tenant's default. Pure."""

from __future__ import annotations

from extproc.api import ApiError
from extproc.config import Tenant

QOS_HEADER = "x-llmgw-qos"  # a client asks for a class with it; the gateway sets the one granted


def choose_qos(tenant: Tenant, asked: str | None) -> str | ApiError:
    """The class granted, or a 403 naming the classes the key may use."""
    if asked is None or not asked.strip():
        return tenant.qos[0]
    if asked.strip() not in tenant.qos:
        return ApiError(403, f"QoS class {asked.strip()!r} is not allowed for this key; allowed: "
                        f"{', '.join(tenant.qos)}.", param=QOS_HEADER, code="qos_class_not_allowed")
    return asked.strip()
