"""What the pure core answers for one ext_proc message (``Continue``, ``Reply``: ``extproc.wire``
turns these into protobuf), and the effects it asks the shell to run first (``Admit``, ``Analyze``,
``Classify``, ``Lookup``, ``Warm``), with what those hand back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from extproc.api import ApiError, Operation
from extproc.body import NO_RULES, BodyLimits, Routing
from extproc.quota.limits import Admission, Quota

if TYPE_CHECKING:  # annotations only: the body-analysis helper imports this module, and needs neither
    from extproc.cache.warm import WarmUp
    from extproc.config import SemanticCacheSpec

Headers = tuple[tuple[str, str], ...]
JSON_CONTENT_TYPE = ("content-type", "application/json")
RETRY_SOON: Headers = (("retry-after", "1"),)  # a refusal worth retrying a second later


@dataclass(frozen=True, slots=True)
class Continue:
    """Let the request go on, with header changes and possibly a new body.

    ``clear_route_cache`` makes Envoy pick the route again after headers set from the body
    (envoy.service.ext_proc.v3.CommonResponse.clear_route_cache).
    """

    set_headers: Headers = ()
    remove_headers: tuple[str, ...] = ()
    body: bytes | None = None
    clear_route_cache: bool = False
    # Envoy dynamic metadata: (namespace, JSON-able mapping) pairs (ProcessingResponse.dynamic_metadata;
    # the filter's metadata_options.receiving_namespaces must list each namespace).
    metadata: tuple[tuple[str, Mapping[str, object]], ...] = ()


@dataclass(frozen=True, slots=True)
class Reply:
    """Answer the client now (an ImmediateResponse); the request never reaches a pod.

    Envoy runs no response-header phase for it, so every header the client needs is here.
    """

    status: int
    body: bytes
    headers: Headers = ()

    @classmethod
    def error(cls, error: ApiError, headers: Headers = ()) -> Reply:
        """An OpenAI-style error reply."""
        return cls(error.status, error.body(), (JSON_CONTENT_TYPE, *headers))

    @classmethod
    def json(cls, status: int, body: bytes, headers: Headers = ()) -> Reply:
        """A JSON reply made by the gateway itself (``/v1/models``)."""
        return cls(status, body, (JSON_CONTENT_TYPE, *headers))


@dataclass(frozen=True, slots=True)
class Admit:
    """Not an answer yet: the shell must ask the quota store, then hand the verdict (or the
    ``StoreUnavailable`` it raised) to ``Gateway.resume``, which answers with a Continue or a 429."""

    admission: Admission
    quota: Quota


# How a model's input is counted: its tokenizer.json, and its own Jinja chat template (a config
# value, loaded where it is used) or None.
TokenizerSpec = tuple[str, str | None]


@dataclass(frozen=True, slots=True)
class Analyze:
    """Not an answer yet: a large body, for the shell to analyze off the event loop
    (``extproc.body.analyze`` with these arguments), then hand to ``Gateway.resume``."""

    operation: Operation
    body: bytes
    served_names: Mapping[str, str]
    limits: BodyLimits
    tokenizers: Mapping[str, TokenizerSpec] = field(default_factory=dict)  # served name -> its counting
    routing: Routing = NO_RULES


@dataclass(frozen=True, slots=True)
class Classify:
    """Not an answer yet: semantic routing, for the shell to match ``text`` to an intent off the
    event loop (``extproc.routing.classifier``), then hand the ``IntentMatch`` (None: the embedder
    is busy or failed; the default route) to ``Gateway.resume``."""

    text: str


@dataclass(frozen=True, slots=True)
class SemanticQuery:
    """What the semantic cache matches: the request's last user turn, within its partition (the
    rest of the conversation, the model and the tenant's share, digested), with its settings."""

    partition: str
    text: str
    spec: SemanticCacheSpec


@dataclass(frozen=True, slots=True)
class Lookup:
    """Not an answer yet: the response cache, for the shell to look ``key`` up
    (``extproc.cache.lookup``), then hand back the stored answer, a ``SemanticHit``, ``HOT_MISS``
    or None (a miss; also what a failed cache amounts to)."""

    key: bytes
    stale: bool = False  # no pod can answer: a stale copy will do (the fallback chain's last resort)
    semantic: SemanticQuery | None = None  # None: exact keys only


@dataclass(frozen=True, slots=True)
class Warm:
    """Not an answer yet: a hot key's answer, fetched once from a pod for every request waiting on
    it (``extproc.cache.warm``); the shell hands back the answer, or None."""

    key: bytes
    warm_up: WarmUp


@dataclass(frozen=True, slots=True)
class SemanticHit:
    """What a ``Lookup`` found for a paraphrase: the stored answer and the match's cosine."""

    value: bytes
    score: float


@dataclass(frozen=True, slots=True)
class HotMiss:
    """What a ``Lookup`` found for a key that missed before and is missing again: its answer is on
    its way, or could not be kept; a ``Warm`` fetches it once for every request asking."""


HOT_MISS = HotMiss()
Answer = Continue | Reply  # what goes back to Envoy for one message
Effect = Admit | Analyze | Classify | Lookup | Warm  # work the shell does, then hands back to ``Gateway.resume``
Step = Answer | Effect
PASS_THROUGH = Continue()
