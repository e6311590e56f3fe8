"""When more requests wait than one call holds, those close to the oldest go with it: a shared
prefix block or a near-duplicate text (embedding cosine >= 0.72); the others keep their turn."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest
from aiohttp.test_utils import TestClient

from extproc.config import ConfigError, parse_config
from extproc.coordinator.grouping import PREFIX, PREFIX_CHARS, SEMANTIC, choose
from extproc.routing.embedders import HashingEmbedder
from tests.helpers import eventually
from tests.test_coordinator_pods import _stack

SYSTEM = "You are a support agent for ACME routers. " * 8  # > one prefix block


def _choose(prompts: list[str], size: int, budget: int = 10_000, threshold: float | None = 0.72,
            tokens: list[int] | None = None) -> tuple[list[int], dict[str, int]]:
    asked = []

    def vectors() -> np.ndarray:
        asked.append(True)
        return HashingEmbedder().embed(prompts)

    chosen = choose(prompts, tokens or [10] * len(prompts), size, budget, threshold, vectors)
    if len(prompts) <= size:
        assert not asked  # nothing to choose between: no embedding
    return chosen


def test_everything_goes_when_it_fits() -> None:
    assert _choose(["a", "b", "c"], size=4) == ([0, 1, 2], {})


def test_a_shared_prefix_block_goes_with_the_oldest() -> None:
    assert len(SYSTEM) >= PREFIX_CHARS
    prompts = [SYSTEM + "my router reboots", "translate this into French please", "write a haiku about rain",
               SYSTEM + "how do I reset the password"]
    assert _choose(prompts, size=2) == ([0, 3], {PREFIX: 1})


def test_a_near_duplicate_goes_with_the_oldest_and_a_stranger_waits() -> None:
    prompts = ["Summarise the quarterly sales report for the northern region in three bullet points",
               "what is the capital of Peru",
               "Summarise the quarterly sales report for the southern region in three bullet points",
               "write a limerick about a cat"]
    vectors = HashingEmbedder().embed(prompts)
    assert float(vectors[2] @ vectors[0]) >= 0.72 > float(vectors[1] @ vectors[0])
    assert _choose(prompts, size=2) == ([0, 2], {SEMANTIC: 1})
    assert _choose(prompts, size=2, threshold=None) == ([0, 1], {})  # off: rank order


def test_the_token_budget_skips_what_does_not_fit_but_keeps_filling() -> None:
    prompts = ["a", "b", "c", "d"]
    assert _choose(prompts, size=3, budget=25, tokens=[10, 20, 5, 5], threshold=None) == ([0, 2, 3], {})
    assert _choose(prompts, size=3, budget=5, tokens=[10, 20, 5, 5], threshold=None)[0] == [0]  # the oldest always


async def test_the_coordinator_sends_close_requests_together_while_a_stranger_waits_its_turn() -> None:
    pod, coordinator, client, pod_client, endpoint = await _stack(serial=True)
    headers = {"x-gateway-destination-endpoint": endpoint, "x-llmgw-input-tokens": "10",
               "x-llmgw-batch": "wait_ms=0; size=8; tokens=25; group=0.72"}

    async def ask(client: TestClient, prompt: str) -> str:
        response = await client.post("/v1/completions", headers=headers,
                                     data=orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}))
        assert response.status == 200
        return response.headers["x-llmgw-batch-id"]

    # Learn that the pod runs one call at a time, so the next requests wait in the coordinator.
    warm = [asyncio.create_task(ask(client, "warm up")), None]
    await eventually(lambda: len(pod.started) == 1)
    warm[1] = asyncio.create_task(ask(client, "warm up two"))
    await eventually(lambda: len(pod.calls) == 2)
    pod.gates[0].set()
    await eventually(lambda: coordinator.interleaves.get(endpoint) == 0.0)
    # 10 tokens each, 25 a call: the third fills the budget (full) and only two of three fit.
    prompts = [SYSTEM + "my router reboots", "write a haiku about rain", SYSTEM + "reset the password"]
    tasks = []
    for prompt in prompts[:2]:  # in this order: the haiku is older than the second support question
        tasks.append(asyncio.create_task(ask(client, prompt)))
        await eventually(lambda n=len(tasks): sum(len(q) for q in coordinator.queues.values()) == n)  # noqa: B008
    tasks.append(asyncio.create_task(ask(client, prompts[2])))
    await eventually(lambda: len(pod.calls) == 3)
    assert pod.calls[2] == [prompts[0], prompts[2]]
    pod.gates[1].set()
    pod.gates[2].set()
    await eventually(lambda: len(pod.calls) == 4)
    assert pod.calls[3] == [prompts[1]]  # its turn came with the next call
    pod.gates[3].set()
    ids = [await task for task in tasks]
    assert ids[0] == ids[2] != ids[1]
    await asyncio.gather(*warm)  # type: ignore[arg-type]
    metrics = await (await client.get("/metrics")).text()
    assert 'llmgw_batch_grouped_total{affinity="prefix"} 1.0' in metrics
    await client.close()
    await pod_client.close()


def test_a_threshold_above_one_is_refused_naming_the_field() -> None:
    pool = {"name": "gpu", "endpoints": ["10.0.0.1:8000"], "batching": {"enabled": True, "group_threshold": 1.5}}
    with pytest.raises(ConfigError, match="group_threshold"):
        parse_config({"pools": [pool], "models": [{"name": "m", "pool": "gpu"}]})
