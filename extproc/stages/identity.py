"""Identity: the request-headers stage. Ids and trace context, header limits, path and method,
the key's tenant and QoS class, body headers; internal headers stripped. ``/v1/models`` is answered
here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol

import orjson

from extproc import validation
from extproc.api import OPERATIONS_BY_PATH, ApiError
from extproc.auth import CHALLENGE, KEYS_UNAVAILABLE, UNAUTHORIZED, authenticate, presented_key
from extproc.catalog import model_card, models_list
from extproc.config import GatewayConfig
from extproc.keys import NO_VERSION, KeySnapshot
from extproc.qos import QOS_HEADER, choose_qos
from extproc.state import RequestState
from extproc.steps import RETRY_SOON, Answer, Continue, Reply
from extproc.telemetry.tracecontext import IdSource, continue_or_start, request_id

MODELS_PATH = "/v1/models"


class TraceSampler(Protocol):
    """Whether a request's span is exported, and the trace flags the pod gets
    (``extproc.telemetry.tracing.Sampler``)."""

    def sampled(self, trace_id_hex: str, parent_flags: str | None) -> bool:
        """Export this trace's span? (the client's flags when it sent a traceparent, else None)"""
        ...

    def flags(self, trace_id_hex: str, parent_flags: str | None) -> str:
        """The trace-flags for the pod's traceparent."""
        ...


class Identity:
    """Who asks, for what: the request-headers phase."""

    def __init__(self, config: GatewayConfig, new_id: IdSource, sampler: TraceSampler | None = None) -> None:
        self._new_id = new_id
        self._sampler = sampler  # None: tracing off, no span exported
        # Keys added with `llmgw keys add`: a snapshot of Redis's table, swapped whole by its watcher.
        self.redis_keys = KeySnapshot.empty()
        self.reload(config)

    def reload(self, config: GatewayConfig) -> None:
        """Use a new config snapshot from the next request on."""
        self.config = config
        self._models_body = models_list(config)

    def request_headers(self, state: RequestState, headers: Mapping[str, str], end_of_stream: bool) -> Answer:
        """Check path, method, content type and size; set identity; strip internal headers."""
        config = self.config
        state.request_id = request_id(headers.get("x-request-id"), self._new_id)
        trace = continue_or_start(headers.get("traceparent"), self._new_id)
        if self._sampler is not None:
            # A continued trace keeps the client's decision; a new one is sampled by its trace id.
            parent_flags = trace.flags if trace.parent_span_id else None
            state.sampled = self._sampler.sampled(trace.trace_id, parent_flags)
            trace = replace(trace, flags=self._sampler.flags(trace.trace_id, parent_flags))
        state.trace = trace
        method = headers.get(":method", "")
        path = state.path = headers.get(":path", "").partition("?")[0]
        if (too_many := validation.header_limits(headers, config.server)) is not None:
            return state.reject(too_many)
        if path == MODELS_PATH or path.startswith(MODELS_PATH + "/"):
            if method != "GET":
                return state.reject(*validation.method_not_allowed(method, path, "GET"))
            if config.auth_required and not self._authenticate(state, headers):
                return self._unknown_key(state, headers)
            return self._models(state, path)
        operation = OPERATIONS_BY_PATH.get(path)
        if operation is None:
            return state.reject(validation.unknown_url(method, path))
        if method != "POST":
            return state.reject(*validation.method_not_allowed(method, path, "POST"))
        state.operation = operation
        if config.auth_required and not self._authenticate(state, headers):
            return self._unknown_key(state, headers)
        if state.tenant is not None:
            qos = choose_qos(state.tenant, headers.get(QOS_HEADER))
            if isinstance(qos, ApiError):
                return state.reject(qos)
            state.qos = qos
        if (bad := validation.body_headers(headers, config.max_body_bytes)) is not None:
            return state.reject(bad)
        if end_of_stream:
            return state.reject(validation.EMPTY_BODY)
        state.cache_read, state.cache_write = cache_control(headers.get("cache-control"))
        state.end("auth")
        # Envoy picked a route from the client's headers; re-pick it without the stripped ones, so
        # a request that never reaches the body phase cannot ride a forged x-llmgw-route.
        return Continue(set_headers=state.identity_headers(), remove_headers=validation.internal_headers(headers),
                        clear_route_cache=True)

    def _authenticate(self, state: RequestState, headers: Mapping[str, str]) -> bool:
        state.tenant = authenticate(self.config, self.redis_keys, headers)
        return state.tenant is not None

    def _unknown_key(self, state: RequestState, headers: Mapping[str, str]) -> Reply:
        """No key, or one nobody owns: a 401; a 503 instead while Redis's key table is not loaded."""
        if (self.config.redis_url is not None and self.redis_keys.version == NO_VERSION
                and presented_key(headers) is not None):
            return state.reject(KEYS_UNAVAILABLE, RETRY_SOON)
        return state.reject(UNAUTHORIZED, CHALLENGE)

    def _models(self, state: RequestState, path: str) -> Reply:
        if path == MODELS_PATH:
            return Reply.json(200, self._models_body, state.identity_headers())
        name = path[len(MODELS_PATH) + 1:]
        model = self.config.lookup(name)
        if model is None:
            return state.reject(model_not_found(name))
        return Reply.json(200, orjson.dumps(model_card(name, model)), state.identity_headers())


def model_not_found(name: str) -> ApiError:
    """404: no model of that name, as OpenAI words it."""
    return ApiError(404, f"The model '{name}' does not exist or you do not have access to it.",
                    param="model", code="model_not_found")


def cache_control(value: str | None) -> tuple[bool, bool]:
    """What a request's ``Cache-Control`` lets the response cache do: (read, write). ``no-cache``:
    the client wants a fresh answer (RFC 9111 5.2.1.4: not served from a store without asking the
    origin), which is stored as usual; ``no-store``: nothing of it is stored (5.2.1.5), and, as
    this gateway reads it, nothing is served from the cache either: the cache is bypassed. Other
    directives (max-age, ...) change nothing."""
    if not value:
        return True, True
    directives = {part.strip().split("=", 1)[0].strip().lower() for part in value.split(",")}
    store = "no-store" not in directives
    return store and "no-cache" not in directives, store
