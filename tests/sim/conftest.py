"""Shared fixtures for the simulated pod's tests: one tokenizer per session, in-process pods."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp.test_utils import TestClient, TestServer

from extproc.resources import DEFAULT_TOKENIZER
from llmgw_sim import SimOptions, build_app
from llmgw_sim.tokens import SimTokenizer

ClientFactory = Callable[..., Awaitable[TestClient]]


@pytest.fixture(scope="session")
def sim_tokenizer() -> SimTokenizer:
    """The default tokenizer, loaded once (it takes ~0.5 s)."""
    return SimTokenizer.from_spec(DEFAULT_TOKENIZER)


@pytest.fixture
async def make_client(sim_tokenizer: SimTokenizer) -> AsyncIterator[ClientFactory]:
    """Start in-process pods: ``await make_client(time_scale=0.0, ...)`` (SimOptions fields);
    ``exit_process`` may replace the hard exit of ``crash_after``."""
    clients: list[TestClient] = []

    async def factory(exit_process: Callable[[], None] | None = None, **overrides: object) -> TestClient:
        fields: dict[str, object] = {"time_scale": 0.0, **overrides}
        options = SimOptions(**fields)  # type: ignore[arg-type]
        app = build_app(options, sim_tokenizer, exit_process or _no_exit)
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.close()


def _no_exit() -> None:
    raise AssertionError("crash_after fired in a test that did not expect it")
