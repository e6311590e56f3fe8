"""The cache stage on its own: which requests are looked up, and what each answer of the cache
becomes (a hit rendered for the client, a hot key warmed, a miss routed). The lookup itself:
tests/test_cache_lookup.py; against Redis and Envoy: tests/e2e/test_cache_e2e.py."""

from __future__ import annotations

import random

import orjson

from extproc.api import Operation
from extproc.body import BodyLimits, analyze
from extproc.cache.answers import parse_answer
from extproc.config import parse_config
from extproc.routing.picker import Picker
from extproc.routing.router import Router
from extproc.stages.cache import CACHE_HEADER, MATCH_HEADER, Caching
from extproc.stages.identity import cache_control
from extproc.state import RequestState, new_state
from extproc.steps import HOT_MISS, Lookup, Reply, SemanticHit, Warm

DOCUMENT = {
    "pools": [{"name": "p", "endpoints": ["10.0.0.1:8000"]}],
    "models": [{"name": "m", "pool": "p", "cache": {"ttl_s": 60}},
               {"name": "s", "pool": "p", "cache": {"semantic": {"embedder": "hashing", "check": "none"}}},
               {"name": "plain", "pool": "p"}],
}
CONFIG = parse_config(DOCUMENT, env={})
ANSWER = parse_answer("/v1/chat/completions", orjson.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1_700_000_000, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}), streamed=False)


def _caching() -> Caching:
    router = Router(Picker(random.Random(0)))
    router.configure(CONFIG)
    return Caching(CONFIG, router)


def _state(model: str, temperature: float = 0.0) -> RequestState:
    state = new_state("1")
    state.operation, state.path = Operation.CHAT, "/v1/chat/completions"
    state.model = CONFIG.models_by_name[model]
    state.pool = state.model.pool
    state.body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "Capital of France?"}],
                               "temperature": temperature})
    state.facts = analyze(Operation.CHAT, state.body, {name: name for name in ("m", "s", "plain")},
                          BodyLimits()).facts
    return state


def test_only_a_deterministic_request_to_a_cached_model_is_looked_up() -> None:
    caching = _caching()
    assert caching.lookup(_state("plain")) is None
    assert caching.lookup(_state("m", temperature=0.7)) is None
    state = _state("m")
    asked = caching.lookup(state)
    assert isinstance(asked, Lookup) and asked.key == state.cache_key and asked.semantic is None and not asked.stale
    assert caching.lookup(_state("m")) == asked  # the same question, the same key


def test_cache_control_no_cache_asks_a_pod_and_stores_its_answer_and_no_store_bypasses_the_cache() -> None:
    caching = _caching()
    fresh = _state("m")
    fresh.cache_read, fresh.cache_write = cache_control("no-cache")
    assert caching.lookup(fresh) is None and fresh.cache_key is not None  # on to a pod; its answer is stored
    assert caching.stale(fresh) is None  # and never a stale copy instead
    bypass = _state("m")
    bypass.cache_read, bypass.cache_write = cache_control("max-age=0, No-Store")
    assert caching.lookup(bypass) is None and bypass.cache_key is None  # nothing read, nothing stored
    assert cache_control(None) == cache_control("max-age=60") == (True, True)
    assert cache_control("no-cache, no-store") == (False, False)


def test_a_semantic_cache_asks_with_the_last_user_turn_in_a_partition_of_the_context() -> None:
    asked = _caching().lookup(_state("s"))
    assert isinstance(asked, Lookup) and asked.semantic is not None
    assert asked.semantic.text == "Capital of France?" and len(asked.semantic.partition) == 64


def test_a_hit_is_answered_in_the_clients_shape_with_no_body_forwarded() -> None:
    caching, state = _caching(), _state("m")
    asked = caching.lookup(state)
    assert asked is not None
    reply = caching.looked_up(state, asked, ANSWER)
    assert isinstance(reply, Reply) and reply.status == 200 and (CACHE_HEADER, "hit") in reply.headers
    assert orjson.loads(reply.body)["choices"][0]["message"]["content"] == "Paris."
    assert state.cached == ANSWER and state.new_body is None and [p.name for p in state.phases] == ["cache"]
    record, charged = caching.record(state)
    assert record.decision.cache == "hit" and not charged and record.usage is not None
    assert record.usage.output_tokens == 2


def test_a_paraphrase_hit_says_how_close_it_was() -> None:
    caching, state = _caching(), _state("s")
    asked = caching.lookup(state)
    assert asked is not None
    reply = caching.looked_up(state, asked, SemanticHit(ANSWER, 0.9512))
    assert isinstance(reply, Reply) and (MATCH_HEADER, "semantic; score=0.951") in reply.headers


def test_a_hot_key_is_warmed_from_a_pod_of_the_pool_then_a_miss_goes_on() -> None:
    caching, state = _caching(), _state("m")
    asked = caching.lookup(state)
    assert asked is not None
    warm = caching.looked_up(state, asked, HOT_MISS)
    assert isinstance(warm, Warm) and warm.key == asked.key
    assert warm.warm_up.endpoint == "10.0.0.1:8000" and warm.warm_up.ttl_s == 60
    assert warm.warm_up.path == "/v1/chat/completions" and warm.warm_up.body == state.body
    assert not state.phases  # the lookup is timed once, when it ends
    assert caching.looked_up(state, warm, None) is None  # the warm-up failed: on to the pods
    assert state.cache_key == asked.key  # the pod's answer will be stored under it


def test_a_stale_lookup_that_misses_leaves_nothing_to_store() -> None:
    caching, state = _caching(), _state("m")
    asked = caching.stale(state)
    assert isinstance(asked, Lookup) and asked.stale
    assert caching.looked_up(state, asked, None) is None and state.cache_key is None
    assert _caching().stale(_state("plain")) is None
    stale = _state("m")
    reply = caching.looked_up(stale, Lookup(asked.key, stale=True), ANSWER)
    assert isinstance(reply, Reply) and (CACHE_HEADER, "stale") in reply.headers
