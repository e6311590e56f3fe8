"""LoRA adapters on the simulated pod, with vLLM's semantics: ``--enable-lora``,
``--lora-modules name=path``, ``--max-loras``, adapter cards in ``/v1/models``, the scheduler's
``max_loras`` rule and the ``vllm:lora_requests_info`` gauge."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from llmgw_sim import SimOptions
from llmgw_sim.__main__ import parse_args
from llmgw_sim.costmodel import CostParams
from llmgw_sim.prefix_cache import block_hashes
from llmgw_sim.scheduler import SimSequence, make_scheduler
from tests.helpers import eventually
from tests.sim.conftest import ClientFactory

BASE = "llama-3-8b-instruct"
ADAPTERS = (("sql", "/adapters/sql-lora"), ("chat", "/adapters/chat-lora"))
LORA = {"enable_lora": True, "lora_modules": ADAPTERS}


def chat(model: str, max_tokens: int, content: str = "Write a query.") -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                         "max_tokens": max_tokens, "ignore_eos": True})


async def lora_info(client: TestClient) -> dict[str, str] | None:
    """Labels of the latest ``vllm:lora_requests_info`` sample (its value is the update time)."""
    text = await (await client.get("/metrics")).text()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:lora_requests_info"]
    return max(samples, key=lambda s: s.value).labels if samples else None


async def test_models_lists_adapters_as_vllm_does(make_client: ClientFactory) -> None:
    client = await make_client(**LORA)
    cards = (await (await client.get("/v1/models")).json())["data"]
    assert [c["id"] for c in cards] == [BASE, "sql", "chat"]
    base, sql = cards[0], cards[1]
    assert (base["root"], base["parent"], base["max_model_len"]) == (BASE, None, 8192)
    # vLLM's adapter card: root is the adapter's path, parent the base model, no max_model_len.
    assert (sql["root"], sql["parent"], sql["max_model_len"]) == ("/adapters/sql-lora", BASE, None)
    assert sql["owned_by"] == "vllm"


async def test_a_request_to_an_adapter_is_served(make_client: ClientFactory) -> None:
    client = await make_client(**LORA)
    resp = await client.post("/v1/chat/completions", data=chat("sql", 3))
    assert resp.status == 200
    body = await resp.json()
    assert body["model"] == "sql" and body["usage"]["completion_tokens"] == 3  # the name asked for
    missing = await client.post("/v1/chat/completions", data=chat("nope", 3))
    assert missing.status == 404


async def test_adapters_do_not_share_the_base_models_prefix_cache(make_client: ClientFactory) -> None:
    client = await make_client(**LORA)
    prompt = "A long shared system prompt. " * 20

    async def cached(model: str) -> int:
        body = await (await client.post("/v1/chat/completions", data=chat(model, 1, prompt))).json()
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await cached(BASE) == 0
    assert await cached(BASE) > 0  # the base model hits its own blocks
    assert await cached("sql") == 0  # vLLM hashes the adapter into every block
    assert await cached("sql") > 0


@pytest.mark.parametrize("kind", ["continuous", "dynamic"])
@pytest.mark.parametrize(
    ("max_loras", "first_batch"),
    [
        pytest.param(1, ["a1", "base", "a2"], id="max_loras=1: b waits, later a and base pass it"),
        pytest.param(2, ["a1", "b1", "base", "a2"], id="max_loras=2: both adapters run together"),
    ],
)
def test_scheduler_caps_distinct_adapters_per_batch(kind: str, max_loras: int, first_batch: list[str]) -> None:
    params = CostParams(max_num_seqs=8, block_size=16)
    sched = make_scheduler(kind, params, max_loras)  # type: ignore[arg-type]
    seqs = {name: SimSequence(prompt_len=4, block_hashes=block_hashes([i] * 4, 16, lora), output_len=2, lora=lora)
            for i, (name, lora) in enumerate([("a1", "a"), ("b1", "b"), ("base", None), ("a2", "a")])}
    for seq in seqs.values():
        sched.add(seq)
    names = {id(seq): name for name, seq in seqs.items()}
    first = sched.step()
    assert [names[id(s)] for s in first.admitted] == first_batch
    if max_loras == 1:
        assert sched.running_loras == {"a"} and sched.waiting_loras == {"b"}
        second = sched.step()  # the a's finish on this step; b1 is still kept out of it
        assert not second.admitted and sched.num_waiting == 1
        third = sched.step()
        assert [names[id(s)] for s in third.admitted] == ["b1"]
    assert sched.num_waiting == 0


async def test_max_loras_1_serialises_two_adapters_and_the_gauge_shows_it(make_client: ClientFactory) -> None:
    client = await make_client(**LORA, max_loras=1, time_scale=1.0)  # 12 ms per step
    assert await lora_info(client) == {"max_lora": "1", "waiting_lora_adapters": "", "running_lora_adapters": ""}
    done: dict[str, float] = {}

    async def call(model: str, max_tokens: int) -> None:
        resp = await client.post("/v1/chat/completions", data=chat(model, max_tokens))
        assert resp.status == 200
        await resp.read()
        done[model] = time.monotonic()

    first = asyncio.create_task(call("sql", 40))
    await wait_for_info(client, running="sql", waiting="")
    second = asyncio.create_task(call("chat", 2))
    info = await wait_for_info(client, running="sql", waiting="chat")  # chat waits while sql runs
    assert info["max_lora"] == "1"
    await asyncio.gather(first, second)
    assert done["sql"] < done["chat"]  # chat (2 tokens) only ran once sql (40 tokens) was done
    assert await lora_info(client) == {"max_lora": "1", "waiting_lora_adapters": "", "running_lora_adapters": ""}


async def wait_for_info(client: TestClient, running: str, waiting: str, timeout_s: float = 5.0) -> dict[str, str]:
    shown: dict[str, str] = {}

    async def showing() -> bool:
        shown.clear()
        shown.update(await lora_info(client) or {})
        return (shown.get("running_lora_adapters"), shown.get("waiting_lora_adapters")) == (running, waiting)

    await eventually(showing, timeout_s, what=f"lora_requests_info showing running={running} waiting={waiting}")
    return shown


async def test_no_lora_gauge_without_enable_lora(make_client: ClientFactory) -> None:
    client = await make_client()
    text = await (await client.get("/metrics")).text()
    assert "vllm:lora_requests_info" not in text  # vLLM only exports it with LoRA enabled


def test_cli_flags_map_to_options() -> None:
    options = parse_args(["--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "2"])
    assert options.enable_lora and options.max_loras == 2
    assert options.lora_modules == (("sql", "/a/sql"), ("chat", "/a/chat"))
    assert parse_args([]).max_loras == 1  # vLLM's default


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        pytest.param({"lora_modules": ADAPTERS}, "needs enable_lora", id="adapters without --enable-lora"),
        pytest.param({**LORA, "lora_modules": (("sql", "/a"), ("sql", "/b"))}, "already served", id="twice"),
        pytest.param({**LORA, "lora_modules": ((BASE, "/a"),)}, "already served", id="the base model's name"),
        pytest.param({**LORA, "max_loras": 0}, "max_loras", id="max_loras=0"),
    ],
)
def test_invalid_lora_options(fields: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        SimOptions(**fields)  # type: ignore[arg-type]
