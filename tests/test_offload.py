"""The helper process for large bodies: same answers as the inline analysis, errors included."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest

from extproc.api import ApiError, Operation
from extproc.body import BodyLimits, analyze
from extproc.offload import BodyAnalyzer
from extproc.steps import Analyze

SERVED = {"llama": "llama", "mini": "llama"}


@pytest.fixture
async def analyzer() -> AsyncIterator[BodyAnalyzer]:
    helper = BodyAnalyzer(max_queued_bytes=1 << 20)
    await helper.start()
    yield helper
    helper.close()


async def test_the_helper_answers_as_the_inline_analysis(analyzer: BodyAnalyzer) -> None:
    body = orjson.dumps({"model": "mini", "messages": [{"role": "user", "content": "word " * 20000}], "stream": True})
    got = await analyzer.analyze(Analyze(Operation.CHAT, body, SERVED, BodyLimits()))
    assert got == analyze(Operation.CHAT, body, SERVED, BodyLimits())


async def test_a_refusal_comes_back_as_the_same_api_error(analyzer: BodyAnalyzer) -> None:
    body = orjson.dumps({"model": "llama", "messages": [{"role": "user", "content": "a"}], "tools": [{}] * 200})
    got = await analyzer.analyze(Analyze(Operation.CHAT, body, SERVED, BodyLimits()))
    assert got == ApiError(400, "Too many tools: 200; the limit is 128.", param="tools", code="invalid_value")


async def test_past_the_queued_bytes_a_large_body_is_a_503(analyzer: BodyAnalyzer) -> None:
    body = orjson.dumps({"model": "llama", "messages": [{"role": "user", "content": "x" * 700_000}]})
    jobs = [analyzer.analyze(Analyze(Operation.CHAT, body, SERVED, BodyLimits())) for _ in range(3)]
    answers = await asyncio.gather(*jobs)
    refused = [a for a in answers if isinstance(a, ApiError)]
    # 1 MiB may wait: the first is taken, the next two would pass the bound.
    assert len(refused) == 2 and all(a.status == 503 and a.code == "service_unavailable" for a in refused)


async def test_a_body_that_would_wait_past_the_bound_is_a_503_at_once() -> None:
    """The queue is bounded by time: with the helper learned at 1 s per MB, a second 600 KB body
    would wait past the 1 s bound, and is refused before it is sent."""
    helper = BodyAnalyzer(max_wait_s=1.0)
    await helper.start()
    try:
        body = orjson.dumps({"model": "llama", "messages": [{"role": "user", "content": "x" * 600_000}]})
        helper.seconds_per_byte = 1e-6
        first = asyncio.ensure_future(helper.analyze(Analyze(Operation.CHAT, body, SERVED, BodyLimits())))
        await asyncio.sleep(0)  # one turn of the loop, not a wait: the first counts its bytes as queued
        second = await helper.analyze(Analyze(Operation.CHAT, body, SERVED, BodyLimits()))
        assert isinstance(second, ApiError) and second.status == 503 and second.code == "service_unavailable"
        assert not isinstance(await first, ApiError)
        # what the first really took is learned: far less than 1 s per MB
        assert helper.seconds_per_byte < 1e-6
    finally:
        helper.close()
