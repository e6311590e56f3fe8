"""The director: what the gateway decides for each phase of a request. Pure: no grpc, no I/O.

request headers -> path and method, content type and length, identity (request id, traceparent),
                   internal headers stripped
request body    -> analyze the body (extproc.body: bounded parse, validation, token estimate; in a
                   helper process for large bodies), resolve the model (aliases), ask for
                   admission, pick an endpoint of its pool and a fallback, set the routing headers
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from pathlib import Path
from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from extproc.api import OPERATIONS_BY_PATH, ApiError, Operation
from extproc.body import BodyFacts, BodyLimits, analyze
from extproc.config import GatewayConfig, Model, Tenant, hash_key
from extproc.decisions import Admit, Analyze, Continue, Decision, Headers, Reply
from extproc.keys import KeySnapshot
from extproc.observer import ResponseObservation, Usage
from extproc.predict import OutputLengthPredictor
from extproc.quota.limits import Admission, Lease, LimitKind, format_duration
from extproc.quota.limits import Decision as QuotaVerdict
from extproc.tokens import BpeEstimator, FallbackEstimator, TokenEstimator
from extproc.routing.health import EndpointHealth
from extproc.routing.picker import EndpointPicker
from extproc.telemetry.tracecontext import IdSource, TraceContext, continue_or_start, random_hex, request_id

# Headers only the gateway may set: a client's copy is removed before anything routes on it.
INTERNAL_PREFIX = "x-llmgw-"
DESTINATION_HEADER = "x-gateway-destination-endpoint"  # read by the ORIGINAL_DST cluster
ROUTE_HEADER = "x-llmgw-route"
MODEL_HEADER = "x-llmgw-model"
POOL_HEADER = "x-llmgw-pool"
TENANT_HEADER = "x-llmgw-tenant"
QOS_HEADER = "x-llmgw-qos"  # a client asks for a QoS class with it; the gateway sets the one granted
RATELIMIT_PREFIX = "x-ratelimit-"
ROUTE_DIRECT = "direct"
MODELS_PATH = "/v1/models"
RECENT_LIMIT = 4096  # finished forwarded requests kept for a late observer message (O(1) memory each)
# A client must not steer Envoy: x-envoy-original-dst-host, x-envoy-retry-on, ... are removed.
ENVOY_PREFIX = "x-envoy-"
# Envoy answered `expect: 100-continue` itself; another expectation would get a pod's plain 417.
HOP_HEADERS = frozenset({"expect"})


@dataclass(slots=True)
class RequestState:
    """What one request carries through its phases (one per ext_proc stream)."""

    started: float
    path: str = ""
    request_id: str = ""
    trace: TraceContext | None = None
    operation: Operation | None = None
    model: Model | None = None
    endpoint: str | None = None
    facts: BodyFacts | None = None  # what the body said; the parsed JSON itself is not kept
    new_body: bytes | None = None  # the body to forward when it changed; dropped once sent
    rejected: ApiError | None = None
    released: bool = False
    tenant: Tenant | None = None
    qos: str = ""  # the tenant's QoS class for this request
    reserved_tokens: int = 0
    reserved_cost: int = 0  # micro-dollars
    lease: Lease | None = None  # a quota admission to settle when the response ends
    settled: bool = False
    lease_renewed: float = 0.0  # monotonic time of admission or of the last renewal
    rate_headers: Headers = ()

    def identity_headers(self) -> Headers:
        """Headers that go to the pod and back to the client: ``x-request-id`` and ``traceparent``."""
        if self.trace is None:
            return ()
        return (("x-request-id", self.request_id), ("traceparent", self.trace.traceparent))


class Gateway:
    """Turns request phases into decisions, against one immutable config snapshot."""

    def __init__(self, config: GatewayConfig, picker: EndpointPicker, new_id: IdSource = random_hex,
                 estimator: TokenEstimator | None = None, predictor: OutputLengthPredictor | None = None,
                 health: EndpointHealth | None = None) -> None:
        self._picker = picker
        self.health = health or EndpointHealth()
        self._new_id = new_id
        # Reservations are reconciled to the pod's reported usage, so a cheap estimate will do here.
        self._estimator = estimator or FallbackEstimator()
        self.predictor = predictor or OutputLengthPredictor()
        # Keys added with `llmgw keys add`: a snapshot of Redis's table, swapped whole by its watcher.
        self.redis_keys = KeySnapshot.empty()
        self.reload(config)
        self._active: dict[str, RequestState] = {}  # forwarded requests by the gateway's span id
        # Finished ones, briefly: the observer's messages may be handled after the main stream ended.
        self._recent: OrderedDict[str, RequestState] = OrderedDict()

    def reload(self, config: GatewayConfig) -> None:
        """Swap in a new config snapshot; requests in flight keep what they already decided.

        Tokenizers are loaded here (once per file, kept across reloads), never on a request.
        """
        counters = getattr(self, "_counters", {})
        self._counters: dict[Path, TokenEstimator] = {
            m.tokenizer: counters.get(m.tokenizer) or BpeEstimator.from_spec(str(m.tokenizer))
            for m in config.models if m.tokenizer is not None
        }
        self._models_body = _models_list(config)
        self._served_names = {name: model.name for name, model in config.models_by_name.items()}
        self._limits = BodyLimits(**config.server.limits.model_dump())
        self.config = config

    def set_redis_keys(self, snapshot: KeySnapshot) -> None:
        """Swap in a new snapshot of the keys stored in Redis (the key table's watcher calls this)."""
        self.redis_keys = snapshot

    def new_request(self) -> RequestState:
        """State for a new ext_proc stream."""
        return RequestState(started=time.monotonic())

    # -- phases -----------------------------------------------------------------------------

    def request_headers(self, state: RequestState, headers: Mapping[str, str], end_of_stream: bool) -> Decision:
        """Check path, method, content type and size; set identity; strip internal headers."""
        state.request_id = request_id(headers.get("x-request-id"), self._new_id)
        state.trace = continue_or_start(headers.get("traceparent"), self._new_id)
        method = headers.get(":method", "")
        path = state.path = headers.get(":path", "").partition("?")[0]
        server = self.config.server
        if len(headers) > server.max_header_count or sum(map(len, headers)) + sum(map(len, headers.values())) \
                > server.max_header_bytes:
            # Room for the headers the gateway adds under Envoy's limits (a 503 otherwise), and a
            # header block vLLM's server (h11: 16 KiB) still reads.
            return self._reject(state, ApiError(
                431, f"Request headers too large: at most {server.max_header_count} headers and "
                f"{server.max_header_bytes} bytes.", code="request_header_fields_too_large"))

        if path == MODELS_PATH or path.startswith(MODELS_PATH + "/"):
            if method != "GET":
                return self._reject(state, ApiError(405, f"{method} is not allowed on {path}; use GET",
                                                    code="method_not_allowed"), (("allow", "GET"),))
            if self.config.auth_required and not self._authenticate(state, headers):
                return self._unauthorized(state)
            return self._models(state, path)
        operation = OPERATIONS_BY_PATH.get(path)
        if operation is None:
            return self._reject(state, ApiError(404, f"Unknown request URL: {method} {path}.", code="unknown_url"))
        if method != "POST":
            return self._reject(state, ApiError(405, f"{method} is not allowed on {path}; use POST",
                                                code="method_not_allowed"), (("allow", "POST"),))
        state.operation = operation
        if self.config.auth_required and not self._authenticate(state, headers):
            return self._unauthorized(state)
        if state.tenant is not None:
            refused = self._choose_qos(state, state.tenant, headers.get(QOS_HEADER))
            if refused is not None:
                return refused

        content_type = headers.get("content-type", "")
        if content_type.partition(";")[0].strip().lower() != "application/json":
            return self._reject(state, ApiError(
                415, f"Unsupported content type {content_type or '(none)'!r}: send 'Content-Type: application/json'.",
                code="unsupported_media_type"))
        # Envoy's decompressor decodes (and unlabels) the encodings it knows; any label left is one it
        # cannot decode, and a pod would read the bytes as JSON.
        encoding = headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            return self._reject(state, ApiError(
                415, f"Unsupported content encoding {encoding!r}: send the body as is, or gzip-, br- or zstd-encoded.",
                param="content-encoding", code="unsupported_media_type"))
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.config.max_body_bytes:
            return self._too_large(state, int(length))
        if end_of_stream:
            return self._reject(state, ApiError(400, "The request body is empty: send a JSON object.",
                                                code="invalid_json"))

        strip = tuple(name for name in headers if _is_internal(name))
        self._active[state.trace.span_id] = state
        # Envoy picked a route from the client's headers; re-pick it without the stripped ones, so
        # a request that never reaches the body phase cannot ride a forged x-llmgw-route.
        return Continue(set_headers=state.identity_headers(), remove_headers=strip, clear_route_cache=True)

    def request_body(self, state: RequestState, body: bytes) -> Decision | Admit | Analyze:
        """Analyze the body here, or (``Analyze``) have the shell analyze a large one off the event
        loop and hand the result to ``body_analyzed``."""
        assert state.operation is not None, "the phase table lets a body in only after POST headers"
        if len(body) > self.config.max_body_bytes:
            return self._too_large(state, len(body))
        if len(body) >= self.config.server.offload_body_bytes:
            return Analyze(state.operation, body, self._served_names, self._limits)
        try:
            analyzed = analyze(state.operation, body, self._served_names, self._limits, self._estimator)
        except ApiError as error:
            return self._reject(state, error)
        return self.body_analyzed(state, analyzed)

    def body_analyzed(self, state: RequestState, analyzed: tuple[BodyFacts, bytes | None] | ApiError
                      ) -> Decision | Admit:
        """The body's facts (or why it is refused): resolve the model; then route the request, or
        first ask for admission (``Admit``) when the tenant has limits."""
        if isinstance(analyzed, ApiError):
            return self._reject(state, analyzed)
        facts, state.new_body = analyzed
        state.facts = facts
        model = self.config.lookup(facts.model)
        if model is None:
            state.new_body = None
            return self._reject(state, ApiError(
                404, f"The model '{facts.model}' does not exist or you do not have access to it.",
                param="model", code="model_not_found"))
        state.model = model
        quota = state.tenant.quota(state.qos) if state.tenant is not None else None
        if quota is None:
            return self._route(state)
        assert state.tenant is not None and state.trace is not None
        input_tokens, output_tokens = self._reserve(state, facts)
        state.reserved_tokens = input_tokens + output_tokens
        state.reserved_cost = micro_dollars(model.prices.cost(input_tokens, output_tokens, 0))
        admission = Admission(tenant=state.tenant.name, lease_id=state.trace.span_id, qos=state.qos,
                              reserve_tokens=state.reserved_tokens, reserve_cost=state.reserved_cost)
        return Admit(admission, quota)

    def admitted(self, state: RequestState, verdict: QuotaVerdict) -> Decision:
        """The quota store's verdict: route the request, or answer 429 naming the limit."""
        if not verdict.admitted:
            state.new_body = None
            if verdict.refused_by is not None and verdict.refused_by.is_budget:
                return self._reject(state, _over_budget(state, verdict), verdict.headers())
            return self._reject(state, _rate_limited(state, verdict), verdict.headers())
        state.lease = verdict.lease
        state.lease_renewed = time.monotonic()
        state.rate_headers = verdict.headers()
        return self._route(state)

    def store_unavailable(self, state: RequestState) -> Reply:
        """The quota store is down and the config says fail closed."""
        return self._reject(state, ApiError(503, "Rate limits cannot be checked right now; retry shortly.",
                                            type="server_error", code="service_unavailable"), (("retry-after", "1"),))

    def settle(self, state: RequestState, usage: Usage | None = None) -> Lease | None:
        """Learn the output length from ``usage``, and claim the lease to settle, once: the observer
        (with the usage) or the stream's end (without), whichever comes first."""
        if usage is not None and state.tenant is not None and state.model is not None and not state.settled:
            n = state.facts.n if state.facts is not None else 1
            self.predictor.observe((state.tenant.name, state.model.name), usage.output_tokens, n)
        if state.lease is None or state.settled:
            return None
        state.settled = True
        return state.lease

    def charge_of(self, state: RequestState, usage: Usage | None) -> tuple[int | None, int | None]:
        """What a finished request really used: tokens, and micro-dollars at its model's prices
        (``None``, ``None`` without usage: the reservation then stands)."""
        if usage is None:
            return None, None
        prices = state.model.prices if state.model is not None else None
        cost = prices.cost(usage.input_tokens, usage.output_tokens, usage.cached_tokens) if prices else 0.0
        return usage.total, micro_dollars(cost)

    def usage_of(self, state: RequestState, observation: ResponseObservation) -> tuple[Usage | None, bool]:
        """The request's usage: as the pod reported it, else counted from the streamed text (a pod
        that sends no usage chunk, or a client that hung up); the flag says it was estimated."""
        counter = self._counters.get(state.model.tokenizer) if state.model and state.model.tokenizer else None
        input_tokens = state.facts.input_tokens if state.facts is not None else 0
        return observation.final_usage((counter or self._estimator).count_text, lambda: input_tokens)

    def _reserve(self, state: RequestState, facts: BodyFacts) -> tuple[int, int]:
        """Tokens to hold: the input estimate and the predicted output (capped by max_tokens)."""
        if facts.embedding:
            return facts.input_tokens, 0
        key = (state.tenant.name if state.tenant else "", state.model.name if state.model else "")
        return facts.input_tokens, self.predictor.predict(key, facts.output_limit, facts.n)

    def _route(self, state: RequestState) -> Decision:
        """Pick the endpoint and a fallback for Envoy's one retry, and set the routing headers (and
        the new body for an alias or an added usage chunk)."""
        facts, model = state.facts, state.model
        assert facts is not None and model is not None
        usable = self.health.usable(model.pool.endpoints)
        state.endpoint = self._picker.pick(usable)
        # Envoy's override_host policy tries the listed hosts in order, one per attempt: a pod that
        # refuses the connection or resets before answering is retried once on the fallback.
        fallback = self._picker.fallback(usable, state.endpoint)
        destination = state.endpoint if fallback is None else f"{state.endpoint},{fallback}"

        set_headers: list[tuple[str, str]] = [
            (ROUTE_HEADER, ROUTE_DIRECT),
            (DESTINATION_HEADER, destination),
            (MODEL_HEADER, model.name),
            (POOL_HEADER, model.pool.name),
        ]
        if state.tenant is not None:
            set_headers.append((TENANT_HEADER, state.tenant.name))
            set_headers.append((QOS_HEADER, state.qos))
        set_headers.extend(state.rate_headers)  # copied onto the response by Envoy (envoy.yaml)
        if model.pool.credential:
            set_headers.append(("authorization", f"Bearer {model.pool.credential}"))
        if facts.strip_usage:  # exact usage for the ledger; Envoy's Lua filter drops the chunk
            set_headers.append((STRIP_USAGE_HEADER, "1"))
        new_body, state.new_body = state.new_body, None
        if new_body is not None:
            set_headers.append(("content-length", str(len(new_body))))
        return Continue(set_headers=tuple(set_headers), body=new_body, clear_route_cache=True)

    def active(self, span_id: str) -> RequestState | None:
        """The in-flight request whose gateway span is ``span_id`` (for the observer)."""
        return self._active.get(span_id) or self._recent.get(span_id)

    def request_trailers(self, state: RequestState) -> Decision:
        """Trailers: after the body they pass; with no body before them the request is empty."""
        if state.facts is None and state.rejected is None:
            return self._reject(state, ApiError(400, "The request body is empty: send a JSON object.",
                                                code="invalid_json"))
        return Continue()

    def finish(self, state: RequestState) -> None:
        """The stream ended (response done, client gone or error): release what the request held.

        A forwarded request is kept a while for the observer (a few hundred bytes: the body is
        gone); a refused one is forgotten, so what a rejection holds is O(1) and brief.
        """
        state.new_body = None
        if (state.trace is not None and self._active.pop(state.trace.span_id, None) is not None
                and state.endpoint is not None):
            self._recent[state.trace.span_id] = state
            if len(self._recent) > RECENT_LIMIT:
                self._recent.popitem(last=False)
        if state.endpoint is not None and not state.released:
            self._picker.release(state.endpoint)
            state.released = True

    # -- authentication ---------------------------------------------------------------------

    def _authenticate(self, state: RequestState, headers: Mapping[str, str]) -> bool:
        key = presented_key(headers)
        if key is None:
            return False
        digest = hash_key(key)
        tenant = self.config.tenant_for(digest)
        if tenant is None and (name := self.redis_keys.tenant_name(digest)) is not None:
            # A key in Redis names its tenant; one the config does not declare (any more) is refused.
            tenant = self.config.tenants_by_name.get(name)
        state.tenant = tenant
        return tenant is not None

    def _choose_qos(self, state: RequestState, tenant: Tenant, asked: str | None) -> Reply | None:
        """The class the client asked for (``x-llmgw-qos``) if the tenant may use it, else its default."""
        if asked is None or not asked.strip():
            state.qos = tenant.qos[0]
            return None
        if asked.strip() not in tenant.qos:
            return self._reject(state, ApiError(
                403, f"QoS class {asked.strip()!r} is not allowed for this key; allowed: {', '.join(tenant.qos)}.",
                param=QOS_HEADER, code="qos_class_not_allowed"))
        state.qos = asked.strip()
        return None

    def _unauthorized(self, state: RequestState) -> Reply:
        # OpenAI answers a missing and a wrong key alike: 401 invalid_api_key; the key is never echoed.
        error = ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                         code="invalid_api_key")
        return self._reject(state, error, (("www-authenticate", 'Bearer realm="llmgw"'),))

    # -- replies ----------------------------------------------------------------------------

    def _reject(self, state: RequestState, error: ApiError, extra: Headers = ()) -> Reply:
        state.rejected = error
        return Reply.error(error, (*state.identity_headers(), *extra))

    def _too_large(self, state: RequestState, size: int) -> Reply:
        limit = self.config.max_body_bytes
        return self._reject(state, ApiError(
            413, f"The request body is {size} bytes; the limit is {limit} bytes.", code="request_too_large"))

    def _models(self, state: RequestState, path: str) -> Reply:
        if path == MODELS_PATH:
            return Reply.json(200, self._models_body, state.identity_headers())
        name = path[len(MODELS_PATH) + 1:]
        model = self.config.lookup(name)
        if model is None:
            return self._reject(state, ApiError(
                404, f"The model '{name}' does not exist or you do not have access to it.",
                param="model", code="model_not_found"))
        return Reply.json(200, orjson.dumps(_model_card(name, model)), state.identity_headers())


# The tenant's credentials, in every header OpenAI-compatible clients put them in (Azure's api-key too).
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "api-key", "x-api-key"})


def _rate_limited(state: RequestState, verdict: QuotaVerdict) -> ApiError:
    """OpenAI's 429: ``rate_limit_exceeded``, the error type naming what ran out."""
    kind = verdict.refused_by or LimitKind.REQUESTS
    figure = verdict.tightest(kind)
    tenant = state.tenant.name if state.tenant else "this key"
    limit = f" (limit {figure.limit})" if figure is not None else ""
    if verdict.retry_after_ms is None:
        wait = " This request alone exceeds it: send a smaller one."
    else:
        wait = f" Please try again in {max(1, -(-verdict.retry_after_ms // 1000))}s."
    scope = f" for QoS class {verdict.refused_scope}" if verdict.refused_scope == "qos" else ""
    message = f"Rate limit reached for {tenant}{scope} on {_LIMIT_NAMES[kind]}{limit}.{wait}"
    kind_type = "tokens" if kind in (LimitKind.TOKENS, LimitKind.DAILY_TOKENS) else "requests"
    return ApiError(429, message, type=kind_type, code="rate_limit_exceeded")


def _over_budget(state: RequestState, verdict: QuotaVerdict) -> ApiError:
    """A spending budget ran out: OpenAI's ``insufficient_quota``, with HTTP 402 (Payment Required)
    rather than OpenAI's 429, so that clients do not retry what only a new period can fix."""
    kind = verdict.refused_by or LimitKind.DAILY_COST
    figure = verdict.tightest(kind)
    tenant = state.tenant.name if state.tenant else "this key"
    period = "daily" if kind is LimitKind.DAILY_COST else "monthly"
    budget = f" of ${figure.limit / 1e6:,.2f}" if figure is not None else ""
    if verdict.retry_after_ms is None:
        when = " This request alone would exceed it."
    else:
        boundary = "midnight" if period == "daily" else "the start of the month"
        when = f" It resets in {format_duration(verdict.retry_after_ms)} (at {boundary}, UTC)."
    message = f"You exceeded your current quota: {tenant} has used its {period} spending budget{budget}.{when}"
    return ApiError(402, message, type="insufficient_quota", code="insufficient_quota")


def micro_dollars(cost: float) -> int:
    """A cost in whole micro-dollars, rounded up (a budget is never under-charged)."""
    return math.ceil(cost * 1_000_000 - 1e-9) if cost > 0 else 0


_LIMIT_NAMES = {
    LimitKind.REQUESTS: "requests per minute (rpm)",
    LimitKind.TOKENS: "tokens per minute (tpm)",
    LimitKind.CONCURRENCY: "concurrent requests",
    LimitKind.DAILY_TOKENS: "tokens per day",
}


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The API key a client sent: ``Authorization: Bearer``, or Azure-style ``api-key``/``x-api-key``."""
    authorization = headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("api-key") or headers.get("x-api-key") or None


def _is_internal(name: str) -> bool:
    # x-ratelimit-*: the gateway's figures ride on the request for Envoy to copy onto the response.
    return (name.startswith((INTERNAL_PREFIX, RATELIMIT_PREFIX, ENVOY_PREFIX)) or name == DESTINATION_HEADER
            or name in CREDENTIAL_HEADERS or name in HOP_HEADERS)


def _model_card(name: str, model: Model) -> dict[str, object]:
    card: dict[str, object] = {"id": name, "object": "model", "created": 0, "owned_by": model.owned_by}
    if name != model.name:
        card["root"] = model.name  # an alias: vLLM's field for the model it serves
    if model.max_model_len:
        card["max_model_len"] = model.max_model_len
    return card


def _models_list(config: GatewayConfig) -> bytes:
    """``GET /v1/models``: every name a client may use, canonical names first, then aliases."""
    cards = [_model_card(m.name, m) for m in config.models]
    cards += [_model_card(alias, m) for m in config.models for alias in m.aliases]
    return orjson.dumps({"object": "list", "data": cards})


# -- usage of streamed responses --------------------------------------------------------------

# Set on a request whose usage chunk the gateway asked for: the Lua filter of envoy/envoy.yaml
# removes the header before the pod, and the chunk (`"choices":[]` with a `usage` object) before
# the client. x-llmgw-* from a client is stripped in request_headers, so it cannot be forged.
STRIP_USAGE_HEADER = "x-llmgw-strip-usage"
