"""Who is asking: the API key a client presents, and the tenant it belongs to. Pure: no I/O.

Keys are compared as digests (``config.hash_key``), looked up first in the config's table, then in
the snapshot of keys stored in Redis (``llmgw keys add``), which names its tenant. A key naming a
tenant the config no longer declares is refused like an unknown one.
"""

from __future__ import annotations

from collections.abc import Mapping

from extproc.api import ApiError
from extproc.config import GatewayConfig, Tenant, hash_key
from extproc.keys import KeySnapshot

# The tenant's credentials, in every header OpenAI-compatible clients put them in (Azure's api-key too).
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "api-key", "x-api-key"})
# OpenAI answers a missing and a wrong key alike: 401 invalid_api_key; the key is never echoed.
UNAUTHORIZED = ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                        code="invalid_api_key")
CHALLENGE = (("www-authenticate", 'Bearer realm="llmgw"'),)
# A key the config does not hold, while the Redis key table is not loaded (Redis away since the
# worker started, or longer than keys.max_stale_s): nobody can say it is wrong, so not a 401.
KEYS_UNAVAILABLE = ApiError(503, "API keys cannot be checked right now; retry shortly.", type="server_error",
                            code="keys_unavailable")


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The API key a client sent: ``Authorization: Bearer``, or Azure-style ``api-key``/``x-api-key``."""
    authorization = headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("api-key") or headers.get("x-api-key") or None


def authenticate(config: GatewayConfig, redis_keys: KeySnapshot, headers: Mapping[str, str]) -> Tenant | None:
    """The tenant whose key ``headers`` present, or None (no key, or one nobody owns)."""
    key = presented_key(headers)
    if key is None:
        return None
    digest = hash_key(key)
    tenant = config.tenant_for(digest)
    if tenant is None and (name := redis_keys.tenant_name(digest)) is not None:
        tenant = config.tenants_by_name.get(name)
    return tenant
