"""Semantic response cache: answer a new prompt with the stored answer of an earlier prompt that
asks for the same thing. Pure apart from the embedder it is given: no I/O, no clock.

``SemanticIndex`` keeps, per partition (a tenant's name, or "" for a cache shared by all), the
prompts whose answers are stored: each prompt's text, its unit vector and the exact cache key of
its answer (``extproc.cache.answers.cache_key``). ``match`` scores the new prompt against every
stored vector with one matrix product and serves the most similar stored prompt whose cosine
reaches the threshold if the check accepts it (``candidates`` > 1: the most similar of that many
that the check accepts). A partition holds at most ``capacity``
prompts; the oldest goes first.

The check is ``learned`` (``extproc.cache.paraphrase``): vetoes that generalize (numbers,
arithmetic, units, quoted strings, code identifiers, negation), the same text, and a classifier
trained on pairs written apart from this code, with a cross-encoder's vote (the README has its
figures on the frozen blind pairs). A sentence embedding alone cannot keep near misses out: "the
advantages of X" and "the disadvantages of X", "17 times 23" and "17 times 24" share nearly every
word, and on the labelled pairs MiniLM's cosine alone never exceeds 65% precision. ``none`` (the
cosine alone) exists to measure what the check saves.

A hand-written guard (1.1k lines of rules and word lists: names, form, direction, task, question
kinds, one-stretch edits, antonym families) was the check before the learned one. It was written
against this project's own pairs and did not carry over: on the frozen blind pairs it served 193
hits at precision 74.1% and recall 52.4%, where the learned check then served 144 at 100% and
52.7% (one pair at a time; the README has the check's figures now, crowded too, and
docs/semantic-quality.md their history). It was removed; the
learned check's vetoes are the part of it that generalizes.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np

from extproc.cache import paraphrase
from extproc.cache.pairs import PairEncoder
from extproc.cache.paraphrase import PromptFeatures
from extproc.routing.embedders import Embedder

T = TypeVar("T")

DEFAULT_EMBEDDER = "minilm"  # the learned check is trained on its cosines
DEFAULT_CAPACITY = 10_000
# Stored prompts above the threshold offered to the check, best first: the nearest only. Each more
# candidate is one more chance to serve an unrelated prompt's answer in a busy partition: on the
# frozen blind pairs, each writer's prompts in one partition, 8 candidates served 94.0% right
# answers at 40.3% recall, the nearest alone 97.3% at 39.9% (one run).
DEFAULT_CANDIDATES = 1


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt ready to match or store: its text, unit vector and what the check reads of it (its
    ``PromptFeatures`` and its second encoder's vector, ``meaning``; None: not read yet, or no
    check)."""

    text: str
    vector: np.ndarray
    facts: PromptFeatures | None
    meaning: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class Match:
    """A stored prompt that asks for the same thing: its answer's exact cache key, the cosine
    similarity and the stored prompt's text."""

    key: bytes
    score: float
    text: str


class _Partition:
    """One partition's prompts: a ring of at most ``capacity`` rows, the first added overwritten
    first (a hit does not make a prompt younger: its answer expires in the store all the same)."""

    __slots__ = ("facts", "keys", "meanings", "next", "rows", "size", "texts", "vectors")

    def __init__(self) -> None:
        self.vectors = np.zeros((0, 0), dtype=np.float32)
        self.texts: list[str] = []
        self.keys: list[bytes] = []
        self.facts: list[PromptFeatures | None] = []
        self.meanings: list[np.ndarray | None] = []
        self.rows: dict[str, int] = {}  # text -> row
        self.size = 0
        self.next = 0  # the row the next new prompt takes

    def put(self, prompt: Prompt, key: bytes, capacity: int) -> None:
        """Store ``prompt`` under ``key`` (a text already here: its key replaced)."""
        row = self.rows.get(prompt.text)
        if row is not None:
            self.keys[row] = key
            return
        if self.vectors.shape[1] != prompt.vector.shape[0]:
            if self.size:
                raise ValueError(f"a {prompt.vector.shape[0]}-dimensional vector in an index of "
                                 f"{self.vectors.shape[1]}")
            self.vectors = np.zeros((0, prompt.vector.shape[0]), dtype=np.float32)
        row = self.next
        if row == len(self.vectors):  # grow by doubling up to capacity, not 10k rows per tenant at once
            grown = np.zeros((min(capacity, max(64, 2 * len(self.vectors))), self.vectors.shape[1]), np.float32)
            grown[:len(self.vectors)] = self.vectors
            self.vectors = grown
        if row < self.size:  # evict the oldest
            del self.rows[self.texts[row]]
            self.texts[row], self.keys[row], self.facts[row] = prompt.text, key, prompt.facts
            self.meanings[row] = prompt.meaning
        else:
            self.texts.append(prompt.text)
            self.keys.append(key)
            self.facts.append(prompt.facts)
            self.meanings.append(prompt.meaning)
            self.size += 1
        self.vectors[row] = prompt.vector
        self.rows[prompt.text] = row
        self.next = (row + 1) % capacity


class SemanticIndex:
    """Prompts whose answers are cached, per partition, matched by cosine similarity and the
    check (``check="none"``: cosine alone, for comparison). Safe to share between threads; the
    embedder runs outside the lock (``prepare``), so a caller may embed once in a worker thread
    and hand the ``Prompt`` to ``match`` and later to ``add``.

    Memory: up to ``capacity`` x the embedder's dimension x 4 bytes per partition (MiniLM: 1.5 kB
    a prompt, 15 MB at 10,000), plus the texts and their facts, and with the learned check the
    second encoder's vectors (USE-m3: 2 kB a prompt) and its cross-encoder (``pairs``: MiniLM's
    weights again, with the adapters folded in: ~130 MB and ~0.4 s, once a process).

    ``meaning``: the learned check's second encoder (default: the one its model names, loaded
    here, ~0.3 s: build the index outside the event loop). ``precision``: the learned check's
    operating point (default: its model's threshold, 99% in cross-validation).
    """

    def __init__(self, embedder: Embedder, threshold: float | None = None, capacity: int = DEFAULT_CAPACITY,
                 candidates: int = DEFAULT_CANDIDATES, check: Check = "learned",
                 meaning: Embedder | None = None, precision: float | None = None) -> None:
        if check not in ("learned", "none"):
            raise ValueError(f"check must be learned or none, not {check!r}")
        self.check: Check = check
        self._model = paraphrase_model() if self.check == "learned" else None
        if precision is not None:
            if self._model is None:
                raise ValueError("precision is the learned check's operating point")
            self._model = self._model.at_precision(precision)
        if threshold is None:  # the learned check's lowest served cosine
            threshold = (self._model or paraphrase_model()).min_cosine
        if not 0.0 < threshold <= 1.0:
            raise ValueError("threshold must be in (0, 1]")
        if capacity < 1 or candidates < 1:
            raise ValueError("capacity and candidates must be >= 1")
        if self._model is not None and self._model.embedder != embedder.name:
            raise ValueError(f"the learned check was trained on {self._model.embedder} cosines, "
                             f"not {embedder.name}'s")
        self.embedder = embedder
        self.meaning = meaning
        if self.meaning is None and self._model is not None and self._model.encoder is not None:
            from extproc.routing.embedders import build_embedder

            self.meaning = build_embedder(self._model.encoder)
        self.pairs: PairEncoder | None = None
        if self._model is not None and self._model.stack is not None:
            self.pairs = pair_encoder()
        self.threshold = threshold
        self.capacity = capacity
        self.candidates = candidates
        self._partitions: dict[str, _Partition] = {}
        self._lock = threading.Lock()

    @property
    def model(self) -> paraphrase.ParaphraseModel | None:
        """The learned check's model at this index's operating point (None: another check)."""
        return self._model

    def prepare(self, text: str) -> Prompt:
        """``text`` embedded, and read by the index's check."""
        return self.prepare_many([text])[0]

    def prepare_many(self, texts: list[str]) -> list[Prompt]:
        """Each text embedded in one batch."""
        if not texts:
            return []
        vectors = self.embedder.embed(texts)
        meanings: list[np.ndarray | None] = (list(self.meaning.embed(texts)) if self.meaning is not None
                                               else [None] * len(texts))
        return [Prompt(text, vector, self._read(text), meaning)
                for text, vector, meaning in zip(texts, vectors, meanings, strict=True)]

    def _read(self, text: str) -> PromptFeatures | None:
        return paraphrase.read(text) if self.check == "learned" else None

    def add(self, partition: str, prompt: str | Prompt, key: bytes) -> None:
        """Remember that the answer to ``prompt`` is cached under ``key`` in ``partition``."""
        prepared = self._prepared(prompt)
        with self._lock:
            part = self._partitions.get(partition)
            if part is None:
                part = self._partitions[partition] = _Partition()
            part.put(prepared, key, self.capacity)

    def match(self, partition: str, prompt: str | Prompt) -> Match | None:
        """The most similar prompt of ``partition`` that reaches the threshold and that the
        check accepts, or None. Only ``candidates`` prompts above the threshold are offered to
        the check, best first, once the lock is released: the cross-encoder's forward pass takes
        milliseconds, and ``add`` runs on the event loop."""
        prepared = self._prepared(prompt)
        with self._lock:
            part = self._partitions.get(partition)
            if part is None or part.size == 0:
                return None
            scores = part.vectors[:part.size] @ prepared.vector
            above = np.flatnonzero(scores >= self.threshold)
            if above.size > self.candidates:
                above = above[np.argpartition(-scores[above], self.candidates - 1)[:self.candidates]]
            # Copied out: a row may be overwritten by the time it is checked.
            best_first = above[np.argsort(-scores[above], kind="stable")]
            candidates = [(Prompt(part.texts[row], part.vectors[row].copy(), part.facts[row], part.meanings[row]),
                           part.keys[row], float(scores[row])) for row in best_first]
        for stored, key, cosine in candidates:
            if self._accepts(prepared, stored, cosine):
                return Match(key, round(cosine, 4), stored.text)
        return None

    def _accepts(self, query: Prompt, stored: Prompt, cosine: float) -> bool:
        """Whether the check serves ``stored``'s answer for ``query`` (both read by ``_read``)."""
        if (self._model is not None and isinstance(query.facts, PromptFeatures)
                and isinstance(stored.facts, PromptFeatures)):
            vectors = (query.vector, stored.vector, query.meaning, stored.meaning)
            return self._model.accepts(cosine, query.facts, stored.facts, vectors, self._cross(query.text, stored.text))
        return self.check == "none"

    def _cross(self, query: str, stored: str) -> Callable[[], float] | None:
        """The cross-encoder's vote on the pair, for the model to ask when it decides (None: no
        cross-encoder)."""
        pairs = self.pairs
        if pairs is None:
            return None
        return lambda: float(pairs.votes([(query, stored)])[0])

    def _prepared(self, prompt: str | Prompt) -> Prompt:
        """``prompt`` embedded if it is a text, read by this index's check if it was not (a prompt
        shared by another process, or prepared by an index with another check): its facts read
        again, and its second encoder's vector computed where the check needs one and it has none."""
        if isinstance(prompt, str):
            return self.prepare(prompt)
        wanted = PromptFeatures if self.check == "learned" else type(None)
        facts = prompt.facts if isinstance(prompt.facts, wanted) else self._read(prompt.text)
        meaning = prompt.meaning
        if self.meaning is not None and meaning is None:
            meaning = self.meaning.embed([prompt.text])[0]
        if facts is prompt.facts and meaning is prompt.meaning:
            return prompt
        return Prompt(prompt.text, prompt.vector, facts, meaning)

    def size(self, partition: str) -> int:
        """How many prompts ``partition`` holds."""
        with self._lock:
            part = self._partitions.get(partition)
            return 0 if part is None else part.size


Check = Literal["learned", "none"]


@functools.cache
def paraphrase_model() -> paraphrase.ParaphraseModel:
    """The shipped learned check, loaded once per process."""
    return paraphrase.ParaphraseModel.load()


@functools.cache
def pair_encoder() -> PairEncoder:
    """The learned check's cross-encoder, loaded once per process (every index shares it)."""
    return PairEncoder()


IndexKey = tuple[str, float | None, int, Check, float | None]


def index_key(spec: Any) -> IndexKey:
    """What makes two ``SemanticCacheSpec`` share an index: embedder, threshold, capacity, the
    check and its operating point."""
    return spec.embedder, spec.threshold, spec.capacity, spec.check, spec.precision


class SemanticIndexes:
    """The semantic indexes of one process, one per setting (embedder, threshold, capacity, check), and
    the one thread that embeds for them: embedding (MiniLM, ~8 ms a prompt) never runs on the event
    loop, and the model is loaded there on first use."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._executor = ThreadPoolExecutor(1, thread_name_prefix="llmgw-semantic")
        self._indexes: dict[IndexKey, SemanticIndex] = {}
        # Called in the embedding thread with (embedder, index) when an index is built.
        self.on_built: list[Callable[[str, SemanticIndex], None]] = []
        self._building: dict[IndexKey, Any] = {}  # builds started by ``ready``

    async def index(self, spec: Any) -> SemanticIndex:
        """The index for ``spec`` (a ``SemanticCacheSpec``), built (its embedder loaded) on first use."""
        key = index_key(spec)
        index = self._indexes.get(key)
        if index is None:
            from extproc.routing.embedders import build_embedder

            embedder = await self.run(build_embedder, spec.embedder)
            # built here, in the embedding thread: the learned check loads its second encoder
            built_index = await self.run(functools.partial(SemanticIndex, embedder, spec.threshold, spec.capacity,
                                                           check=spec.check, precision=spec.precision))
            index = self._indexes.get(key)
            if index is None:
                index = self._indexes[key] = built_index
                for built in self.on_built:
                    await self.run(built, spec.embedder, index)
        return index

    def ready(self, spec: Any) -> SemanticIndex | None:
        """The index for ``spec`` if it is built; else None, and its build starts in the
        background (loading an embedder takes seconds: a request never waits for it)."""
        key = index_key(spec)
        index = self._indexes.get(key)
        if index is None and key not in self._building:
            import asyncio

            task = asyncio.get_running_loop().create_task(self.index(spec))
            self._building[key] = task
            task.add_done_callback(lambda done: self._built_or_failed(key, done))
        return index

    def _built_or_failed(self, key: IndexKey, task: Any) -> None:
        self._building.pop(key, None)
        if not task.cancelled() and task.exception() is not None:
            import logging

            logging.getLogger("llmgw.cache").warning("semantic cache index %s could not be built: %s", key,
                                                     task.exception())

    def built(self, embedder: str) -> list[SemanticIndex]:
        """The indexes built so far for ``embedder``."""
        return [index for (name, *_), index in self._indexes.items() if name == embedder]

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` in the embedding thread."""
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)
