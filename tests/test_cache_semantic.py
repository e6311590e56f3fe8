"""The semantic cache's index (partitions, capacity, threshold, candidates) and its guard, one
table of examples per rule. Lexical or hand-made vectors only: no model is loaded."""

from __future__ import annotations

import numpy as np
import pytest

from extproc.cache.semantic import Match, SemanticIndex, disagreement, facts
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
    index = SemanticIndex(HashingEmbedder(), threshold=0.5)
    assert index.match("", "What is the capital of Canada?") is None
    assert index.size("") == 0
    index.add("acme", "What is the capital of Canada?", key(1))
    assert index.match("globex", "What is the capital of Canada?") is None  # a partition never seen


def test_same_prompt_matches_with_its_key_and_text() -> None:
    index = SemanticIndex(HashingEmbedder(), threshold=0.5)
    index.add("", "How do I reset my password?", key(1))
    found = index.match("", "how do I reset my password")  # case and punctuation only
    assert found == Match(key(1), found.score, "How do I reset my password?")
    assert found.score > 0.95


def test_tenant_partitions_never_share_prompts() -> None:
    index = SemanticIndex(HashingEmbedder(), threshold=0.5)
    index.add("acme", "Summarize our refund policy.", key(1))
    assert index.match("globex", "Summarize our refund policy.") is None
    assert index.match("", "Summarize our refund policy.") is None  # "" is the shared partition, not a wildcard
    index.add("globex", "Summarize our refund policy.", key(2))
    assert index.match("acme", "Summarize our refund policy.").key == key(1)
    assert index.match("globex", "Summarize our refund policy.").key == key(2)


def test_capacity_evicts_the_oldest_prompt() -> None:
    index = SemanticIndex(HashingEmbedder(), threshold=0.9, capacity=3)
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
    index = SemanticIndex(embedder, threshold=threshold)
    index.add("", "Name a prime number.", key(1))
    found = index.match("", "Give me a prime number.")  # cosine 0.8
    assert (found is not None) is hit
    if hit:
        assert found.score == pytest.approx(0.8)


def test_guard_refuses_a_near_miss_that_cosine_accepts() -> None:
    same_vector = [1.0, 0.0]
    embedder = TableEmbedder({"What is 17 times 23?": same_vector, "What is 17 times 24?": same_vector})
    guarded = SemanticIndex(embedder, threshold=0.9)
    bare = SemanticIndex(embedder, threshold=0.9, guard=False)
    for index in (guarded, bare):
        index.add("", "What is 17 times 23?", key(1))
    assert guarded.match("", "What is 17 times 24?") is None
    assert bare.match("", "What is 17 times 24?").score == pytest.approx(1.0)  # cosine alone: a false hit
    assert guarded.match("", bare.prepare("What is 17 times 24?")) is None  # prepared without facts: read now


def test_the_best_prompt_the_guard_accepts_wins() -> None:
    embedder = TableEmbedder({
        "What are the advantages of Rust?": [1.0, 0.0, 0.0],  # nearest, but the opposite question
        "Why should I use Rust, what are its strengths?": [0.9, 0.43589, 0.0],
        "What are the disadvantages of Rust?": [0.99, 0.14107, 0.0],
    })
    index = SemanticIndex(embedder, threshold=0.8)
    index.add("", "What are the advantages of Rust?", key(1))
    index.add("", "What are the disadvantages of Rust?", key(2))
    assert index.match("", "What are the disadvantages of Rust?").key == key(2)
    index = SemanticIndex(embedder, threshold=0.8)
    index.add("", "What are the disadvantages of Rust?", key(2))
    index.add("", "Why should I use Rust, what are its strengths?", key(3))
    found = index.match("", "What are the advantages of Rust?")
    assert found.key == key(3)  # "disadvantages" scores higher but the guard refuses it


def test_a_prepared_prompt_is_embedded_once_for_match_and_add() -> None:
    embedder = TableEmbedder({"Explain DNS.": [1.0, 0.0]})
    index = SemanticIndex(embedder, threshold=0.9)
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
        SemanticIndex(HashingEmbedder(), **arguments)


# -- the guard: which rule refuses which pair (None: accepted) ---------------------------------------

GUARD = [
    # numbers: digits, number words, units, operators
    ("What is 17 times 23?", "What is 17 times 24?", "numbers"),
    ("What is 17 times 23?", "Calculate 17 * 23.", None),  # the same operation, in a sign
    ("What is 17 times 23?", "What is 17 plus 23?", "numbers"),
    ("Explain photosynthesis like I'm five.", "Explain photosynthesis like I am 5 years old.", None),
    ("Convert 100 degrees Fahrenheit to Celsius.", "What is 100°F in Celsius?", None),
    ("How long is 5 km?", "How long is 5 miles?", "numbers"),  # a unit on both sides, different
    ("List the first three planets.", "List the first four planets.", "numbers"),
    ("When did World War II end?", "When did the Second World War end?", None),  # Roman numeral, ordinal
    ("Summarize it in one sentence.", "Summarize it in a sentence.", None),  # "one" is also "a"
    ("Give me a weekly workout plan for runners.", "Give me a monthly workout plan for runners.", "numbers"),
    ("Explain it in under 100 words.", "Explain it using over 100 words.", "numbers"),
    ("我需要三天时间。", "我需要五天时间。", "numbers"),  # Chinese numerals before a measure word
    # polarity: negations, antonym families, negating prefixes
    ("Is it safe to eat raw eggs?", "Is it not safe to eat raw eggs?", "polarity"),
    ("What are the advantages of remote work?", "What are the disadvantages of remote work?", "polarity"),
    ("Which foods increase cholesterol levels?", "Which foods lower your cholesterol?", "polarity"),
    ("When is it legal to record a call?", "When is it illegal to record a call?", "polarity"),
    ("I forgot my password, how do I reset it?", "How can I reset my password? I can't remember it.", None),
    ("Ist Kaffee gesund?", "Ist Kaffee ungesund?", "polarity"),
    ("喝咖啡对身体好吗？", "喝咖啡对身体不好吗？", "polarity"),
    # names: capitalised words, identifiers, quotes, spelt-out acronyms
    ("What is the capital of Peru?", "What is the capital of Chile?", "names"),
    ("What does os.path.join do?", "What does os.path.split do?", "names"),
    ("Translate 'thank you' into Spanish.", "Translate 'excuse me' into Spanish.", "names"),
    ("How do I read a JSON file in Node.js?", "how to read a json file in nodejs", None),
    ("What is the population of the US?", "What's the population of the United States?", None),
    # form: formats, layouts, genres, audiences
    ("Give me the planets as a table.", "Give me the planets as JSON.", "form"),
    ("Write a haiku about autumn.", "Write a limerick about autumn.", "form"),
    ("Explain black holes to a child.", "Explain black holes to an expert.", "form"),
    # direction: what is converted to what
    ("Translate this from English to French: chat", "Translate this from French to English: chat", "direction"),
    ("Convert this JSON to YAML.", "Convert this YAML to JSON.", "direction"),
    ("Write an email from the tenant to the landlord.", "Write an email from the landlord to the tenant.",
     "direction"),
    ("Is Paris bigger than London?", "Is London bigger than Paris?", "direction"),
    # task: both name an operation on the same input, not the same one
    ("Summarize this: the cat sat on the mat.", "Translate this: the cat sat on the mat.", "task"),
    # question: what each question asks for (who, when, where, why, how many, how), from its first word
    ("Who painted the Sistine Chapel ceiling?", "When was the Sistine Chapel ceiling painted?", "question"),
    ("¿Dónde nació Cervantes?", "¿Cuándo nació Cervantes?", "question"),
    ("How does a heat pump work?", "Why does a heat pump work in winter?", "question"),
    ("谁发明了电话？", "电话是什么时候发明的？", "question"),
    # an implicit negative: "avoid X" is "do not X"
    ("Which foods are recommended during pregnancy?", "Which foods should be avoided during pregnancy?",
     "polarity"),
    # the currency after whose it is ("US dollars"), as the unit and as the target
    ("Convert 100 euros to US dollars.", "Convert 100 US dollars to euros.", "numbers"),
    ("How much is 20 Hong Kong dollars in euros?", "Convert 20 HK dollars to EUR", None),
    # edit: the same words but one short stretch with another meaning
    ("What is the time complexity of quicksort?", "What is the space complexity of quicksort?", "edit"),
    ("What's the square root of 144?", "What is the square root of 144", None),  # function words only
    ("What is 10% of 50?", "What is 10 percent of 50?", None),  # the same unit, in a sign
    # paraphrases of the whole request: no rule objects
    ("How do I remove duplicates from a list in Python?", "what's the easiest way to dedupe a python list", None),
    ("Who wrote Pride and Prejudice?", "who is the author of pride and prejudice", None),
    ("In CSS, how can I center a div both vertically and horizontally?",
     "How do I center a div horizontally and vertically in CSS?", None),
]


@pytest.mark.parametrize(("a", "b", "rule"), GUARD, ids=[f"{rule or 'accepted'}: {a[:40]}" for a, _, rule in GUARD])
def test_guard_rules(a: str, b: str, rule: str | None) -> None:
    assert disagreement(facts(a), facts(b)) == rule
    assert disagreement(facts(b), facts(a)) == rule  # symmetric


@pytest.mark.parametrize(("text", "asks"), [
    ("What year did the Berlin Wall fall?", {"time"}),  # "what year" is a time
    ("What happens when you heat ice?", set()),  # "when" inside a sentence: a conjunction
    ("How many moons does Mars have? And why?", {"quantity", "reason"}),
    ("Patient question: Where is the pharmacy?", {"place"}),
    ("¿Por qué el cielo es azul?", {"reason"}),
    ("Wie lange dauert der Flug?", {"duration"}),
])
def test_what_questions_ask_for(text: str, asks: set[str]) -> None:
    assert facts(text).asks == asks


def test_facts_of_a_prompt() -> None:
    read = facts("Convert 2.5 km to miles, then add 3 and 4 without rounding.")
    assert read.numbers == {"2.5", "3", "4"}
    assert read.units["2.5"] == {"km"}
    assert read.negations == 1  # "without"
    assert read.things == {"km", "mile"}
    assert read.targets == {"mile"} and read.sources == {"km"}  # "to miles": km is where it comes from
