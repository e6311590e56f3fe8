"""Semantic routing's shell: runs intent matching off the event loop, in one thread per worker.

An embedder costs milliseconds (``minilm``) or a network round trip (``remote``): neither may run
on the event loop that serves every other request. Requests queue for the embedding thread; each
run takes every text waiting (up to ``BATCH``) and embeds them in one call, so a burst costs one
forward pass, not one per request. The index keeps an LRU of texts already matched; a repeated
prompt is answered without the thread.

Past ``max_pending`` texts waiting, or when the embedder fails (a remote one down), the request
takes the default route at once: semantic routing degrades to the default, never to an error or
a stall. Both are counted (``stats``) and the failure is logged once per outage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from extproc.config import Intents
from extproc.routing.embedders import build_embedder
from extproc.routing.intents import Intent, IntentIndex, IntentMatch, background_prompts, scoring_for

log = logging.getLogger("llmgw.intents")
BATCH = 32


@dataclass
class ClassifierStats:
    """Counts since start: outcomes (``matched``, ``default``, ``busy``, ``failed``) and the
    seconds spent embedding."""

    outcomes: Counter[str] = field(default_factory=Counter)
    embed_seconds: float = 0.0
    embedded: int = 0


def build_index(intents: Intents) -> IntentIndex:
    """The intent index for a config (embeds every example: seconds for minilm, run it off the loop)."""
    spec = intents.embedder
    embedder = build_embedder(spec.kind, dim=spec.dim, model_dir=spec.model_dir, url=spec.url, model=spec.model,
                              api_key=intents.api_key, timeout_s=spec.timeout_s)
    routes = tuple(Intent(r.name, r.examples, r.model, r.pool, r.description) for r in intents.routes)
    return IntentIndex(routes, embedder, threshold=intents.threshold, margin=intents.margin,
                       cache_size=intents.cache_size, top_k=intents.top_k,
                       scoring=intents.scoring or scoring_for(embedder.name),
                       background=background_prompts() if intents.background else (),
                       decision=intents.decision, confidence=intents.confidence)


class IntentClassifier:
    """Matches prompts to intents for one worker: ``configure`` on each config, ``classify`` per request."""

    def __init__(self, build: Callable[[Intents], IntentIndex] = build_index) -> None:
        self._build = build
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmgw-intents")
        self._index: IntentIndex | None = None
        self._intents: Intents | None = None
        self._queue: list[tuple[str, asyncio.Future[IntentMatch | None]]] = []
        self._runner: asyncio.Task[None] | None = None
        self._failing = False
        self.stats = ClassifierStats()

    @property
    def ready(self) -> bool:
        """An index is built (for the config last given)."""
        return self._index is not None

    async def configure(self, intents: Intents | None) -> None:
        """Build the index for a new config (off the loop) and swap it in; requests meanwhile use
        the previous one. The same settings as before cost nothing."""
        if intents == self._intents:
            return
        if intents is None:
            self._index, self._intents = None, None
            return
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        index = await loop.run_in_executor(self._executor, self._build, intents)
        self._index, self._intents = index, intents
        log.info("semantic routing: %d intents, %s embedder, threshold %.2f, built in %.2f s",
                 len(intents.routes), index.embedder.name, index.threshold, time.perf_counter() - started)

    async def classify(self, text: str) -> IntentMatch | None:
        """The intent of ``text``, or None for the default route (no index, busy, or failing)."""
        index, intents = self._index, self._intents
        if index is None or intents is None:
            return None
        cached = index.lookup(text)
        if cached is not None:
            self._count(cached)
            return cached
        if len(self._queue) >= intents.max_pending:
            self.stats.outcomes["busy"] += 1
            return None
        future: asyncio.Future[IntentMatch | None] = asyncio.get_running_loop().create_future()
        self._queue.append((text, future))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        match = await future
        if match is not None:
            self._count(match)
        return match

    def close(self) -> None:
        """Stop the embedding thread (after the batch it runs)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _count(self, match: IntentMatch) -> None:
        self.stats.outcomes["matched" if match.intent is not None else "default"] += 1

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            batch, self._queue = self._queue[:BATCH], self._queue[BATCH:]
            index = self._index
            texts = [text for text, _ in batch]
            started = time.perf_counter()
            try:
                assert index is not None
                matches: list[IntentMatch | None] = list(
                    await loop.run_in_executor(self._executor, index.classify_many, texts))
                if self._failing:
                    self._failing = False
                    log.info("semantic routing: the embedder works again")
            except Exception as error:  # noqa: BLE001 (any embedder failure: the default route)
                matches = [None] * len(batch)
                self.stats.outcomes["failed"] += len(batch)
                if not self._failing:
                    self._failing = True
                    log.error("semantic routing: the embedder failed (%s); requests take the default route", error)
            self.stats.embed_seconds += time.perf_counter() - started
            self.stats.embedded += len(batch)
            for (_, future), match in zip(batch, matches, strict=True):
                if not future.done():
                    future.set_result(match)
