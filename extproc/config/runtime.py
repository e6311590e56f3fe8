"""The compiled config: the frozen snapshot the request path reads.

``extproc.config.loader`` builds a ``GatewayConfig`` from the validated schema, once per load;
the gateway swaps the whole snapshot and never mutates it. Settings that need no compiling are
the schema's own frozen models (``PickerSpec``, ``CacheSpec``, ...), held as they are. Secrets
(pool credentials, tracing headers, the remote embedder's key) are left out of ``repr``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from extproc.chat_template import JinjaChatTemplate
from extproc.config.schema import (
    BatchingSpec,
    BreakerSpec,
    CacheSpec,
    DegradeSpec,
    EmbedderSpec,
    EndpointPickerSpec,
    HealthSpec,
    KeysSpec,
    LedgerSpec,
    PickerSpec,
    QuotaSpec,
    ResponseCacheSpec,
    ServerSpec,
)
from extproc.pricing import Prices
from extproc.quota.limits import UNLIMITED, Limits, Quota
from extproc.routing.rules import Rule
from extproc.templates import ChatML


@dataclass(frozen=True, slots=True)
class Pool:
    """A compiled pool: endpoints and the credential pods expect (redacted in repr)."""

    name: str
    endpoints: tuple[str, ...]
    credential: str | None = field(default=None, repr=False)
    health: HealthSpec = field(default_factory=HealthSpec)
    picker: PickerSpec = field(default_factory=PickerSpec)
    draining: frozenset[str] = frozenset()
    shed: tuple[tuple[str, float], ...] = ()  # (QoS class or "default", mean waiting depth per pod)
    batching: BatchingSpec = field(default_factory=BatchingSpec)
    degrade: DegradeSpec = field(default_factory=DegradeSpec)
    engine: str = "vllm"  # a name of extproc.routing.engines.PROFILES

    def shed_depth(self, qos: str) -> float | None:
        """The mean queue depth past which requests of class ``qos`` are refused (None: never)."""
        depths = dict(self.shed)
        return depths.get(qos, depths.get("default"))


@dataclass(frozen=True, slots=True)
class Model:
    """A compiled model entry."""

    name: str
    pool: Pool
    aliases: tuple[str, ...]
    owned_by: str
    max_model_len: int | None
    prices: Prices = field(default_factory=Prices)
    tokenizer: Path | None = None
    version: str = ""
    lora: bool = False
    # How chats are rendered into merged prompts; None: by the engine (llama.cpp's /apply-template),
    # else not merged at all (a guessed template makes a real model answer nonsense)
    chat_template: JinjaChatTemplate | ChatML | None = None
    cache: CacheSpec | None = None
    fallback: tuple[str, ...] = ()  # models serving its requests while its pool cannot

    @property
    def jinja_template(self) -> JinjaChatTemplate | None:
        """Its own Jinja chat template, which counts its chats' tokens whole (None for ChatML,
        the named default, or no template)."""
        return self.chat_template if isinstance(self.chat_template, JinjaChatTemplate) else None


@dataclass(frozen=True, slots=True)
class Tenant:
    """A compiled tenant (its keys live only as digests in the key table)."""

    name: str
    qos: tuple[str, ...]  # the classes it may use; the first is its default
    tags: tuple[tuple[str, str], ...]
    limits: Limits | None = None  # its own limits and budgets (micro-dollars), if any
    qos_limits: tuple[tuple[str, Limits], ...] = ()  # per class

    def quota(self, qos: str) -> Quota | None:
        """The limits an admission in class ``qos`` must pass; ``None`` when nothing limits it."""
        class_limits = dict(self.qos_limits).get(qos)
        if self.limits is None and class_limits is None:
            return None
        return Quota(self.limits or UNLIMITED, class_limits or UNLIMITED)


@dataclass(frozen=True, slots=True)
class Tracing:
    """Compiled tracing settings; the export headers (secrets among them) are redacted in repr."""

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4318/v1/traces"
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    sampling_ratio: float = 1.0
    service_name: str = "llmgw"
    timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class IntentRoute:
    """A compiled semantic route."""

    name: str
    model: str
    pool: str
    examples: tuple[str, ...]
    description: str = ""


@dataclass(frozen=True, slots=True)
class Intents:
    """Compiled semantic routing (the shell builds the embedder and the index from it)."""

    embedder: EmbedderSpec
    api_key: str | None = field(repr=False)
    threshold: float | None
    margin: float
    top_k: int
    model_name: str
    default: tuple[str, str]  # (model, pool)
    routes: tuple[IntentRoute, ...]
    cache_size: int
    max_chars: int
    max_pending: int
    scoring: Literal["centroid", "nearest"] | None = None  # None: the embedder's (routing.intents.scoring_for)
    background: bool = True  # compare with general prompts (centroid scoring)
    decision: Literal["learned", "threshold"] | None = None  # None: learned where the shipped model applies
    confidence: float | None = None  # the learned decision's bar (None: the model's)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """The frozen snapshot the request path reads; swapped whole, never mutated."""

    models_by_name: dict[str, Model]  # canonical names and aliases
    models: tuple[Model, ...]
    pools: dict[str, Pool]
    max_body_bytes: int
    server: ServerSpec
    redis_url: str | None = field(repr=False)
    tenants_by_key: dict[bytes, Tenant] = field(default_factory=dict, repr=False)  # SHA-256 digest -> tenant
    tenants_by_name: dict[str, Tenant] = field(default_factory=dict)
    auth_required: bool = False
    quota: QuotaSpec = field(default_factory=QuotaSpec)
    keys: KeysSpec = field(default_factory=KeysSpec)
    tracing: Tracing = field(default_factory=Tracing)
    rules: tuple[Rule, ...] = ()
    endpoint_picker: EndpointPickerSpec = field(default_factory=EndpointPickerSpec)
    intents: Intents | None = None
    route_caches: dict[str, CacheSpec] = field(default_factory=dict)  # routing rule name -> its cache
    response_cache: ResponseCacheSpec = field(default_factory=ResponseCacheSpec)
    breakers: BreakerSpec = field(default_factory=BreakerSpec)
    ledger: LedgerSpec = field(default_factory=LedgerSpec)

    @property
    def caches(self) -> bool:
        """Whether any model or rule caches answers."""
        return bool(self.route_caches) or any(m.cache is not None for m in self.models)

    def cache_for(self, rule: str, model: Model) -> CacheSpec | None:
        """The cache of a request routed by ``rule`` ("" for none) to ``model``: the rule's, else the model's."""
        return self.route_caches.get(rule) or model.cache

    @property
    def prefix_blocks(self) -> tuple[int, int]:
        """(block_chars, max_blocks) when some pool's picker scores prefixes, else (0, 0)."""
        if any(p.picker.kind == "scored" and p.picker.weights.get("prefix", 0.0) > 0 for p in self.pools.values()):
            prefix = self.endpoint_picker.prefix
            return prefix.block_chars, prefix.max_blocks
        return 0, 0

    def lookup(self, requested: str) -> Model | None:
        """The model a client's ``model`` field names, through aliases; None when unknown."""
        return self.models_by_name.get(requested)

    def tenant_for(self, digest: bytes) -> Tenant | None:
        """The tenant owning the key with this SHA-256 digest."""
        return self.tenants_by_key.get(digest)


def hash_key(key: str) -> bytes:
    """The SHA-256 digest under which an API key is stored; the key itself is never kept."""
    return hashlib.sha256(key.encode()).digest()
