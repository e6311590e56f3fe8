"""One semantic cache for every process and replica: the prompts whose answers are stored are
shared, with their vectors.

A process that misses a semantic lookup keeps the prompt it embedded as pending, under the exact
key its answer will be stored with. Whichever process stores that answer (the one that settles
the request's access-log entry), the store is announced to all (``ResponseCache.listeners``); the
process holding the pending prompt then shares it: its text, partition, key and vector
(``ResponseCache.share``: a Redis Stream, or the node's SQLite table). The sharer adds it to its
own indexes at once (and a process that stores an answer tells itself before the store announces
it); every other process adds each shared prompt to its index for that embedder as it reads it,
and one that starts later reads the ones kept (``SHARED_MAXLEN``) before the new ones. So a
paraphrase is found by whichever worker or replica it reaches, and only prompts whose answers were
stored take room in the index.

A shared vector is used as it comes (embedding it again would cost ~8 ms per process), and so is
the learned check's second vector (``meaning``, USE-m3's); its facts for the check are read from
the text again (~80 us), in the embedding thread. A record from an
embedder this process has no index for yet waits (``BACKLOG`` of them at most) until one is
built. Records are compact JSON with the vectors in base64: ~2.2 kB for MiniLM's 384 dimensions,
~5 kB with USE-m3's 512 beside them.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections import OrderedDict, deque
from typing import Any

import numpy as np
import orjson

from extproc.cache.semantic import Prompt, SemanticIndex, SemanticIndexes
from extproc.cache.store import ResponseCache

log = logging.getLogger("llmgw.cache")
PENDING = 10_000  # prompts waiting for their answer to be stored (the oldest go first)
BACKLOG = 20_000  # shared prompts kept for an embedder whose index is not built yet


class PromptSharing:
    """The semantic indexes of this process, kept in step with every other process's."""

    def __init__(self, indexes: SemanticIndexes, cache: ResponseCache) -> None:
        self.indexes = indexes
        self.cache = cache
        self._pending: OrderedDict[bytes, tuple[str, str, Prompt]] = OrderedDict()
        self._backlog: dict[str, deque[tuple[str, Prompt, bytes]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        cache.listeners.append(self.stored)
        indexes.on_built.append(self._built)

    def missed(self, embedder: str, partition: str, prompt: Prompt, key: bytes) -> None:
        """A semantic lookup missed: share ``prompt`` once an answer is stored under ``key``."""
        self._pending[key] = (embedder, partition, prompt)
        self._pending.move_to_end(key)
        while len(self._pending) > PENDING:
            self._pending.popitem(last=False)

    def stored(self, keys: list[bytes]) -> None:
        """Answers were stored (by any process): share the pending prompts they answer."""
        for key in keys:
            pending = self._pending.pop(key, None)
            if pending is not None:
                embedder, partition, prompt = pending
                # Here at once (the record coming back later only re-adds it), the others through the store.
                for index in self.indexes.built(embedder):
                    index.add(partition, prompt, key)
                shared = self.cache.share(encode(embedder, partition, prompt, key))
                task = asyncio.get_running_loop().create_task(shared)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def follow(self) -> None:
        """Add every shared prompt to this process's indexes, forever."""
        await self.cache.follow_shared(self._received)

    async def _received(self, records: list[bytes]) -> None:
        by_embedder: dict[str, list[tuple[str, Prompt, bytes]]] = {}
        for record in records:
            try:
                embedder, partition, prompt, key = decode(record)
            except (ValueError, KeyError, TypeError) as error:
                log.warning("semantic cache: a shared prompt that cannot be read: %s", error)
                continue
            by_embedder.setdefault(embedder, []).append((partition, prompt, key))
        for embedder, entries in by_embedder.items():
            indexes = self.indexes.built(embedder)
            if not indexes:
                self._backlog.setdefault(embedder, deque(maxlen=BACKLOG)).extend(entries)
                continue
            await self.indexes.run(_add_all, indexes, entries)

    def _built(self, embedder: str, index: SemanticIndex) -> None:
        """An index was built: the prompts shared before it are added (in the embedding thread,
        which is the caller)."""
        _add_all([index], list(self._backlog.get(embedder, ())))


def _add_all(indexes: list[SemanticIndex], entries: list[tuple[str, Prompt, bytes]]) -> None:
    for index in indexes:
        for partition, prompt, key in entries:
            try:
                index.add(partition, prompt, key)
            except ValueError as error:  # another dimension than the partition's: not comparable
                log.warning("semantic cache: a shared prompt left out: %s", error)


def encode(embedder: str, partition: str, prompt: Prompt, key: bytes) -> bytes:
    """A shared prompt as it travels."""
    record = {"e": embedder, "p": partition, "t": prompt.text, "k": key.hex(), "v": _b64(prompt.vector)}
    if prompt.meaning is not None:
        record["m"] = _b64(prompt.meaning)
    return orjson.dumps(record)


def _b64(vector: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(vector, dtype=np.float32).tobytes()).decode()


def _vector(raw: Any) -> np.ndarray:
    vector = np.frombuffer(base64.b64decode(raw), dtype=np.float32)
    if vector.size == 0 or not np.isfinite(vector).all():
        raise ValueError("an empty or non-finite vector")
    return vector


def decode(record: bytes) -> tuple[str, str, Prompt, bytes]:
    """(embedder, partition, prompt without facts, key) of a shared record."""
    raw: dict[str, Any] = orjson.loads(record)
    meaning = _vector(raw["m"]) if "m" in raw else None
    return (str(raw["e"]), str(raw["p"]), Prompt(str(raw["t"]), _vector(raw["v"]), None, meaning),
            bytes.fromhex(raw["k"]))
