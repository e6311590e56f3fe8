"""Is this an HTTP request the gateway serves: header limits, path, method, content type and
encoding, declared length; and which client headers must go before anything routes on them. Pure.

The body itself is checked by ``extproc.body`` (bounded parse, schema validation).
"""

from __future__ import annotations

from collections.abc import Mapping

from extproc.api import ApiError
from extproc.auth import CREDENTIAL_HEADERS
from extproc.config import ServerSpec
from extproc.steps import Headers

# Headers only the gateway may set: a client's copy is removed before anything routes on it.
INTERNAL_PREFIX = "x-llmgw-"
DESTINATION_HEADER = "x-gateway-destination-endpoint"  # read by the override_host LB policy
RATELIMIT_PREFIX = "x-ratelimit-"  # the gateway's figures ride on the request for Envoy to copy back
# A client must not steer Envoy: x-envoy-original-dst-host, x-envoy-retry-on, ... are removed.
ENVOY_PREFIX = "x-envoy-"
# Envoy answered `expect: 100-continue` itself; another expectation would get a pod's plain 417.
HOP_HEADERS = frozenset({"expect"})
EMPTY_BODY = ApiError(400, "The request body is empty: send a JSON object.", code="invalid_json")


def header_limits(headers: Mapping[str, str], server: ServerSpec) -> ApiError | None:
    """431 past the configured header count or bytes: room for the headers the gateway adds under
    Envoy's limits (a 503 otherwise), and a header block vLLM's server (h11: 16 KiB) still reads."""
    size = sum(map(len, headers)) + sum(map(len, headers.values()))
    if len(headers) > server.max_header_count or size > server.max_header_bytes:
        return ApiError(431, f"Request headers too large: at most {server.max_header_count} headers and "
                        f"{server.max_header_bytes} bytes.", code="request_header_fields_too_large")
    return None


def method_not_allowed(method: str, path: str, allowed: str) -> tuple[ApiError, Headers]:
    """405 with the ``allow`` header."""
    return (ApiError(405, f"{method} is not allowed on {path}; use {allowed}", code="method_not_allowed"),
            (("allow", allowed),))


def unknown_url(method: str, path: str) -> ApiError:
    """404 for a path no operation serves."""
    return ApiError(404, f"Unknown request URL: {method} {path}.", code="unknown_url")


def body_headers(headers: Mapping[str, str], max_body_bytes: int) -> ApiError | None:
    """The body's content type (JSON), encoding (none left: Envoy's decompressors decode and
    unlabel gzip, br and zstd; a label left is one it cannot decode) and declared length."""
    content_type = headers.get("content-type", "")
    if content_type.partition(";")[0].strip().lower() != "application/json":
        return ApiError(415, f"Unsupported content type {content_type or '(none)'!r}: send "
                        "'Content-Type: application/json'.", code="unsupported_media_type")
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        return ApiError(415, f"Unsupported content encoding {encoding!r}: send the body as is, or gzip-, "
                        "br- or zstd-encoded.", param="content-encoding", code="unsupported_media_type")
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_body_bytes:
        return too_large(int(length), max_body_bytes)
    return None


def too_large(size: int, limit: int) -> ApiError:
    """413 naming the size and the limit."""
    return ApiError(413, f"The request body is {size} bytes; the limit is {limit} bytes.", code="request_too_large")


def internal_headers(headers: Mapping[str, str]) -> tuple[str, ...]:
    """The client headers to remove: the gateway's own, Envoy's control headers, credentials (a
    pool's own replaces them), hop-by-hop expectations."""
    return tuple(name for name in headers if _is_internal(name))


def _is_internal(name: str) -> bool:
    return (name.startswith((INTERNAL_PREFIX, RATELIMIT_PREFIX, ENVOY_PREFIX)) or name == DESTINATION_HEADER
            or name in CREDENTIAL_HEADERS or name in HOP_HEADERS)
