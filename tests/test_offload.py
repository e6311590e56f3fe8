"""The helper process for large bodies: same answers as the inline analysis, errors included."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest

from extproc.api import ApiError, Operation
from extproc.body import BodyLimits, analyze
from extproc.decisions import Analyze
from extproc.offload import BodyAnalyzer

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
