"""The response cache's whole lookup, in one place: what the shell runs for a ``Lookup`` or a
``Warm`` the director asked for.

    exact key (Bloom filter, then the store) -> a paraphrase of an earlier prompt (the semantic
    index, then the store) -> a hot key that keeps missing (``HOT_MISS``: the director asks for a
    ``Warm``, which fetches its answer once from a pod for every request waiting on it)

A cache that fails is a miss: the request goes to a pod.
"""

from __future__ import annotations

import logging
from typing import Protocol

from extproc.cache.semantic import SemanticIndexes
from extproc.cache.sharing import PromptSharing
from extproc.cache.store import ResponseCache
from extproc.cache.warm import Warmer
from extproc.steps import HOT_MISS, HotMiss, Lookup, SemanticHit, SemanticQuery, Warm

log = logging.getLogger("llmgw.cache")


class Paraphrases(Protocol):
    """Finds the stored answer of an earlier prompt that asks the same thing in other words."""

    async def find(self, key: bytes, query: SemanticQuery) -> SemanticHit | None:
        """That answer and the match's score (None: no paraphrase is known, or the check refused
        every candidate); a miss is remembered, so that the prompt is matched once answered."""
        ...


class SemanticParaphrases:
    """The semantic cache's matching: the prompt is embedded in this process's embedding thread and
    matched there against the index of answered prompts (nearest neighbours, then the paraphrase
    check against near misses, ``extproc.cache.semantic``); a prompt that missed is shared with
    every process (``PromptSharing``) once its answer is stored."""

    def __init__(self, cache: ResponseCache, indexes: SemanticIndexes, sharing: PromptSharing) -> None:
        self.cache = cache
        self.indexes = indexes
        self.sharing = sharing

    async def find(self, key: bytes, query: SemanticQuery) -> SemanticHit | None:
        index = self.indexes.ready(query.spec)
        if index is None:  # its embedder is still loading: an exact lookup only, this time
            return None
        try:
            prompt = await self.indexes.run(index.prepare, query.text)
        except Exception as error:  # noqa: BLE001 (the embedder failed: exact keys only)
            log.warning("semantic cache unavailable: %s", str(error) or type(error).__name__)
            return None
        # In the embedding thread too: checking long prompts' candidates costs milliseconds.
        match = await self.indexes.run(index.match, query.partition, prompt)
        if match is not None and match.key != key:
            if query.spec.mode == "shadow":  # judged, not served: no store read, no hit counted
                self.cache.counters.shadow += 1
                log.info("semantic cache (shadow): would have answered %r with the answer to %r (cosine %.3f)",
                         query.text[:500], match.text[:500], match.score)
            elif (value := await self.cache.lookup(match.key)) is not None:
                return SemanticHit(value, match.score)
        self.sharing.missed(query.spec.embedder, query.partition, prompt, key)
        return None


class CacheLookup:
    """Runs the director's cache effects against one ``ResponseCache``."""

    def __init__(self, cache: ResponseCache, paraphrases: Paraphrases | None = None) -> None:
        self.cache = cache
        self.paraphrases = paraphrases
        self.warmer = Warmer(cache)

    async def lookup(self, effect: Lookup) -> bytes | SemanticHit | HotMiss | None:
        """The stored answer for ``effect.key`` (a stale one will do when ``effect.stale``), else a
        paraphrase's, else ``HOT_MISS`` for a key that keeps missing, else None."""
        cache = self.cache
        if effect.stale:
            return await cache.stale(effect.key)
        hot = cache.hot(effect.key)  # it missed before: its answer is on its way, or could not be kept
        value = await cache.lookup(effect.key)
        if value is not None:
            return value
        if effect.semantic is not None and self.paraphrases is not None:
            found = await self.paraphrases.find(effect.key, effect.semantic)
            if found is not None:
                return found
        return HOT_MISS if hot else None

    async def warm(self, effect: Warm) -> bytes | None:
        """A hot key's answer, fetched once from a pod for every request waiting on it (None: the
        warm-up failed or took too long)."""
        return await self.warmer.answer(effect.key, effect.warm_up)
