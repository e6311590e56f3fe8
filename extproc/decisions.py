"""What the pure core decides for one ext_proc message; `extproc.wire` turns these into protobuf."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from extproc.api import ApiError, Operation
from extproc.body import NO_RULES, BodyLimits, Routing
from extproc.quota.limits import Admission, Quota

Headers = tuple[tuple[str, str], ...]
JSON_CONTENT_TYPE = ("content-type", "application/json")


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


@dataclass(frozen=True, slots=True)
class Analyze:
    """Not an answer yet: a large body, for the shell to analyze off the event loop
    (``extproc.body.analyze`` with these arguments), then hand to ``Gateway.resume``."""

    operation: Operation
    body: bytes
    served_names: Mapping[str, str]
    limits: BodyLimits
    tokenizers: Mapping[str, str] = field(default_factory=dict)  # served name -> tokenizer.json path
    routing: Routing = NO_RULES


@dataclass(frozen=True, slots=True)
class Classify:
    """Not an answer yet: semantic routing, for the shell to match ``text`` to an intent off the
    event loop (``extproc.routing.classifier``), then hand the ``IntentMatch`` (None: the embedder
    is busy or failed; the default route) to ``Gateway.resume``."""

    text: str


@dataclass(frozen=True, slots=True)
class Lookup:
    """Not an answer yet: the response cache, for the shell to look ``key`` up (its Bloom filter,
    then its store), then hand the stored answer (None: a miss) to ``Gateway.resume``."""

    key: bytes
    stale: bool = False  # no pod can answer: a stale copy will do (the fallback chain's last resort)
    # For a key that keeps missing: how to fetch its answer once for every request waiting on it
    # (``extproc.cache.warm``); built only when needed.
    warm: Callable[[], object | None] | None = None
    # The semantic cache: (partition, the last user turn, its settings); None: exact keys only.
    semantic: tuple[str, str, object] | None = None


@dataclass(frozen=True, slots=True)
class SemanticHit:
    """What a ``Lookup`` found for a paraphrase: the stored answer and the match's cosine."""

    value: bytes
    score: float


Decision = Continue | Reply
Effect = Admit | Analyze | Classify | Lookup  # work the shell does, then hands back to ``Gateway.resume``
Step = Decision | Effect
PASS_THROUGH = Continue()
