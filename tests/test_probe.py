"""Active health probes (``extproc.routing.probe``): a pod that answers and one that is gone, as
``EndpointHealth`` and the per-pool count (``llmgw_pool_pods_healthy``) see them."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping

from aiohttp import web
from aiohttp.test_utils import TestServer

from extproc.config import parse_config
from extproc.routing.health import EndpointHealth
from extproc.routing.probe import probe_forever


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def test_a_round_of_probes_marks_the_gone_pod_and_counts_each_pools_healthy_pods() -> None:
    app = web.Application()
    app.router.add_get("/health", _ok)
    with socket.socket() as held:  # bound, never listening: a connection to it is refused, and no one takes it
        held.bind(("127.0.0.1", 0))
        await _probe_round(app, f"127.0.0.1:{held.getsockname()[1]}")


async def _probe_round(app: web.Application, gone: str) -> None:
    async with TestServer(app) as server:
        alive = f"127.0.0.1:{server.port}"
        config = parse_config({
            "pools": [{"name": "both", "endpoints": [alive, gone, alive], "health": {"interval_s": 0.05}},
                      {"name": "one", "endpoints": [alive]}],
            "models": [{"name": "m", "pool": "both"}]})
        health, rounds = EndpointHealth(), asyncio.Queue[Mapping[str, int]]()
        prober = asyncio.create_task(probe_forever(lambda: config, health, rounds.put_nowait))
        try:
            counts = await asyncio.wait_for(rounds.get(), 10)
        finally:
            prober.cancel()
    assert dict(counts) == {"both": 1, "one": 1}  # a pod listed twice counts once
    assert health.is_usable(alive) and not health.is_usable(gone)
