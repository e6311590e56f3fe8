"""The semantic cache's index: partitions, capacity, threshold, candidates, prepared prompts. Lexical
or hand-made vectors and the cosine alone (``check="none"``), but where the learned check's vetoes
are the point (``tests/test_paraphrase.py`` tests the check itself)."""

from __future__ import annotations

import numpy as np
import pytest

from extproc.cache.semantic import Match, SemanticIndex
from extproc.routing.embedders import HashingEmbedder


class TableEmbedder:
    """Vectors set by hand, so that a test chooses each cosine; counts its calls."""

    name = "table"
    threshold = 0.5

    def __init__(self, vectors: dict[str, list[float]]) -> None:
        self.vectors = vectors
        self.calls = 0

    def embed(self, texts: list[str]) -> np.ndarray:
        self.calls += 1
        rows = np.array([self.vectors[t] for t in texts], dtype=np.float32)
        return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def key(n: int) -> bytes:
    return n.to_bytes(32, "big")  # the size of a real cache key (SHA-256)


# -- the index --------------------------------------------------------------------------------------

def test_empty_index_and_unknown_partition_match_nothing() -> None:
    index = SemanticIndex(HashingEmbedder(), threshold=0.5, check="none")
    assert index.match("", "What is the capital of Canada?") is None
    assert index.size("") == 0
    index.add("acme", "What is the capital of Canada?", key(1))
    assert index.match("globex", "What is the capital of Canada?") is None  # a partition never seen


def test_same_prompt_matches_with_its_key_and_text() -> None:
    index = SemanticIndex(HashingEmbedder(), threshold=0.5, check="none")
    index.add("", "How do I reset my password?", key(1))
    found = index.match("", "how do I reset my password")  # case and punctuation only
    assert found == Match(key(1), found.score, "How do I reset my password?")
    assert found.score > 0.95


def test_tenant_partitions_never_share_prompts() -> None:
    index = SemanticIndex(HashingEmbedder(), threshold=0.5, check="none")
    index.add("acme", "Summarize our refund policy.", key(1))
    assert index.match("globex", "Summarize our refund policy.") is None
    assert index.match("", "Summarize our refund policy.") is None  # "" is the shared partition, not a wildcard
    index.add("globex", "Summarize our refund policy.", key(2))
    assert index.match("acme", "Summarize our refund policy.").key == key(1)
    assert index.match("globex", "Summarize our refund policy.").key == key(2)


def test_capacity_evicts_the_oldest_prompt() -> None:
    index = SemanticIndex(HashingEmbedder(), threshold=0.9, capacity=3, check="none")
    prompts = ["Who wrote Hamlet?", "Explain TCP slow start.", "Give me a pancake recipe.", "What is a monad?"]
    for n, prompt in enumerate(prompts):
        index.add("", prompt, key(n))
    assert index.size("") == 3
    assert index.match("", prompts[0]) is None  # the oldest went first
    assert [index.match("", p).key for p in prompts[1:]] == [key(1), key(2), key(3)]
    index.add("", prompts[2], key(9))  # a prompt already stored: its key replaced, nothing evicted
    assert index.size("") == 3
    assert index.match("", prompts[2]).key == key(9)
    assert index.match("", prompts[1]).key == key(1)


@pytest.mark.parametrize(("threshold", "hit"), [(0.85, False), (0.80, True), (0.75, True)],
                         ids=["above the cosine", "at it", "below it"])
def test_threshold_is_respected(threshold: float, hit: bool) -> None:
    embedder = TableEmbedder({"Name a prime number.": [1.0, 0.0], "Give me a prime number.": [0.8, 0.6]})
    index = SemanticIndex(embedder, threshold=threshold, check="none")
    index.add("", "Name a prime number.", key(1))
    found = index.match("", "Give me a prime number.")  # cosine 0.8
    assert (found is not None) is hit
    if hit:
        assert found.score == pytest.approx(0.8)


class MiniLMTable(TableEmbedder):
    """Hand-made vectors under MiniLM's name, for the learned check (its second encoder and
    cross-encoder are real)."""

    name = "minilm"


def test_the_check_refuses_a_near_miss_that_cosine_accepts() -> None:
    same_vector = [1.0] + [0.0] * 383
    embedder = MiniLMTable({"What is 17 times 23?": same_vector, "What is 17 times 24?": same_vector})
    checked = SemanticIndex(embedder, threshold=0.9)
    bare = SemanticIndex(embedder, threshold=0.9, check="none")
    for index in (checked, bare):
        index.add("", "What is 17 times 23?", key(1))
    assert checked.match("", "What is 17 times 24?") is None  # a number vetoes it
    assert bare.match("", "What is 17 times 24?").score == pytest.approx(1.0)  # cosine alone: a false hit
    assert checked.match("", bare.prepare("What is 17 times 24?")) is None  # prepared without its features: read now


def test_only_the_nearest_candidate_is_checked_unless_more_are_asked_for() -> None:
    embedder = MiniLMTable({
        "What is 17 times 23?": [1.0, 0.0] + [0.0] * 382,
        "What is 17 times 24?": [1.0, 0.0] + [0.0] * 382,  # nearest, but another number
        "what is 17 times 23": [0.99, 0.14107] + [0.0] * 382,  # the same words
    })
    nearest, two = SemanticIndex(embedder, threshold=0.9), SemanticIndex(embedder, threshold=0.9, candidates=2)
    for index in (nearest, two):
        index.add("", "What is 17 times 24?", key(1))
        index.add("", "what is 17 times 23", key(2))
    assert nearest.candidates == 1 and nearest.match("", "What is 17 times 23?") is None  # "24" is vetoed
    found = two.match("", "What is 17 times 23?")
    assert found is not None and found.key == key(2)  # the best candidate the check accepts wins


@pytest.mark.parametrize("check", ["rules", "guard"])
def test_only_the_learned_check_or_none(check: str) -> None:
    with pytest.raises(ValueError, match="learned or none"):
        SemanticIndex(HashingEmbedder(), check=check)  # type: ignore[arg-type]


def test_a_prepared_prompt_is_embedded_once_for_match_and_add() -> None:
    embedder = TableEmbedder({"Explain DNS.": [1.0, 0.0]})
    index = SemanticIndex(embedder, threshold=0.9, check="none")
    prompt = index.prepare("Explain DNS.")
    assert index.match("", prompt) is None
    index.add("", prompt, key(1))
    assert index.match("", prompt).key == key(1)
    assert embedder.calls == 1


@pytest.mark.parametrize("arguments", [{"threshold": 0.0}, {"threshold": 1.5}, {"threshold": 0.5, "capacity": 0},
                                       {"threshold": 0.5, "candidates": 0}],
                         ids=["threshold 0", "threshold above 1", "capacity 0", "no candidates"])
def test_bad_settings_are_refused(arguments: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SemanticIndex(HashingEmbedder(), check="none", **arguments)
