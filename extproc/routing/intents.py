"""Semantic intents: routes described by example utterances (and a one-line description), matched
by cosine similarity of embeddings. Pure (numpy): no I/O beyond what the embedder does.

``IntentIndex`` holds every example's unit vector. A prompt's score for an intent is, with
``scoring="centroid"`` (the multilingual embedder's default), its cosine similarity to the
intent's prototype: the mean of its examples' vectors (the description counts as one more
example), learned from the config the user wrote; with ``"nearest"`` (the other embedders'
default: their thresholds were measured so), to its nearest example (``top_k`` > 1: the mean over
its k nearest). On configs of 6-8 examples an intent the prototype generalizes better than the
nearest example, which a new prompt resembles only when it shares that example's topic (this
project's data, bench/data/intents.yaml cut to 7 examples an intent, multilingual embedder: 92.9%
against 89.9%). The best intent wins if its score reaches the threshold and beats the runner-up
intent's by the margin, and (centroid scoring, ``background``) the prompt is not more like general
traffic than like that intent; otherwise there is no intent and the caller routes to its default (a
prompt between two intents is as uncertain as one near none).

That is the ``threshold`` decision. The ``learned`` one (the default with the multilingual embedder,
``intent_model.json``) first centres every vector on general traffic's mean (the background's: what
all prompts share says nothing of their intent: on the training configs the nearest prototype is
the right intent for 86.6% of in-domain prompts, against 85.7%), then reads the similarities
relative to the config: for each intent, the prompt's similarity to its prototype and to its
nearest example, how far above the other intents and the background, and how it compares with the
intent's own examples held out one at a time (``IntentStats``: a tight intent needs more than a
loose one). Boosted stumps (``extproc.stumps``) turn those into the probability that the prompt is
that intent's; the likeliest intent wins if its probability reaches the model's bar
(``confidence`` overrides it). The model was
trained by ``python -m bench.train_routing`` on configs written apart from this code
(``bench/data/routing_train/``), never on the blind ones, so it learned how a user's own small
config behaves rather than one config's thresholds.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from extproc.routing.embedders import Embedder
from extproc.stumps import Stump, Stumps, load_stumps, stumps_json

DEFAULT_MARGIN = 0.02
# The background (centroid scoring): general prompts (background.txt) whose cosine to every
# intent's prototype is under BACKGROUND_CLEAN stand for traffic of no intent; a prompt whose best
# intent scores less than BACKGROUND_MARGIN above the mean of its BACKGROUND_K nearest of them takes
# the default route. Chosen on this project's own data (bench/data/intents.yaml cut to 7 examples
# and a description an intent, 8 draws): out-of-domain prompts kept at the default 84.4% -> 96.2%,
# in-domain 94.5% -> 92.8%, accuracy 92.9% -> 93.3%.
BACKGROUND_PATH = Path(__file__).with_name("background.txt")
BACKGROUND_CLEAN = 0.3
BACKGROUND_K = 3
BACKGROUND_MARGIN = -0.1
Scoring = Literal["centroid", "nearest"]
Decision = Literal["learned", "threshold"]
MODEL_PATH = Path(__file__).with_name("intent_model.json")
# What the learned decision reads of one (prompt, intent), in this order (``intent_features``).
FEATURES = ("score", "nearest", "over_runner_up", "over_mean", "over_background", "self_z", "rank", "intents")
NO_BACKGROUND = -1.0  # the background score when there is none (fewer than BACKGROUND_K prompts)


@dataclass(frozen=True, slots=True)
class Intent:
    """A route described by examples: requests like them go to ``model`` (in ``pool``)."""

    name: str
    examples: tuple[str, ...]
    model: str
    pool: str
    description: str = ""  # one line saying what the intent covers: embedded as one more example


@dataclass(frozen=True, slots=True)
class IntentMatch:
    """The nearest intent and how sure: ``intent`` is None when under the threshold or the margin."""

    intent: Intent | None
    score: float  # the best intent's score: cosine similarity to its prototype (or nearest examples)
    runner_up: float  # the same for the next-best intent (-1.0 with a single intent)
    best: str  # the best intent's name, even when refused ("" without intents)
    probability: float | None = None  # the learned decision's, for the best intent (None: threshold decision)


@dataclass(frozen=True, slots=True)
class IntentStats:
    """How an intent's own examples sit around its prototype, each held out in turn: the mean and
    spread (at least ``floor``) of their similarity to the prototype of the rest."""

    mean: np.ndarray  # (intents,)
    spread: np.ndarray  # (intents,)

    floor = 0.02  # an intent of near-identical examples must not make every gap look huge

    @classmethod
    def of(cls, vectors: np.ndarray, spans: Sequence[tuple[int, int]]) -> IntentStats:
        """The stats of each intent's rows (``vectors[start:end]``)."""
        means, spreads = [], []
        for start, end in spans:
            rows = vectors[start:end]
            held = [float(rows[k] @ prototype(np.delete(rows, k, 0))) for k in range(len(rows))] \
                if len(rows) > 1 else [1.0]
            means.append(float(np.mean(held)))
            spreads.append(float(np.std(held)) + cls.floor)
        return cls(np.array(means), np.array(spreads))


def intent_features(scores: np.ndarray, nearest: np.ndarray, background: np.ndarray,
                    stats: IntentStats) -> np.ndarray:
    """(texts, intents, len(FEATURES)): what the learned decision reads, from each text's
    ``scores`` (cosine to each prototype), ``nearest`` (to each intent's nearest example), both
    (texts, intents), and ``background`` (texts,)."""
    texts, count = scores.shape
    others = np.where(np.eye(count, dtype=bool)[None], -np.inf, scores[:, None, :])  # [t, i, j]: j != i
    runner_up = others.max(axis=2) if count > 1 else np.full((texts, count), -1.0)
    mean_other = (scores.sum(axis=1, keepdims=True) - scores) / max(1, count - 1)
    rank = np.argsort(np.argsort(-scores, axis=1, kind="stable"), axis=1, kind="stable")
    return np.stack([scores, nearest, scores - runner_up, scores - mean_other, scores - background[:, None],
                     (scores - stats.mean) / stats.spread, rank.astype(float),
                     np.full((texts, count), float(count))], axis=2)


@dataclass(frozen=True, slots=True)
class IntentModel:
    """The learned decision: stumps over ``FEATURES``, and the probability the likeliest intent
    must reach (``threshold``), for vectors of ``embedder`` with centroid scoring."""

    stumps: tuple[Stump, ...]
    bias: float
    threshold: float
    embedder: str
    center: bool = False  # trained on vectors centred on the background's mean (``IntentIndex``)
    _model: Stumps = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_model", Stumps(self.stumps, self.bias))

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """(texts, intents) probabilities from ``intent_features``' output."""
        texts, count, width = features.shape
        return self._model.probability(features.reshape(texts * count, width)).reshape(texts, count)

    def to_json(self, **about: object) -> str:
        """The model as ``MODEL_PATH`` keeps it, with ``about`` (how it was trained and measured)."""
        return stumps_json(FEATURES, self.stumps, self.bias, embedder=self.embedder, threshold=self.threshold,
                              center=self.center, **about)

    @classmethod
    def load(cls, path: Path = MODEL_PATH) -> IntentModel:
        """The shipped model (``ValueError`` if it was trained on other features)."""
        data, trained, bias = load_stumps(path, FEATURES)
        return cls(trained, bias, float(data["threshold"]), str(data["embedder"]), bool(data.get("center")))


@functools.cache
def shipped_model() -> IntentModel:
    """``intent_model.json``, read once."""
    return IntentModel.load()


def learned_decision_for(embedder: str, scoring: Scoring) -> bool:
    """Whether the shipped model applies: it was trained on this embedder's vectors, centroid scoring."""
    return scoring == "centroid" and MODEL_PATH.is_file() and shipped_model().embedder == embedder


def decide_learned(intents: Sequence[Intent], scores: np.ndarray, probabilities: np.ndarray,
                   threshold: float) -> IntentMatch:
    """The match for one prompt from its per-intent ``scores`` and the model's ``probabilities``."""
    if len(intents) == 0:
        return IntentMatch(None, 0.0, -1.0, "")
    # The likeliest intent; of equal probabilities (a stump model's are steps), the most similar one,
    # then the one listed first.
    first = int(np.lexsort((-scores, -probabilities))[0])
    others = np.delete(scores, first)
    top, probability = float(scores[first]), float(probabilities[first])
    return IntentMatch(intents[first] if probability >= threshold else None, round(top, 4),
                       round(float(others.max()), 4) if len(others) else -1.0, intents[first].name,
                       round(probability, 4))


def decide(intents: Sequence[Intent], scores: np.ndarray, threshold: float, margin: float,
           background: float = -math.inf, background_margin: float = 0.0) -> IntentMatch:
    """The match for one prompt from its per-intent ``scores`` (aligned with ``intents``); it must
    also score at least ``background_margin`` above its ``background`` score (its similarity to the
    general prompts nearest it)."""
    if len(intents) == 0:
        return IntentMatch(None, 0.0, -1.0, "")
    order = np.argsort(-scores, kind="stable")  # stable: a tie goes to the intent listed first
    first = int(order[0])
    second = int(order[1]) if len(order) > 1 else None
    top = float(scores[first])
    runner_up = float(scores[second]) if second is not None else -1.0
    sure = top >= threshold and top - runner_up >= margin and top - background >= background_margin
    return IntentMatch(intents[first] if sure else None, round(top, 4), round(runner_up, 4), intents[first].name)


class IntentIndex:
    """Every intent's example vectors, and a bounded LRU cache of prompts already classified
    (``cache_size`` 0: none). ``threshold`` None takes the embedder's own. Safe to share between
    threads; the embedder is called outside the cache's lock."""

    def __init__(self, intents: Sequence[Intent], embedder: Embedder, threshold: float | None = None,
                 margin: float = DEFAULT_MARGIN, cache_size: int = 4096, top_k: int = 1,
                 scoring: Scoring | None = None, background: Sequence[str] = (), decision: Decision | None = None,
                 confidence: float | None = None, model: IntentModel | None = None, center: bool | None = None) -> None:
        self.intents = tuple(intents)
        for intent in self.intents:
            if not intent.examples:
                raise ValueError(f"intent {intent.name!r} has no examples")
        if top_k < 1:
            raise ValueError("top_k must be >= 1")
        self.embedder = embedder
        self.threshold = embedder.threshold if threshold is None else threshold
        self.margin = margin
        self.cache_size = cache_size
        self.top_k = top_k
        self.scoring: Scoring = scoring or scoring_for(embedder.name)
        if decision is None:  # an explicit threshold is the threshold decision's
            decision = "learned" if threshold is None and background and (model is not None or learned_decision_for(
                embedder.name, self.scoring)) else "threshold"
        self.decision: Decision = decision
        self.model: IntentModel | None = None
        if decision == "learned":
            self.model = model or shipped_model()
            if self.scoring != "centroid" or self.model.embedder != embedder.name:
                raise ValueError(f"the learned decision was trained on the {self.model.embedder} embedder's vectors "
                                 f"with centroid scoring, not {embedder.name}'s with {self.scoring}: "
                                 "use decision: threshold")
            if not background:
                raise ValueError("the learned decision reads the background prompts: use decision: threshold")
        self.confidence = confidence if confidence is not None else self.model.threshold if self.model else None
        general = embedder.embed(list(background)) if background and self.intents and self.scoring == "centroid" \
            else np.zeros((0, 0), dtype=np.float32)
        if center is None:
            center = self.model is not None and self.model.center
        # Centred (the learned decision's model says so): general traffic's mean vector taken from
        # every vector, which then measures what sets a prompt apart from the rest.
        self._center = general.mean(axis=0) if center and len(general) else None
        texts = [text for intent in self.intents for text in _texts(intent)]
        self._vectors = self.embed(texts) if texts else np.zeros((0, 0), dtype=np.float32)
        ends = np.cumsum([len(_texts(intent)) for intent in self.intents])
        self._spans = [(int(end) - len(_texts(intent)), int(end))
                       for intent, end in zip(self.intents, ends, strict=True)]
        self._prototypes = np.stack([prototype(self._vectors[start:end]) for start, end in self._spans]) \
            if self.intents else np.zeros((0, 0), dtype=np.float32)
        self._background = self._general(self._view(general))
        self._stats = IntentStats.of(self._vectors, self._spans) if self.model is not None and self.intents else None
        self._cache: OrderedDict[str, IntentMatch] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def vectors(self) -> np.ndarray:
        """Every intent's unit vectors, one row per example (then its description), in intent order."""
        return self._vectors

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Each intent's rows of ``vectors``: (start, end)."""
        return list(self._spans)

    @property
    def prototypes(self) -> np.ndarray:
        """Each intent's prototype: the normalised mean of its rows."""
        return self._prototypes

    def _general(self, vectors: np.ndarray) -> np.ndarray:
        """The background prompts' vectors, less those like one of this config's intents (a general
        set holds some prompts of any domain): used with centroid scoring only."""
        if not len(vectors):
            return np.zeros((0, self._prototypes.shape[1] if self.intents else 0), dtype=np.float32)
        return vectors[(vectors @ self._prototypes.T).max(axis=1) < BACKGROUND_CLEAN]

    def _view(self, vectors: np.ndarray) -> np.ndarray:
        """The embedder's unit vectors as the index compares them: centred, then unit again, if so."""
        if self._center is None or not len(vectors):
            return vectors
        centred = (vectors - self._center).astype(np.float32)
        norms = np.linalg.norm(centred, axis=1, keepdims=True)
        return np.divide(centred, norms, out=np.zeros_like(centred), where=norms > 0)

    def embed(self, texts: list[str]) -> np.ndarray:
        """``texts`` as the index compares them (the embedder's vectors, centred if the index is)."""
        return self._view(self.embedder.embed(texts))

    @property
    def centred(self) -> bool:
        """Whether vectors are compared centred on general traffic's mean."""
        return self._center is not None

    @property
    def background_size(self) -> int:
        """How many general prompts the index compares a prompt with (after those like an intent left)."""
        return len(self._background)

    def scores(self, texts: list[str]) -> np.ndarray:
        """(len(texts), len(intents)): each text's score for each intent (see the module docstring)."""
        if not self.intents:
            return np.zeros((len(texts), 0), dtype=np.float32)
        return self._scores(self.embed(texts))

    def score_rows(self, vector: np.ndarray, rows: np.ndarray) -> float:
        """``vector``'s score for an intent made of ``rows`` (unit vectors), as ``scores`` computes
        an intent's (-1.0 for no rows)."""
        if len(rows) == 0:
            return -1.0
        if self.scoring == "centroid":
            return float(vector @ prototype(rows))
        return float(np.sort(rows @ vector)[-self.top_k:].mean())

    def _background_scores(self, vectors: np.ndarray) -> np.ndarray:
        """Each vector's mean similarity to its ``BACKGROUND_K`` nearest general prompts (-inf: none)."""
        if len(self._background) < BACKGROUND_K:
            return np.full(len(vectors), -np.inf)
        return np.sort(vectors @ self._background.T, axis=1)[:, -BACKGROUND_K:].mean(axis=1)

    def _scores(self, vectors: np.ndarray) -> np.ndarray:
        if self.scoring == "centroid":
            return vectors @ self._prototypes.T  # (texts, intents)
        similarity = vectors @ self._vectors.T  # (texts, examples)
        return np.stack([np.sort(similarity[:, start:end], axis=1)[:, -self.top_k:].mean(axis=1)
                         for start, end in self._spans], axis=1)

    def features(self, vectors: np.ndarray) -> np.ndarray:
        """(texts, intents, len(FEATURES)): what the learned decision reads of each vector (unit rows)."""
        stats = self._stats or IntentStats.of(self._vectors, self._spans)
        similarity = vectors @ self._vectors.T  # (texts, examples)
        nearest = np.stack([similarity[:, start:end].max(axis=1) for start, end in self._spans], axis=1)
        general = self._background_scores(vectors)
        return intent_features(vectors @ self._prototypes.T, nearest,
                               np.where(np.isfinite(general), general, NO_BACKGROUND), stats)

    def decide_rows(self, vector: np.ndarray, rows: Sequence[np.ndarray]) -> IntentMatch:
        """``vector``'s match, by the index's decision, were each intent made of ``rows[i]`` (unit
        vectors) instead of its own: ``llmgw route --calibrate`` holds examples out so."""
        scores = np.array([self.score_rows(vector, r) for r in rows], dtype=np.float32)
        general = float(self._background_scores(vector[None])[0])
        if self.model is None or self.confidence is None or self._stats is None:
            return decide(self.intents, scores, self.threshold, self.margin, general, BACKGROUND_MARGIN)
        nearest = np.array([float((r @ vector).max()) if len(r) else -1.0 for r in rows])
        features = intent_features(scores[None], nearest[None],
                                   np.array([general if math.isfinite(general) else NO_BACKGROUND]), self._stats)
        return decide_learned(self.intents, scores, self.model.probabilities(features)[0], self.confidence)

    def _decide(self, vectors: np.ndarray) -> list[IntentMatch]:
        """The match of each vector, by the index's decision."""
        scores = self._scores(vectors)
        if self.model is not None and self.confidence is not None:
            probabilities = self.model.probabilities(self.features(vectors))
            return [decide_learned(self.intents, row, chances, self.confidence)
                    for row, chances in zip(scores, probabilities, strict=True)]
        general = self._background_scores(vectors)
        return [decide(self.intents, row, self.threshold, self.margin, float(bg), BACKGROUND_MARGIN)
                for row, bg in zip(scores, general, strict=True)]

    def lookup(self, text: str) -> IntentMatch | None:
        """The cached match of ``text``, or None (then ``classify`` must embed it)."""
        with self._lock:
            match = self._cache.get(text)
            if match is not None:
                self._cache.move_to_end(text)
            return match

    def classify(self, text: str) -> IntentMatch:
        """The intent of ``text`` (cached by text)."""
        return self.classify_many([text])[0]

    def classify_many(self, texts: list[str]) -> list[IntentMatch]:
        """The intent of each text, embedding the ones not cached in one batch."""
        found: dict[str, IntentMatch] = {}
        with self._lock:
            for text in texts:
                match = self._cache.get(text)
                if match is not None:
                    self._cache.move_to_end(text)
                    found[text] = match
        missing = list(dict.fromkeys(text for text in texts if text not in found))
        if missing and not self.intents:
            found.update({text: IntentMatch(None, 0.0, -1.0, "") for text in missing})
        elif missing:
            fresh = dict(zip(missing, self._decide(self.embed(missing)), strict=True))
            found.update(fresh)
            self._remember(fresh)
        return [found[text] for text in texts]

    def _remember(self, matches: dict[str, IntentMatch]) -> None:
        if self.cache_size <= 0:
            return
        with self._lock:
            for text, match in matches.items():
                self._cache[text] = match
                self._cache.move_to_end(text)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def cache_clear(self) -> None:
        """Forget every cached match."""
        with self._lock:
            self._cache.clear()

    @property
    def cached(self) -> int:
        """How many prompts the cache holds."""
        return len(self._cache)


def prototype(rows: np.ndarray) -> np.ndarray:
    """An intent's prototype: the normalised mean of its rows (zeros where they cancel out)."""
    mean = rows.mean(axis=0)
    norm = float(np.linalg.norm(mean))
    return mean / norm if norm > 0 else np.zeros_like(mean)


def scoring_for(embedder: str) -> Scoring:
    """The scoring an embedder's own threshold was measured with: centroid for ``multilingual``
    (chosen with it), nearest for the others (bench/routing.py, top_k 2)."""
    return "centroid" if embedder == "multilingual" else "nearest"


def _texts(intent: Intent) -> tuple[str, ...]:
    """What an intent's vectors are made of: its examples, and its description if it has one."""
    return (*intent.examples, intent.description) if intent.description else intent.examples


@functools.cache
def background_prompts() -> tuple[str, ...]:
    """The shipped general prompts (``background.txt``), read once."""
    return tuple(line for line in BACKGROUND_PATH.read_text().splitlines() if line and not line.startswith("#"))
