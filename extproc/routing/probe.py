"""Active health probes: every extproc process asks each pod ``GET /health`` (vLLM's) on an interval
and tells ``EndpointHealth``; a pod that refuses, errs or stays silent past the timeout is out
until it answers 2xx again. A probe round costs one small HTTP request per pod."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

import aiohttp

from extproc.config import GatewayConfig, Pool
from extproc.routing.health import EndpointHealth

log = logging.getLogger("llmgw.health")
_COORDINATOR_POOL = Pool("coordinator", ())  # the batching coordinator's probe settings: a pod's defaults


async def _probe(session: aiohttp.ClientSession, pool: Pool, endpoint: str) -> bool:
    try:
        async with session.get(f"http://{endpoint}{pool.health.path}",
                               timeout=aiohttp.ClientTimeout(total=pool.health.timeout_s)) as response:
            return 200 <= response.status < 300
    except (TimeoutError, aiohttp.ClientError, OSError):
        return False


async def probe_forever(config: Callable[[], GatewayConfig], health: EndpointHealth,
                        on_round: Callable[[Mapping[str, int]], None] | None = None) -> None:
    """Probe every pool's endpoints, each round as often as the most eager pool asks; log changes,
    and give ``on_round`` how many pods of each pool answered."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a dead pod must not keep a pooled socket
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        while True:
            current = config()
            pools = tuple(current.pools.values())
            targets = [(pool, endpoint) for pool in pools for endpoint in pool.endpoints]
            if current.server.coordinator is not None and pools:  # probed like a pod, on /health
                targets.append((_COORDINATOR_POOL, current.server.coordinator))
            results = await asyncio.gather(*(_probe(session, pool, endpoint) for pool, endpoint in targets))
            for (pool, endpoint), healthy in zip(targets, results, strict=True):
                if health.probed(endpoint, healthy):
                    if healthy:
                        log.info("pod %s of pool %s answers its health probe again", endpoint, pool.name)
                    else:
                        log.warning("pod %s of pool %s failed its health probe: no traffic until it answers",
                                    endpoint, pool.name)
            if on_round is not None:
                answered = {(pool.name, endpoint): ok for (pool, endpoint), ok in zip(targets, results, strict=True)}
                on_round({p.name: sum(answered[p.name, e] for e in dict.fromkeys(p.endpoints)) for p in pools})
            await asyncio.sleep(min((p.health.interval_s for p in pools), default=1.0))
