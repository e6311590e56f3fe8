"""What the gateway learns from a request body, with its cost bounded. Pure: no I/O.

``analyze`` parses, bounds, validates and estimates one body and returns the few facts the
request path needs afterwards (``BodyFacts``), plus the body to send on when it must change
(an alias rewritten to the served name, ``stream_options.include_usage`` added). The parsed JSON
is not kept: a request holds O(1) memory once its body is analyzed, whatever its size.

Cost: structure is bounded before validation (``BodyLimits``: nesting depth, messages, tools,
content parts, prompts, JSON values in all), so a hostile body is refused after one C-speed
``orjson.loads`` and a walk over its containers. The server runs ``analyze`` on its event loop for
small bodies and in a helper process above ``server.offload_body_bytes``; both get the same answer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from extproc.api import ApiError, EmbeddingRequest, Operation, ParsedRequest, load_object, validate
from extproc.routing.features import PromptFeatures, extract, intent_text
from extproc.routing.prefix import prefix_hashes
from extproc.routing.rules import RouteContext, Rule, choose
from extproc.tokens import FallbackEstimator, TokenEstimator


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """Bounds on a body's structure; each refusal is a 400 naming the ``param`` that broke it."""

    max_depth: int = 64  # nesting of objects and arrays (JSON schemas in tools nest ~10 deep)
    max_messages: int = 2048  # chat messages
    max_tools: int = 128  # OpenAI's own limit on tools
    max_content_parts: int = 4096  # multimodal content parts, all messages together
    max_prompts: int = 2048  # entries of a prompt / input list (OpenAI's embeddings batch limit)
    max_values: int = 2_000_000  # JSON values in all (a 128k-token prompt of token ids is 128k)


RULE_MODEL = "model"  # no rule matched: the model the client named, in its own pool
RULE_INTENTS = "intents"  # no rule matched: semantic routing (the client named ``intents.model_name``)


@dataclass(frozen=True, slots=True)
class BodyFacts:
    """What the request path needs of a valid body once it is analyzed."""

    model: str  # as the client asked for it
    served: str | None  # the name pods serve (None: no such model or alias)
    stream: bool
    n: int
    output_limit: int | None  # max_tokens / max_completion_tokens
    embedding: bool
    input_tokens: int  # the estimator's count, for reservations and streams without usage
    strip_usage: bool  # include_usage was added for the ledger; Envoy's Lua filter drops the chunk
    features: PromptFeatures = PromptFeatures()  # read only when routing rules are configured
    rule: str = ""  # the routing rule that chose ``served`` ("": the model the client named)
    pool: str | None = None  # the rule's pool (None: the served model's own)
    prefix: tuple[int, ...] = ()  # hashes of the prompt's leading blocks, for the picker's prefix affinity
    # Semantic routing asked (model "auto", or a rule with intents): the text to classify. ``served``
    # and ``pool`` are then the default route's, and the body to forward lacks its "model" field
    # (``with_model`` puts the chosen one back).
    intent_text: str | None = None
    intent: str = ""  # the intent that chose ``served`` ("default": none did)
    score: float | None = None  # its cosine similarity
    batchable: bool = False  # may share one merged call to a pod (see ``can_batch``)
    answer_digest: bytes | None = None  # a deterministic request's answer-defining fields (``answer_digest``)
    # For the semantic cache: the last user turn, and the digest of everything else that defines the answer
    semantic_text: str = ""
    context_digest: bytes | None = None

    @property
    def chosen_by(self) -> str:
        """What chose the served model and pool: the rule's name, else semantic routing or the
        client's model."""
        return self.rule or (RULE_INTENTS if self.intent else RULE_MODEL)


@dataclass(frozen=True, slots=True)
class Analysis:
    """What ``analyze`` returns: the body's facts, and the body to forward when it must change."""

    facts: BodyFacts
    body: bytes | None  # None: forward the body as received


# Fields that do not change a generation's answer: who asks, how it is delivered, what is stored.
_DELIVERY_FIELDS = frozenset({"model", "stream", "stream_options", "user", "metadata", "store", "service_tier",
                              "safety_identifier", "prompt_cache_key"})


def answer_digest(path: str, raw: Mapping[str, object]) -> bytes | None:
    """SHA-256 of what defines a deterministic request's answer (temperature 0, or a seed): the
    endpoint and every field but the model (the gateway adds the served one) and the delivery
    fields, as canonical JSON (sorted keys). None for a sampled request: its answer is not one."""
    seed, temperature = raw.get("seed"), raw.get("temperature")
    if not (temperature == 0 or (isinstance(seed, int) and not isinstance(seed, bool))):
        return None
    defining = {k: v for k, v in raw.items() if k not in _DELIVERY_FIELDS}
    return hashlib.sha256(path.encode() + b"\n" + orjson.dumps(defining, option=orjson.OPT_SORT_KEYS)).digest()


def context_digest(path: str, raw: Mapping[str, object]) -> tuple[str, bytes | None]:
    """The last user turn (text only), and SHA-256 of everything else ``answer_digest`` covers:
    requests that differ only in how their last question is worded share the digest."""
    messages = raw.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict) \
            and messages[-1].get("role") == "user" and isinstance(messages[-1].get("content"), str):
        text = messages[-1]["content"]
        rest = {**raw, "messages": messages[:-1]}
    elif isinstance(raw.get("prompt"), str):
        text, rest = raw["prompt"], {**raw, "prompt": None}
    else:
        return "", None
    defining = {k: v for k, v in rest.items() if k not in _DELIVERY_FIELDS}
    return text, hashlib.sha256(path.encode() + b"\n" + orjson.dumps(defining, option=orjson.OPT_SORT_KEYS)).digest()


@dataclass(frozen=True, slots=True)
class SemanticRouting:
    """Semantic routing's settings as the body analysis needs them (``intents:`` in the config)."""

    model_name: str  # the model name a client sends to ask for it ("auto")
    default_model: str  # the route of a prompt no intent matches
    default_pool: str
    max_chars: int  # characters of the prompt classified


@dataclass(frozen=True, slots=True)
class Routing:
    """What routing needs besides the body: the rules, who asks, and the prefix blocks the picker
    scores (picklable, for the helper)."""

    rules: tuple[Rule, ...] = ()
    tenant_tags: tuple[tuple[str, str], ...] = ()
    qos: str = ""
    prefix_blocks: tuple[int, int] = (0, 0)  # (block_chars, max_blocks) to hash; (0, 0): none
    intents: SemanticRouting | None = None  # semantic routing, when configured


NO_RULES = Routing()
NO_FEATURES = PromptFeatures()


def analyze(operation: Operation, body: bytes, served_names: Mapping[str, str], limits: BodyLimits,
            estimators: Mapping[str, TokenEstimator] | None = None, routing: Routing = NO_RULES
            ) -> Analysis:
    """Parse, bound, validate and estimate ``body``: its facts, and the body to forward when it
    changed (else None: forward it as is). Raises ``ApiError`` (400) for a bad one.

    ``served_names`` maps every name a client may use (canonical names and aliases) to the name
    pods serve; a model missing from it is reported as ``served=None`` (the caller answers 404).
    ``estimators`` counts a served model's input with its own tokenizer; others get a heuristic.
    ``routing``'s rules may choose another served model (and pool) from the body's features.
    """
    raw = load_object(body)
    check_structure(raw, limits)
    parsed = validate(operation, raw)
    request = parsed.model
    digest = answer_digest(operation.path, raw) if not isinstance(request, EmbeddingRequest) else None
    semantic_text, context = context_digest(operation.path, raw) if digest is not None else ("", None)
    served = served_names.get(request.model)
    stream = bool(getattr(request, "stream", False))
    counters = estimators or {}
    input_tokens = (counters.get(served or "") or _FALLBACK).estimate(parsed).total
    features, rule, pool, classify = NO_FEATURES, "", None, False
    if routing.rules:  # the prompt's features are read only when rules may use them
        features = extract(raw)
        route_context = RouteContext(request.model, features, stream, request.output_limit, input_tokens,
                                     dict(routing.tenant_tags), routing.qos)
        chosen = choose(routing.rules, route_context).rule
        if chosen is not None:
            rule, pool, classify = chosen.name, chosen.pool, chosen.intents and routing.intents is not None
            if chosen.model != served:
                served = chosen.model
                input_tokens = (counters.get(served) or _FALLBACK).estimate(parsed).total
    if not rule and routing.intents is not None and request.model == routing.intents.model_name:
        served, pool, classify = routing.intents.default_model, routing.intents.default_pool, True
        input_tokens = (counters.get(served) or _FALLBACK).estimate(parsed).total
    block_chars, max_blocks = routing.prefix_blocks
    prefix = prefix_hashes(raw, block_chars, max_blocks) if block_chars and not isinstance(
        request, EmbeddingRequest) else ()
    strip_usage = needs_usage_chunk(parsed)
    changed = False
    text = None
    if classify:  # the model is chosen later: forward the body without it (see with_model)
        assert routing.intents is not None
        text = intent_text(raw, routing.intents.max_chars)
        del raw["model"]
        changed = True
    elif served is not None and served != request.model:  # an alias: pods know the served name
        raw["model"] = served
        changed = True
    if served is not None and strip_usage:
        raw["stream_options"] = {**(raw.get("stream_options") or {}), "include_usage": True}
        changed = True
    facts = BodyFacts(
        model=request.model, served=served, stream=stream, n=getattr(request, "n", None) or 1,
        output_limit=request.output_limit, embedding=isinstance(request, EmbeddingRequest),
        input_tokens=input_tokens, strip_usage=strip_usage and served is not None, features=features,
        rule=rule, pool=pool, prefix=prefix, intent_text=text, batchable=can_batch(raw), answer_digest=digest,
        semantic_text=semantic_text, context_digest=context,
    )
    # Depth is bounded (max_depth < orjson's 254 levels), so dumps cannot raise here.
    return Analysis(facts, orjson.dumps(raw) if changed else None)


_FALLBACK = FallbackEstimator()


def with_model(body: bytes, model: str) -> bytes:
    """A body analyzed for semantic routing (an object without "model"), given its model."""
    field = b'{"model":' + orjson.dumps(model)
    return field + b"}" if body == b"{}" else field + b"," + body[1:]


def with_served_model(body: bytes, model: str) -> bytes:
    """A valid body with its model replaced (a fallback model serves it)."""
    raw = orjson.loads(body)
    raw["model"] = model
    return orjson.dumps(raw)


_PER_CALL_FIELDS = ("tools", "functions", "response_format", "logprobs", "top_logprobs", "echo", "best_of",
                    "suffix", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "logit_bias")


def can_batch(raw: dict[str, Any]) -> bool:
    """Whether a validated chat or completion body can be one prompt of a merged completion call:
    one choice, one text prompt (chat: text parts only), and nothing a pod applies to a whole
    call at once (tools, structured output, logprobs, echo, best_of, logit_bias)."""
    if (raw.get("n") or 1) != 1 or any(raw.get(name) for name in _PER_CALL_FIELDS):
        return False
    messages = raw.get("messages")
    if messages is not None:
        return all(type(m) is dict and (isinstance(m.get("content"), str) or (
            isinstance(m.get("content"), list) and all(type(p) is dict and p.get("type") == "text"
                                                       for p in m["content"])))
            and not m.get("tool_calls") and m.get("role") != "tool" for m in messages)
    return isinstance(raw.get("prompt"), str)


def needs_usage_chunk(parsed: ParsedRequest) -> bool:
    """True for a streamed (chat) completion whose client did not ask for
    ``stream_options.include_usage``: the pod reports usage only in that final chunk."""
    request = parsed.model
    if isinstance(request, EmbeddingRequest) or not request.stream:
        return False
    options = request.stream_options
    if options is None:
        return True
    # vLLM's continuous_usage_stats puts usage in every chunk once include_usage is on: a client
    # that set it without include_usage would start seeing usage, so it keeps the text count.
    return not options.include_usage and not getattr(options, "continuous_usage_stats", None)


def check_structure(raw: dict[str, Any], limits: BodyLimits) -> None:
    """Refuse a body whose shape would make validation or forwarding expensive or unsafe.

    Counts first (O(1) each), then one walk over the containers for depth and the total number of
    values; the path of a container is a linked (parent, key) pair, formatted only on refusal.
    """
    messages = raw.get("messages")
    if isinstance(messages, list):
        _at_most(len(messages), limits.max_messages, "messages", "messages")
        parts = sum(len(m["content"]) for m in messages if type(m) is dict and type(m.get("content")) is list)
        _at_most(parts, limits.max_content_parts, "messages", "content parts in all messages")
    tools = raw.get("tools")
    if isinstance(tools, list):
        _at_most(len(tools), limits.max_tools, "tools", "tools")
    for field in ("prompt", "input"):
        value = raw.get(field)
        if isinstance(value, list):
            _at_most(len(value), limits.max_prompts, field, f"entries in {field}")

    values = 0
    stack: list[tuple[Any, int, Any]] = [(raw, 1, None)]
    while stack:
        container, depth, path = stack.pop()
        values += len(container)
        if values > limits.max_values:
            raise ApiError(400, f"The request body holds more than {limits.max_values} JSON values.",
                           param=_format_path(path), code="invalid_value")
        items = container.items() if type(container) is dict else enumerate(container)
        for key, item in items:
            kind = type(item)
            if kind is dict or kind is list:
                if depth >= limits.max_depth:
                    param = _format_path((path, key))
                    raise ApiError(400, f"'{param}' is nested more than {limits.max_depth} levels deep.",
                                   param=param, code="invalid_value")
                if item:
                    stack.append((item, depth + 1, (path, key)))


def _at_most(count: int, limit: int, param: str, what: str) -> None:
    if count > limit:
        raise ApiError(400, f"Too many {what}: {count}; the limit is {limit}.", param=param, code="invalid_value")


def _format_path(path: Any) -> str | None:
    keys: list[Any] = []
    while path is not None:
        path, key = path
        keys.append(key)
    out = ""
    for key in reversed(keys):
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or None
