"""Semantic routing in the gateway: the Classify effect, the shell's classifier (batches, cache,
busy and failing embedders fall back to the default route), config checks, and the explain output."""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import orjson
import pytest

from extproc.api import Operation
from extproc.config import ConfigError, parse_config
from extproc.gateway import Gateway
from extproc.routing.classifier import IntentClassifier, build_index
from extproc.routing.embedders import HashingEmbedder
from extproc.routing.explain import explain
from extproc.routing.intents import Intent, IntentIndex, IntentMatch
from extproc.routing.picker import Picker
from extproc.steps import Classify, Continue

DOCUMENT = {
    "pools": [{"name": "general", "endpoints": ["10.0.0.1:8000"]}, {"name": "code", "endpoints": ["10.0.0.2:8000"]}],
    "models": [{"name": "llama", "pool": "general"}, {"name": "coder", "pool": "code", "aliases": ["coder-latest"]}],
    "routes": [{"name": "support", "match": {"models": ["support"]}, "model": "llama", "intents": True}],
    "intents": {
        "embedder": {"kind": "hashing"},
        "default": {"model": "llama"},
        "routes": [
            {"name": "code", "model": "coder", "examples": ["fix the bug in my python function",
                                                              "why does my javascript code throw an error"]},
            {"name": "chat", "model": "llama", "examples": ["tell me a joke about cats", "what should i cook tonight"]},
        ],
    },
}


def gateway(document: dict | None = None) -> Gateway:
    return Gateway(parse_config(document or DOCUMENT, env={}), Picker(random.Random(0)))


def body(model: str, text: str, **extra: object) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": text}], **extra})


def start(gw: Gateway, payload: bytes):  # state, step
    state = gw.new_request()
    gw.request_headers(state, {":method": "POST", ":path": "/v1/chat/completions",
                               "content-type": "application/json"}, False)
    return state, gw.request_body(state, payload)


def header(step: Continue, name: str) -> str:
    return dict(step.set_headers)[name]


# -- the gateway's Classify effect -----------------------------------------------------------------

def test_auto_asks_for_the_last_user_turn_and_routes_to_the_intent() -> None:
    gw = gateway()
    state, step = start(gw, body("auto", "my python function has a bug", stream=True))
    assert step == Classify("my python function has a bug")
    index = build_index(gw.config.intents)
    step = gw.resume(state, step, index.classify(step.text))
    assert isinstance(step, Continue) and step.body is not None
    sent = orjson.loads(step.body)
    assert sent["model"] == "coder" and sent["stream_options"] == {"include_usage": True}
    assert header(step, "x-llmgw-pool") == "code"
    decision = header(step, "x-llmgw-decision")
    assert decision.startswith("rule=intents; intent=code; score=") and decision.endswith("model=coder; pool=code")
    metadata = orjson.loads(dict(step.metadata)["llmgw"]["decision"])
    assert metadata["intent"] == "code" and metadata["rule"] == "intents" and 0 < metadata["score"] <= 1


@pytest.mark.parametrize("match", [None, IntentMatch(None, 0.03, 0.01, "chat")], ids=["busy", "unsure"])
def test_no_intent_takes_the_default_route(match: IntentMatch | None) -> None:
    gw = gateway()
    state, step = start(gw, body("auto", "zzz"))
    step = gw.resume(state, step, match)
    assert isinstance(step, Continue) and orjson.loads(step.body)["model"] == "llama"
    assert header(step, "x-llmgw-decision").startswith("rule=intents; intent=default")


def test_a_rule_with_intents_falls_back_to_its_own_model() -> None:
    gw = gateway()
    state, step = start(gw, body("support", "zzz qqq"))
    assert isinstance(step, Classify)
    step = gw.resume(state, step, IntentMatch(None, 0.0, 0.0, ""))
    assert header(step, "x-llmgw-decision") == "rule=support; intent=default; score=0.000; model=llama; pool=general"


def test_other_models_are_not_classified() -> None:
    state, step = start(gateway(), body("coder-latest", "tell me a joke about cats"))
    assert isinstance(step, Continue) and orjson.loads(step.body)["model"] == "coder"


def test_a_large_body_is_analyzed_off_the_loop_then_classified() -> None:
    document = {**DOCUMENT, "server": {"offload_body_bytes": 1024}}
    gw = gateway(document)
    state, step = start(gw, body("auto", "fix the bug in my python function " + "x" * 2000))
    from extproc.body import analyze  # what the helper process runs
    result = analyze(step.operation, step.body, step.served_names, step.limits, None, step.routing)
    assert step.operation is Operation.CHAT
    step = gw.resume(state, step, result)
    assert isinstance(step, Classify)


# -- config ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("change", "message"), [
    ({"intents": {**DOCUMENT["intents"], "model_name": "llama"}}, "intents.model_name: 'llama' is already used"),
    ({"intents": {**DOCUMENT["intents"], "default": {"model": "nope"}}}, "intents.default.model: 'nope'"),
    ({"intents": {**DOCUMENT["intents"], "routes": [{"name": "x", "model": "coder", "pool": "gpu",
                                                      "examples": ["a"]}]}}, "intents.routes[0].pool"),
    ({"intents": {**DOCUMENT["intents"], "embedder": {"kind": "remote"}}},
     "intents.embedder: a remote embedder needs url and model"),
    ({"intents": None}, "routes[0].intents: no `intents:` section"),
    ({"intents": {**DOCUMENT["intents"], "decision": "learned"}},
     "intents: decision: learned needs embedder kind multilingual"),
    ({"intents": {**DOCUMENT["intents"], "confidence": 0.5}}, "confidence: only the learned decision has one"),
    ({"intents": {**DOCUMENT["intents"], "embedder": {"kind": "multilingual"}, "threshold": 0.3, "confidence": 0.5}},
     "confidence: only the learned decision has one"),
    ({"intents": {**DOCUMENT["intents"], "embedder": {"kind": "multilingual"}, "decision": "learned",
                  "threshold": 0.3}}, "threshold: the learned decision has none"),
    ({"intents": {**DOCUMENT["intents"], "embedder": {"kind": "multilingual"}, "confidence": 1.5}},
     "intents.confidence"),
    ({"intents": {**DOCUMENT["intents"], "embedder": {"kind": "multilingual"}, "decision": "learned",
                  "background": False}}, "decision: learned needs embedder kind multilingual, centroid scoring and"),
])
def test_config_errors_name_the_field(change: dict, message: str) -> None:
    document = {**DOCUMENT, **change}
    if document["intents"] is None:
        del document["intents"]
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config(document, env={})


# -- the classifier shell --------------------------------------------------------------------------

class RecordingEmbedder:
    """Hashing vectors; records each batch; can be held (to fill the queue) or made to fail."""

    name = "recording"
    threshold = 0.05

    def __init__(self) -> None:
        self.inner = HashingEmbedder()
        self.batches: list[list[str]] = []
        self.release = threading.Event()
        self.release.set()
        self.fail = False

    def embed(self, texts: list[str]) -> np.ndarray:
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("embedder down")
        self.batches.append(list(texts))
        return self.inner.embed(texts)


@pytest.fixture
def recording() -> RecordingEmbedder:
    return RecordingEmbedder()


def classifier_with(embedder: RecordingEmbedder, max_pending: int = 64) -> tuple[IntentClassifier, object]:
    intents = parse_config({**DOCUMENT, "intents": {**DOCUMENT["intents"], "max_pending": max_pending}},
                           env={}).intents
    routes = [Intent(r.name, r.examples, r.model, r.pool) for r in intents.routes]
    return IntentClassifier(lambda _: IntentIndex(routes, embedder, threshold=0.05)), intents


async def test_concurrent_requests_are_embedded_in_one_batch_and_cached(recording: RecordingEmbedder) -> None:
    classifier, intents = classifier_with(recording)
    await classifier.configure(intents)
    recording.batches.clear()
    recording.release.clear()
    first = asyncio.create_task(classifier.classify("fix my python bug"))
    # One turn of the loop, not a wait: the first text is queued, and its runner, scheduled ahead of
    # the rest, hands it alone to the thread, which is held.
    await asyncio.sleep(0)
    rest = [asyncio.create_task(classifier.classify(t)) for t in ("a joke about dogs", "a joke about cats", "cook")]
    recording.release.set()
    matches = [await first, *[await task for task in rest]]
    assert matches[0].intent is not None and matches[0].intent.name == "code"
    assert recording.batches == [["fix my python bug"], ["a joke about dogs", "a joke about cats", "cook"]]
    again = await classifier.classify("a joke about cats")
    assert again == matches[2] and len(recording.batches) == 2  # from the cache, no thread
    assert classifier.stats.outcomes["matched"] + classifier.stats.outcomes["default"] == 5
    classifier.close()


async def test_a_full_queue_takes_the_default_route_at_once(recording: RecordingEmbedder) -> None:
    classifier, intents = classifier_with(recording, max_pending=1)
    await classifier.configure(intents)
    recording.release.clear()
    held = asyncio.create_task(classifier.classify("one"))
    await asyncio.sleep(0)  # turns of the loop, not waits: "one" goes to the held thread,
    queued = asyncio.create_task(classifier.classify("two"))
    await asyncio.sleep(0)  # and "two" waits in the queue
    assert await classifier.classify("three") is None  # two waits already: busy
    assert classifier.stats.outcomes["busy"] == 1
    recording.release.set()
    assert (await held) is not None and (await queued) is not None
    classifier.close()


async def test_a_failing_embedder_takes_the_default_route_and_recovers(recording: RecordingEmbedder,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    classifier, intents = classifier_with(recording)
    await classifier.configure(intents)
    recording.fail = True
    assert await classifier.classify("fix my python bug") is None
    assert await classifier.classify("another one") is None
    assert classifier.stats.outcomes["failed"] == 2
    assert sum("embedder failed" in r.message for r in caplog.records) == 1  # once per outage
    recording.fail = False
    match = await classifier.classify("fix my python bug")
    assert match is not None and match.intent is not None
    classifier.close()


async def test_without_an_index_every_request_takes_the_default_route() -> None:
    classifier = IntentClassifier()
    assert await classifier.classify("anything") is None
    await classifier.configure(parse_config(DOCUMENT, env={}).intents)
    assert classifier.ready and (await classifier.classify("fix the bug in my python function")) is not None
    await classifier.configure(None)
    assert not classifier.ready
    classifier.close()


# -- explain -----------------------------------------------------------------------------------------

def test_explain_shows_the_learned_decisions_probability() -> None:
    document = {**DOCUMENT, "intents": {**DOCUMENT["intents"], "embedder": {"kind": "multilingual"}}}
    config = parse_config(document, env={})
    result = explain(config, body("auto", "fix the bug in my javascript function"))
    semantic = result["intents"]
    assert semantic["decision"] == "learned" and semantic["intent"] == "code"
    assert semantic["probability"] >= semantic["confidence"] > 0
    assert "intent 'code' is likeliest (probability" in result["decision"]["why"]


def test_explain_shows_the_nearest_intent_and_why() -> None:
    config = parse_config(DOCUMENT, env={})
    result = explain(config, body("auto", "fix the bug in my javascript function"))
    assert result["decision"]["model"] == "coder" and result["decision"]["intent"] == "code"
    semantic = result["intents"]
    assert semantic["embedder"] == "hashing" and semantic["nearest"] == "code" and semantic["score"] > 0.05
    assert "intent 'code' is nearest" in result["decision"]["why"]
    unsure = explain(config, body("auto", "zzz"))
    assert unsure["decision"]["intent"] == "default" and unsure["decision"]["model"] == "llama"
    assert "the default route" in unsure["decision"]["why"]
