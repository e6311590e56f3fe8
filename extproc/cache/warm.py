"""Warm-up of hot keys: stampedes of one deterministic request are answered by one generation.

A key that misses is marked in the cache's cuckoo filter (``ResponseCache.missing``) until an
answer is stored under it. A request whose key misses again while marked (its answer is still
being generated, or could not be kept: a stream its client cut short) does not go to the pods on
its own: it asks the ``Warmer``, which fetches the answer once, directly from a pod of the pool
(not streamed), stores it, and hands it to every request waiting for that key in this process.
Those are then answered from the cache, as hits. A warm-up that fails or takes longer than
``timeout_s`` leaves its waiters to be routed as usual.

A warm-up is the gateway's own traffic: no tenant is charged for it; its requests are counted in
``llmgw_cache_lookups_total`` (``warmed``) and logged.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
import orjson

from extproc.cache.answers import NotCacheable, parse_answer
from extproc.cache.store import ResponseCache

log = logging.getLogger("llmgw.cache")
WARM_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class WarmUp:
    """How to fetch a key's answer from a pod: the endpoint's path, the body pods take, the pod
    and its pool's credential, and how long to keep the answer."""

    path: str
    body: bytes
    endpoint: str
    credential: str | None
    ttl_s: float
    stale_ttl_s: float


class Warmer:
    """One warm-up per hot key at a time, shared by every request waiting for it."""

    def __init__(self, cache: ResponseCache, timeout_s: float = WARM_TIMEOUT_S) -> None:
        self.cache = cache
        self.timeout_s = timeout_s
        self._flights: dict[bytes, asyncio.Future[bytes | None]] = {}
        self._session: aiohttp.ClientSession | None = None

    async def answer(self, key: bytes, warm: WarmUp) -> bytes | None:
        """The key's answer, fetched once for all its waiters; None if that failed."""
        flight = self._flights.get(key)
        if flight is None:
            flight = self._flights[key] = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(self._fetch(key, warm, flight))
            task.add_done_callback(lambda _: self._flights.pop(key, None))
        try:
            return await asyncio.wait_for(asyncio.shield(flight), self.timeout_s)
        except TimeoutError:
            return None

    async def _fetch(self, key: bytes, warm: WarmUp, flight: asyncio.Future[bytes | None]) -> None:
        value = None
        try:
            raw = orjson.loads(warm.body)
            raw.pop("stream_options", None)
            raw["stream"] = False
            headers = {"content-type": "application/json"}
            if warm.credential:
                headers["authorization"] = f"Bearer {warm.credential}"
            if self._session is None or self._session.closed:
                self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s * 4))
            async with self._session.post(f"http://{warm.endpoint}{warm.path}", data=orjson.dumps(raw),
                                          headers=headers) as response:
                body = await response.read()
                if response.status != 200:
                    raise NotCacheable(f"the pod answered {response.status}")
            value = parse_answer(warm.path, body, streamed=False)
            await self.cache.store(key, value, warm.ttl_s, warm.stale_ttl_s)
            self.cache.counters.warmed += 1
            log.info("response cache: warmed a hot key from %s", warm.endpoint)
        except Exception as error:  # noqa: BLE001 (a failed warm-up sends its waiters to the pods)
            log.warning("response cache warm-up from %s failed: %s", warm.endpoint, str(error) or type(error).__name__)
        finally:
            if not flight.done():
                flight.set_result(value)

    async def close(self) -> None:
        """Release the HTTP session."""
        if self._session is not None:
            await self._session.close()
