"""The cache's whole lookup (``extproc.cache.lookup``) on a real SQLite store: exact key, then a
paraphrase through the semantic index and its check, then a hot key's warm-up."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from extproc.cache.lookup import CacheLookup, SemanticParaphrases
from extproc.cache.semantic import SemanticIndexes
from extproc.cache.sharing import PromptSharing
from extproc.cache.store import ResponseCache, SqliteBackend
from extproc.cache.warm import WarmUp
from extproc.config import SemanticCacheSpec
from extproc.steps import HOT_MISS, Lookup, SemanticHit, SemanticQuery, Warm
from tests.helpers import eventually

SPEC = SemanticCacheSpec(embedder="hashing", check="none", threshold=0.9)
ANSWER = b'{"kind":"chat","model":"m","choices":[],"usage":{}}'


@pytest.fixture
async def lookup(tmp_path: Path) -> AsyncIterator[CacheLookup]:
    cache = ResponseCache(SqliteBackend(tmp_path / "cache.db"))
    indexes = SemanticIndexes()
    sharing = PromptSharing(indexes, cache)
    tasks = [asyncio.create_task(cache.follow()), asyncio.create_task(sharing.follow())]
    await eventually(cache.ready.is_set)
    await indexes.index(SPEC)  # built before the first lookup (a request never waits for it)
    yield CacheLookup(cache, SemanticParaphrases(cache, indexes, sharing))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await cache.backend.close()


async def test_an_exact_key_is_found_and_a_stale_lookup_finds_it_too(lookup: CacheLookup) -> None:
    key = os.urandom(32)
    assert await lookup.lookup(Lookup(key)) is None
    await lookup.cache.store(key, ANSWER, ttl_s=60, stale_ttl_s=60)
    assert await lookup.lookup(Lookup(key)) == ANSWER
    assert await lookup.lookup(Lookup(key, stale=True)) == ANSWER


async def test_a_key_that_missed_and_misses_again_is_hot(lookup: CacheLookup) -> None:
    key = os.urandom(32)
    assert await lookup.lookup(Lookup(key)) is None
    assert await lookup.lookup(Lookup(key)) is HOT_MISS  # its answer is on its way, or was never kept
    await lookup.cache.store(key, ANSWER, ttl_s=60, stale_ttl_s=60)
    assert await lookup.lookup(Lookup(key)) == ANSWER


async def test_a_paraphrase_finds_the_earlier_answer_once_it_is_stored(lookup: CacheLookup) -> None:
    partition, first, second = os.urandom(8).hex(), os.urandom(32), os.urandom(32)
    asked = Lookup(first, semantic=SemanticQuery(partition, "What is the capital city of France?", SPEC))
    assert await lookup.lookup(asked) is None  # nothing yet: the prompt waits for its answer
    await lookup.cache.store(first, ANSWER, ttl_s=60, stale_ttl_s=60)
    again = Lookup(second, semantic=SemanticQuery(partition, "what is the capital city of france", SPEC))

    async def found() -> bool:
        hit = await lookup.lookup(again)
        return isinstance(hit, SemanticHit) and hit.value == ANSWER and hit.score >= 0.9

    await eventually(found, what="the paraphrase's hit")
    other = Lookup(os.urandom(32), semantic=SemanticQuery(os.urandom(8).hex(), "What is the capital city of France?",
                                                          SPEC))
    assert await lookup.lookup(other) is None  # another partition (another conversation, model or tenant)


async def test_in_shadow_mode_a_paraphrase_is_counted_and_logged_not_served(
        lookup: CacheLookup, caplog: pytest.LogCaptureFixture) -> None:
    shadow = SemanticCacheSpec(embedder="hashing", check="none", threshold=0.9, mode="shadow")
    await lookup.paraphrases.indexes.index(shadow)  # type: ignore[attr-defined]
    partition, first = os.urandom(8).hex(), os.urandom(32)
    assert await lookup.lookup(Lookup(first, semantic=SemanticQuery(partition, "Where is the Louvre museum?",
                                                                   shadow))) is None
    await lookup.cache.store(first, ANSWER, ttl_s=60, stale_ttl_s=60)
    caplog.set_level("INFO", logger="llmgw.cache")

    async def judged() -> bool:  # a new key each time: the same one missing again would be hot
        again = Lookup(os.urandom(32), semantic=SemanticQuery(partition, "where is the louvre museum", shadow))
        assert await lookup.lookup(again) is None  # never served
        return lookup.cache.counters.shadow > 0

    await eventually(judged, what="the shadow hit")
    assert "would have answered 'where is the louvre museum' with the answer to 'Where is the Louvre museum?'" \
        in caplog.text


async def test_a_warm_up_that_cannot_reach_a_pod_answers_none(lookup: CacheLookup) -> None:
    with socket.socket() as probe:  # a port nobody listens on once closed: the connection is refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    closed = WarmUp("/v1/chat/completions", b'{"model":"m","messages":[]}', f"127.0.0.1:{port}", None, 60, 60)
    assert await lookup.warm(Warm(os.urandom(32), closed)) is None
