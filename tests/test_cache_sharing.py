"""The semantic cache shared by every process: a prompt whose answer is stored (by whichever
process settles it) reaches every process's index, including one started later, over a real Redis
and over the node's SQLite file; a prompt whose answer is never stored reaches none."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np
import pytest

from extproc.cache.semantic import Prompt, SemanticIndexes
from extproc.cache.sharing import PromptSharing, decode, encode
from extproc.cache.store import CacheBackend, RedisBackend, ResponseCache, SqliteBackend
from extproc.config import SemanticCacheSpec
from llmgw_testing.redis_server import RedisServer
from tests.helpers import eventually

SPEC = SemanticCacheSpec(embedder="hashing", check="none", threshold=0.9)
ANSWER = b'{"kind":"chat","model":"m","choices":[],"usage":{}}'


@dataclass
class Process:
    """One gateway process's share of the semantic cache."""

    cache: ResponseCache
    indexes: SemanticIndexes
    sharing: PromptSharing

    async def prepare(self, text: str) -> Prompt:
        index = await self.indexes.index(SPEC)
        return await self.indexes.run(index.prepare, text)

    async def match(self, partition: str, text: str) -> bytes | None:
        index = await self.indexes.index(SPEC)
        found = index.match(partition, await self.prepare(text))
        return None if found is None else found.key


class Node:
    """The test's processes, each following the store's announcements and the shared prompts."""

    def __init__(self, backend: Callable[[], CacheBackend]) -> None:
        self.backend = backend
        self.processes: list[Process] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self) -> Process:
        cache = ResponseCache(self.backend())
        indexes = SemanticIndexes()
        process = Process(cache, indexes, PromptSharing(indexes, cache))
        self.processes.append(process)
        self.tasks += [asyncio.create_task(cache.follow()), asyncio.create_task(process.sharing.follow())]
        await eventually(cache.ready.is_set)
        return process

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for process in self.processes:
            await process.cache.backend.close()



@pytest.fixture(params=["redis", "sqlite"])
async def node(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[Node]:
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        running = Node(lambda: RedisBackend(server.url))
    else:
        running = Node(lambda: SqliteBackend(tmp_path / "cache.db"))
    yield running
    await running.stop()


async def test_a_stored_answers_prompt_reaches_every_process(node: Node) -> None:
    a, b, settler = await node.start(), await node.start(), await node.start()
    partition, key = os.urandom(8).hex(), os.urandom(32)
    question = "What is the capital city of France?"
    a.sharing.missed("hashing", partition, await a.prepare(question), key)

    assert await b.match(partition, question) is None  # not shared before its answer is stored
    await settler.cache.store(key, ANSWER, ttl_s=60, stale_ttl_s=60)  # another process settles it
    for process in (a, b, settler):
        await eventually(lambda p=process: _matches(p, partition, "what is the capital city of france", key))

    later = await node.start()  # reads the prompts kept from before it started
    await eventually(lambda: _matches(later, partition, question, key))


async def test_the_process_that_stores_the_answer_of_its_own_miss_matches_it_at_once(node: Node) -> None:
    a = await node.start()
    partition, key = os.urandom(8).hex(), os.urandom(32)
    a.sharing.missed("hashing", partition, await a.prepare("How tall is Mount Everest?"), key)
    await a.cache.store(key, ANSWER, ttl_s=60, stale_ttl_s=60)
    # No announcement or shared record read back yet: the store itself told this process.
    assert await a.match(partition, "how tall is mount everest") == key


async def test_a_prompt_whose_answer_is_never_stored_is_not_shared(node: Node) -> None:
    a, b = await node.start(), await node.start()
    partition, key, other = os.urandom(8).hex(), os.urandom(32), os.urandom(32)
    a.sharing.missed("hashing", partition, await a.prepare("Name three prime numbers."), key)
    a.sharing.missed("hashing", partition, await a.prepare("Explain recursion briefly."), other)
    await b.cache.store(other, ANSWER, ttl_s=60, stale_ttl_s=60)

    await eventually(lambda: _matches(b, partition, "Explain recursion briefly.", other))
    assert await b.match(partition, "Name three prime numbers.") is None
    assert await a.match(partition, "Name three prime numbers.") is None


async def _matches(process: Process, partition: str, text: str, key: bytes) -> bool:
    return await process.match(partition, text) == key


def test_a_shared_record_round_trips_and_a_bad_vector_is_refused() -> None:
    prompt = Prompt("hello there", np.arange(4, dtype=np.float32) / 4, None)
    embedder, partition, back, key = decode(encode("minilm", "t1", prompt, b"\x01" * 32))
    assert (embedder, partition, back.text, key) == ("minilm", "t1", "hello there", b"\x01" * 32)
    assert np.array_equal(back.vector, prompt.vector) and back.meaning is None
    # the learned check's second vector travels with it, so no process embeds the prompt again
    meant = Prompt("hello there", prompt.vector, None, np.arange(6, dtype=np.float32) / 6)
    assert np.array_equal(decode(encode("minilm", "t1", meant, b"\x01" * 32))[2].meaning, meant.meaning)
    with pytest.raises(ValueError):
        decode(encode("minilm", "t1", Prompt("x", np.array([np.nan], dtype=np.float32), None), b"\x02"))
    with pytest.raises(ValueError):
        decode(encode("minilm", "t1", Prompt("x", prompt.vector, None, np.array([np.inf], np.float32)), b"\x02"))
