"""The semantic cache's paraphrase check: is a stored prompt's answer right for a new one?

A nearest neighbour by cosine is not enough: "the advantages of X" and "the disadvantages of X",
"convert A to B" and "convert B to A", "17 x 23" and "17 x 24" embed alike. So each candidate the
index finds (``SemanticIndex``) is checked in three steps:

1. **Vetoes**, the checks that hold whatever the topic: numbers, the arithmetic between them,
   their units, quoted strings, code identifiers, and a negation that is the only difference. A
   pair that differs in any of them asks something else (``veto`` says which and how).
2. **The same words**: two prompts that differ only in case, spacing, English contractions or a
   closing ?, ! or . are one request.
3. **A learned classifier** over the pair decides the rest, from two views of it:

- boosted stumps over what the two texts say word by word (``FEATURES``):

  - ``cosine``: the embedder's similarity of the two prompts;
  - ``jaccard``: shared words over all words; ``fewest_own`` / ``most_own``: how many words only one
    of them has (the side with fewer, the side with more); ``fewest_own_content`` /
    ``most_own_content``: the same, function words (articles, pronouns, auxiliaries, politeness) left
    out: "what's" for "what is" rewords, "Spain" for "France" changes the question;
  - ``disorder``: how far the words both have once come in another order (a reversed relation or
    direction changes the order, not the words);
  - ``numbers``, ``quoted``, ``code``, ``negation``: whether the numbers, the quoted strings, the code
    identifiers, the count of negations differ (the checks that carry over across topics);
  - ``length``: the squared log ratio of their lengths;

- a logistic regression over what the two prompts mean, dimension by dimension (``pair_vector``):
  those features, the cosine of a second, multilingual encoder (``encoder``: the Universal Sentence
  Encoder multilingual v3, whose vectors sit near for a paraphrase in any of 16 languages), and for
  each encoder the element-wise product and absolute difference of the two vectors (which
  dimensions agree, which part ways: the pair classifier of InferSent and sentence-BERT).

The mean of the two log-odds is the words' and vectors' vote: the words vouch for the form of the
request, the vectors for its meaning. Both read each prompt apart; what changes the answer while
keeping every word ("Is every square a rectangle?" / "Is every rectangle a square?") shows only
when the two are read together, so a cross-encoder does that (``extproc.cache.pairs``: MiniLM
with trained adapters, over ``[CLS] query [SEP] stored [SEP]``), and its log-odds joins the vote
(``Stack``: a logistic regression over the two, fitted on votes cross-validated by writer). The
pair's probability is the sigmoid of the result.

Step 2 comes before the model because the pairs it learned from hold no pair that close, and a
stump on the cosine learned that a near miss's cosine is often the highest.

Both parts are trained by ``python -m bench.train_paraphrase`` on this project's own labelled
pairs (``bench/data/paraphrases*.yaml``), never on the blind sets, and shipped as
``paraphrase_model.json`` beside this module, on the pairs the vetoes let through. The probability
must reach the model's own ``threshold``: the one where cross-validation of all three steps, each
writer's pairs decided by a model fitted on the other writers' only, kept precision at 99% for 95%
of sets of writers drawn from the training writers (a new writer's traffic, not the pooled pairs).
Reading a prompt's features costs a few regular expressions (linear in its length) and the second
encoder's forward pass (~2.5 ms, in the embedding thread); checking a pair, tens of microseconds
(word order is compared over its first ``DISORDER_WORDS`` shared words) and, where no veto or the
same words decided, the cross-encoder's forward pass over both prompts (milliseconds, up to 128
tokens).
"""

from __future__ import annotations

import itertools
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from extproc.cjk import CJK
from extproc.stumps import Stump, Stumps, load_stumps, stumps_json

MODEL_PATH = Path(__file__).with_name("paraphrase_model.json")
ENCODER = "multilingual"  # the second encoder, whose vectors the logistic part compares
LOGIT_CAP = math.log(1e9)  # each part's log-odds is bounded: neither outvotes the other alone
# The cross-encoder's vote is bounded tighter (every cross-validated vote was within 7.95 of 0), so
# that a pair the other parts decide by a wide margin needs no forward pass (``ParaphraseModel.accepts``).
CROSS_CAP = 8.0
DISORDER_WORDS = 64  # shared words whose order is compared (2,016 pairs at most)
FEATURES = ("cosine", "jaccard", "fewest_own", "most_own", "fewest_own_content", "most_own_content", "disorder",
            "numbers", "quoted", "code", "negation", "length")
_CJK = CJK
_WORD = re.compile(rf"[{_CJK}]|\d+(?:[.,]\d+)*|[^\W\d_{_CJK}]+")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?")  # "1,000" is 1000
# Operators written full-width, and the minus sign (U+2212), read as ASCII (``_ascii_numbers``)
_ASCII_OPERATORS = str.maketrans("＋－＊／＝＜＞\u2212", "+-*/=<>-")
_OTHER_DIGIT = re.compile(r"(?![0-9])\d")  # a decimal digit of another script (``\d`` is Unicode's Nd)
_CLOSING = ".?!。？！"  # a sentence's end inside a quote ("Translate 'See you tomorrow.'") is not the literal's
_QUOTED = re.compile(r"\"([^\"\n]{1,300})\"|(?<!\w)'([^'\n]{1,300})'(?!\w)|“([^”]{1,300})”|«([^»]{1,300})»"
                     r"|「([^」]{1,300})」|`([^`\n]{1,300})`")
_CODE = re.compile(r"[A-Za-z_]\w*(?:(?:\.|::|->)\w+)+(?:\(\))?|\b[a-z]+[A-Z]\w*|\b\w+_\w+|\b\w+\(\)")
# Negations in the languages the cache meets most; a CJK negation is one character of its own.
_NEGATIONS = frozenset("""not no never without none nothing nobody neither nor cannot ne pas jamais sans aucun
    nein nicht kein keine keinen ohne nie niemals nunca sin ningún ninguna tampoco não nao nem nunca sem non senza
    mai nessun 不 没 無 无 未 别 非 없 안 못""".split())
_NOT = re.compile(r"n['’]t\b|ない|ません|않|없")
_CONTRACTED = re.compile(r"\b(\w+)n['’]t\b")
_EXPANDED = {"can't": "can not", "can’t": "can not", "won't": "will not", "won’t": "will not"}
# Units of measure, time and money, as they are written (a plural's "s" is dropped before lookup).
_UNIT_NAMES = {
    "mm millimeter millimetre": "mm", "cm centimeter centimetre": "cm", "m meter metre metro": "m",
    "km kilometer kilometre kilómetro kilometro": "km", "mi mile milla meile": "mile", "ft foot feet": "ft",
    "in inch inche": "inch", "yd yard": "yard", "mg milligram": "mg", "g gram gramme gramo": "g",
    "kg kilogram kilo": "kg", "lb pound": "lb", "oz ounce": "oz", "t ton tonne": "ton", "ml milliliter": "ml",
    "l liter litre litro": "l", "gal gallon": "gallon", "cup": "cup", "tbsp tablespoon": "tbsp",
    "tsp teaspoon": "tsp", "c celsius": "celsius", "f fahrenheit": "fahrenheit", "k kelvin": "kelvin",
    "sec second seconde segundo sekunde": "second", "min minute minuto": "minute", "h hr hour heure hora stunde":
    "hour", "day jour día dia tag": "day", "week semaine semana woche": "week", "month mois mes monat": "month",
    "yr year an año ano jahr": "year", "kb kilobyte": "kb", "mb megabyte": "mb", "gb gigabyte": "gb",
    "tb terabyte": "tb", "usd dollar $": "usd", "eur euro €": "eur", "gbp £": "gbp", "jpy yen ¥": "jpy",
    "cny rmb yuan 元 人民币": "cny", "percent % pct": "percent", "mph": "mph", "kph kmh": "kph",
    "公里 千米": "km", "英里": "mile", "公斤 千克": "kg", "美元": "usd", "欧元": "eur", "摄氏": "celsius",
    "华氏": "fahrenheit", "小时": "hour", "分钟": "minute",
}
_UNITS = {name: unit for names, unit in _UNIT_NAMES.items() for name in names.split()}
# A unit is one that qualifies a number: "5 km", "5km", "20 %", "$5", "5 美元"; elsewhere "in", "an"
# or "m" are words.
_UNIT_TOKEN = re.compile(r"\d(?:[.,]?\d)*\s?(°?[^\W\d_]+|[$€£¥%]|公里|千米|英里|公斤|千克|美元|欧元|人民币|元)"
                         r"|([$€£¥])\s?\d")
# Arithmetic between numbers or terms: "2x + 3" is not "2x - 3".
_OPERATOR = re.compile(r"(?<=[\w\s)])\s*([-+*/×÷^=<>]|\*\*)\s*(?=[\w(])")
# Words that carry no request of their own (no negation, task verb or question word among them).
_FUNCTION_WORDS = frozenset("""a an the this that these those is are was were be been being am do does did have has
    had i me my we us our you your it its they them their he him his she her of in on at to for from by with about
    as than so and or but if can could would should will may might must please kindly just hey hi hello thanks
    thank there here some any really very s t m d ll re ve le la les l un une des de du d et ou est ce c que qu je j
    tu il nous vous moi te mon ma mes el los las una del y por para yo mi se lo der die das den dem ein eine einen
    und oder ist ich du mir mich mein es zu von mit für bitte o os as um uma da e é eu gli di che per con""".split())


@dataclass(frozen=True, slots=True)
class PromptFeatures:
    """What the check reads of one prompt, once (kept with it in the index)."""

    words: tuple[str, ...]
    digits: frozenset[str]  # numbers written in digits
    operators: frozenset[str]  # arithmetic between numbers or terms (in a text with digits)
    units: frozenset[str]  # units of its numbers
    quoted: frozenset[str]  # lower-cased, spacing collapsed
    quoted_as_written: frozenset[str]  # ... in their own case
    code: frozenset[str]
    negations: int
    chars: int
    collapsed: str  # lower-cased, spacing collapsed
    normalised: str  # ... English contractions written out and a closing ?, ! or . dropped
    affirmed: frozenset[str]  # its words with "n't" written out ("doesn't": "does", "not")


def read(text: str) -> PromptFeatures:
    """``text``'s words (lower-cased), numbers, quoted strings, code identifiers and negations."""
    lower = text.lower()
    words = tuple(_WORD.findall(lower))
    as_written = frozenset(q.rstrip(_CLOSING) or q for groups in _QUOTED.findall(text)
                           if (q := " ".join("".join(groups).split())))
    quoted = frozenset(q.lower() for q in as_written)
    negations = sum(word in _NEGATIONS for word in words) + len(_NOT.findall(lower))
    numeric = _ascii_numbers(text)
    units = frozenset(unit for after, before in _UNIT_TOKEN.findall(numeric.lower())
                      if (unit := _unit(after.lstrip("°") or before)))
    operators = frozenset(_OPERATOR.findall(numeric)) if _has_digit(numeric) else frozenset()
    digits = frozenset(n.replace(",", "") if _THOUSANDS.fullmatch(n) else n for n in _NUMBER.findall(numeric))
    not_written_out = _CONTRACTED.sub(lambda m: _EXPANDED.get(m[0], m[1] + " not"), lower)
    affirmed = frozenset(_WORD.findall(not_written_out))
    collapsed = " ".join(lower.split())
    return PromptFeatures(words, digits, operators, units, quoted, as_written,
                          frozenset(_CODE.findall(text)), negations, len(text), collapsed,
                          " ".join(_written_out(not_written_out).split()).rstrip(_CLOSING + " "), affirmed)


def _ascii_numbers(text: str) -> str:
    """``text`` with its digits of other scripts (full-width "５", Arabic-Indic "٢٠٢٧": Unicode
    decimals) and full-width operators written in ASCII: "５つ" and "5つ" state one number."""
    if text.isascii():
        return text
    return _OTHER_DIGIT.sub(lambda m: str(unicodedata.decimal(m[0])), text.translate(_ASCII_OPERATORS))


# The English contractions other than "n't" (``_CONTRACTED``, written out first) and what they
# stand for ("what's" / "what is": one request). A "'s" is written out only after the words where
# it cannot be a possessive; "'d" (had or would) is kept.
_CONTRACTIONS = ((re.compile(r"\bcannot\b"), "can not"), (re.compile(r"\b(\w+)['’]re\b"), r"\1 are"),
                 (re.compile(r"\b(\w+)['’]ve\b"), r"\1 have"), (re.compile(r"\b(\w+)['’]ll\b"), r"\1 will"),
                 (re.compile(r"\bi['’]m\b"), "i am"), (re.compile(r"\blet['’]s\b"), "let us"),
                 (re.compile(r"\b(what|where|who|how|when|why|which|it|that|there|here|he|she)['’]s\b"), r"\1 is"))


def _written_out(lower: str) -> str:
    """``lower`` with its "n't" already written out: the other contractions written out too."""
    for contraction, meaning in _CONTRACTIONS:
        lower = contraction.sub(meaning, lower)
    return lower


def _unit(token: str) -> str | None:
    return _UNITS.get(token) or (_UNITS.get(token[:-1]) if token.endswith("s") else None)


def _has_digit(text: str) -> bool:
    return any(c.isdigit() for c in text)


def veto(a: PromptFeatures, b: PromptFeatures) -> str | None:
    """What makes the two prompts ask different things whatever else they share (None: nothing).

    Each kind is compared only where both prompts state some ("three tips" and "3 tips", "Node.js"
    and "nodejs" are not refused for it): numbers in digits (of any script; "1,000" is 1000),
    operators between them, units of the numbers, code identifiers. A quoted string (less a closing
    . ? or !: "Translate 'See you soon.'") must appear in the other prompt, quoted or not, and
    where both quote it, in the same case (a literal: 'hello' is not 'Hello', `-p` is not `-P`). A
    negation counts where it is the difference: the prompts' other words are the same but one."""
    for kind, first, second in (("numbers", a.digits, b.digits), ("arithmetic", a.operators, b.operators),
                                ("units", a.units, b.units), ("code", a.code, b.code)):
        if first and second and first != second:
            return kind
    if any(q not in b.collapsed for q in a.quoted) or any(q not in a.collapsed for q in b.quoted):
        return "quoted"
    if _case_differs(a.quoted_as_written, b.quoted_as_written):
        return "quoted"
    if a.negations != b.negations and len((a.affirmed - _NEGATIONS) ^ (b.affirmed - _NEGATIONS)) <= 1:
        return "negation"
    return None


def same_words(a: PromptFeatures, b: PromptFeatures) -> bool:
    """The same text but for case, spacing, English contractions ("what's" / "what is", "don't" /
    "do not") and a closing ?, ! or .: one request ("C#" and "C++", "+" and "-" are not the same
    words)."""
    return a.normalised == b.normalised


def _case_differs(first: frozenset[str], second: frozenset[str]) -> bool:
    """Whether a string both quote is written in another case in each (none of the ways one
    writes it is the other's)."""
    if not first or not second:
        return False
    cases: dict[str, tuple[set[str], set[str]]] = {}
    for side, strings in enumerate((first, second)):
        for q in strings:
            cases.setdefault(q.lower(), (set(), set()))[side].add(q)
    return any(a and b and not a & b for a, b in cases.values())


def pair_features(cosine: float, a: PromptFeatures, b: PromptFeatures) -> list[float]:
    """The classifier's inputs for one pair, in ``FEATURES`` order."""
    first, second = set(a.words), set(b.words)
    shared = first & second
    only_a, only_b = first - second, second - first
    content_a, content_b = len(only_a - _FUNCTION_WORDS), len(only_b - _FUNCTION_WORDS)
    return [cosine, len(shared) / max(1, len(first | second)), float(min(len(only_a), len(only_b))),
            float(max(len(only_a), len(only_b))), float(min(content_a, content_b)), float(max(content_a, content_b)),
            _disorder(a.words, b.words), float(a.digits != b.digits), float(a.quoted != b.quoted),
            float(a.code != b.code), float(a.negations != b.negations),
            math.log((a.chars + 1) / (b.chars + 1)) ** 2]


def _disorder(first: tuple[str, ...], second: tuple[str, ...]) -> float:
    """The share of pairs of once-used shared words whose order differs (0: the same order), over
    the first ``DISORDER_WORDS`` of them: a long prompt costs no more than a short one."""
    counts_a, counts_b = Counter(first), Counter(second)
    once_b = {w: i for i, w in enumerate(second) if counts_b[w] == 1}
    shared = [(i, once_b[w]) for i, w in enumerate(first) if counts_a[w] == 1 and w in once_b][:DISORDER_WORDS]
    if len(shared) < 2:
        return 0.0
    pairs = len(shared) * (len(shared) - 1) // 2
    swapped = sum(1 for (_, x), (_, y) in itertools.combinations(shared, 2) if x > y)  # first's order is ascending
    return swapped / pairs


def pair_vector(features: Sequence[float], first: np.ndarray, second: np.ndarray, first_meaning: np.ndarray,
                second_meaning: np.ndarray) -> np.ndarray:
    """The logistic part's inputs for one pair: the stumps' ``features``, the second encoder's
    cosine, then for that encoder and for the embedder the absolute difference and the product of
    the two prompts' vectors (``*_meaning``: the second encoder's; the others, the embedder's)."""
    return np.concatenate([np.asarray(features, dtype=np.float32), [float(first_meaning @ second_meaning)],
                           np.abs(first_meaning - second_meaning), first_meaning * second_meaning,
                           np.abs(first - second), first * second])


def _sigmoid(log_odds: float) -> float:
    return 1.0 / (1.0 + math.exp(-log_odds))


def _capped(log_odds: float) -> float:
    return min(LOGIT_CAP, max(-LOGIT_CAP, log_odds))


@dataclass(frozen=True, slots=True)
class Linear:
    """A logistic regression's weights (standardisation folded in) and bias."""

    weights: np.ndarray
    bias: float

    def log_odds(self, x: np.ndarray) -> np.ndarray | float:
        """The log-odds of one input vector, or of a (rows, inputs) matrix."""
        return x @ self.weights + self.bias

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Linear) and self.bias == other.bias
                and np.array_equal(self.weights, other.weights))

    def __hash__(self) -> int:
        return hash((self.bias, self.weights.size))


@dataclass(frozen=True, slots=True)
class Stack:
    """How the cross-encoder's vote joins the others': ``words_and_vectors`` times their log-odds
    (the mean of the stumps' and the logistic part's) plus ``cross`` times the cross-encoder's,
    plus ``bias`` (a logistic regression over the two votes, fitted on cross-validated ones)."""

    words_and_vectors: float
    cross: float
    bias: float

    def join(self, words_and_vectors: float | np.ndarray, cross: float | np.ndarray) -> float | np.ndarray:
        """The joined log-odds (of one pair, or of arrays of them), the cross-encoder's vote capped
        at ``CROSS_CAP`` either way."""
        return self.words_and_vectors * words_and_vectors + self.bias + self.cross * np.clip(cross, -CROSS_CAP,
                                                                                             CROSS_CAP)


@dataclass(frozen=True, slots=True)
class ParaphraseModel:
    """Boosted stumps over the words (each (feature, split, value if <= split, value if above) adds
    to the log-odds) and, where ``linear`` is given, a logistic regression over the two encoders'
    vectors: the pair's log-odds is the mean of the two."""

    stumps: tuple[Stump, ...]
    bias: float
    threshold: float  # the probability a pair must reach to be served as the same request
    embedder: str = "minilm"  # whose cosines it was trained on: valid with that embedder only
    min_cosine: float = 0.5  # no pair below it was served in cross-validation: the index's candidate floor
    linear: Linear | None = None  # over ``pair_vector``; None: the stumps alone
    encoder: str | None = None  # the second encoder ``linear`` reads (``ENCODER``), where it has one
    # (cross-validated precision, the threshold that held it), for operators who want another trade-off
    operating_points: tuple[tuple[float, float], ...] = ()
    stack: Stack | None = None  # where the cross-encoder (``extproc.cache.pairs``) votes too
    # No pair whose second encoder's cosine is below it is served (but the same words): 98% of the
    # training paraphrases are above it. The model's parts were fitted on paraphrases and near
    # misses, never on two unrelated prompts, and read some of those as heavy rewordings ("How do
    # you quit Vim?" / "how to undo the last git commit"): in a partition of many prompts, where
    # unrelated candidates pass the cosine floor, that served wrong answers.
    min_meaning: float = 0.0
    _model: Stumps = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_model", Stumps(self.stumps, self.bias))

    def log_odds(self, features: Sequence[float], pair: np.ndarray | None = None) -> float:
        """The words' and vectors' vote: the stumps' log-odds and the logistic part's (``pair``:
        the ``pair_vector``, needed where the model has one), each capped at ``LOGIT_CAP`` either
        way, averaged (the stumps' alone without the other)."""
        log_odds = _capped(self._model.log_odds_one(list(features)))
        if self.linear is not None:
            if pair is None:
                raise ValueError("this model reads the pair's vectors too (pair_vector)")
            log_odds = (log_odds + _capped(float(self.linear.log_odds(pair)))) / 2
        return log_odds

    def log_odds_many(self, x: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        """Each pair's ``log_odds`` (rows of ``pair_features`` and of their ``pair_vector``), one
        at a time: training's cross-validation scores pairs as a lookup does."""
        return np.array([self.log_odds(row, pair) for row, pair in zip(x, pairs, strict=True)])

    def probability(self, features: Sequence[float], pair: np.ndarray | None = None,
                    cross: float | None = None) -> float:
        """The probability that the pair asks for the same answer: ``log_odds``, joined by the
        cross-encoder's log-odds (``cross``, needed where the model has a ``stack``)."""
        log_odds = self.log_odds(features, pair)
        if self.stack is not None:
            if cross is None:
                raise ValueError("this model reads the cross-encoder's vote too (extproc.cache.pairs)")
            log_odds = float(self.stack.join(log_odds, cross))
        return _sigmoid(log_odds)

    def same(self, features: Sequence[float], pair: np.ndarray | None = None, cross: float | None = None) -> bool:
        """Whether the pair's features say it is one request."""
        return self.probability(features, pair, cross) >= self.threshold

    def accepts(self, cosine: float, a: PromptFeatures, b: PromptFeatures,
                vectors: tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None] | None = None,
                cross: Callable[[], float] | None = None) -> bool:
        """Whether ``b``'s stored answer is served for ``a``: no veto, and the same words or (the
        second encoder's cosine at least ``min_meaning``) the model's yes. ``vectors``: ``a``'s and
        ``b``'s embedder vectors, then their second encoder's (a model with a logistic part or a
        floor refuses a pair without them); ``cross``: the cross-encoder's vote on (``a``, ``b``),
        asked only where it can change the answer (a model with a ``stack`` refuses such a pair
        without it)."""
        if veto(a, b) is not None:
            return False
        if same_words(a, b):
            return True
        features = pair_features(cosine, a, b)
        pair = None
        if self.linear is not None or self.min_meaning > 0:
            if vectors is None or vectors[2] is None or vectors[3] is None:
                return False
            first, second = vectors[2], vectors[3]
            if float(first @ second) < self.min_meaning:  # unrelated in meaning, whatever else they share
                return False
            if self.linear is not None:
                pair = pair_vector(features, vectors[0], vectors[1], first, second)
        if self.stack is None:
            return self.same(features, pair)
        # The cross-encoder can move the vote by at most ``CROSS_CAP`` times its weight: outside
        # that margin of the threshold the other parts decide, and its forward pass is spared.
        others = float(self.stack.join(self.log_odds(features, pair), 0.0))
        margin = abs(self.stack.cross) * CROSS_CAP
        if _sigmoid(others - margin) >= self.threshold:
            return True
        if _sigmoid(others + margin) < self.threshold or cross is None:
            return False
        return self.same(features, pair, cross())

    def at_precision(self, precision: float) -> ParaphraseModel:
        """The model with the threshold that held ``precision`` in cross-validation (``ValueError``
        if it has no such operating point)."""
        for held, threshold in self.operating_points:
            if held == precision:
                return replace(self, threshold=threshold)
        raise ValueError(f"the paraphrase model has no operating point at precision {precision} "
                         f"(it has {', '.join(str(p) for p, _ in self.operating_points) or 'none'})")

    def to_json(self, **about: object) -> str:
        """The model as ``MODEL_PATH`` keeps it, with ``about`` (how it was trained and measured)."""
        if self.operating_points:
            about = {"operating_points": [{"precision": p, "threshold": t} for p, t in self.operating_points],
                     **about}
        linear = {} if self.linear is None else {
            "encoder": self.encoder,
            "linear": {"bias": self.linear.bias, "weights": [float(f"{w:.7g}") for w in self.linear.weights]}}
        if self.stack is not None:
            linear["stack"] = {"words_and_vectors": self.stack.words_and_vectors, "cross": self.stack.cross,
                               "bias": self.stack.bias}
        return stumps_json(FEATURES, self.stumps, self.bias, embedder=self.embedder, threshold=self.threshold,
                           min_cosine=self.min_cosine, min_meaning=self.min_meaning, **linear, **about)

    @classmethod
    def load(cls, path: Path = MODEL_PATH) -> ParaphraseModel:
        """The shipped model (``ValueError`` if it was trained on other features)."""
        data, trained, bias = load_stumps(path, FEATURES)
        linear, stack = data.get("linear"), data.get("stack")
        return cls(trained, bias, float(data["threshold"]), str(data["embedder"]), float(data["min_cosine"]),
                   None if linear is None else Linear(np.array(linear["weights"], dtype=np.float32),
                                                      float(linear["bias"])),
                   data.get("encoder"),
                   tuple((float(p["precision"]), float(p["threshold"])) for p in data.get("operating_points", ())),
                   None if stack is None else Stack(float(stack["words_and_vectors"]), float(stack["cross"]),
                                                    float(stack["bias"])),
                   float(data.get("min_meaning", 0.0)))
