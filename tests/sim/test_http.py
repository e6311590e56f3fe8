"""The pod's OpenAI-compatible HTTP API, in-process (aiohttp test client)."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient

from llmgw_sim.costmodel import CostParams
from llmgw_sim.faults import FaultConfig
from tests.helpers import eventually
from tests.sim.conftest import ClientFactory

MODEL = "llama-3-8b-instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}]}


async def read_sse(resp: ClientResponse) -> list[tuple[float, object]]:
    """(arrival time, parsed event) for each SSE event; ``[DONE]`` is kept as the string."""
    events: list[tuple[float, object]] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: ")
        payload = line[len("data: "):]
        events.append((time.monotonic(), payload if payload == "[DONE]" else orjson.loads(payload)))
    return events


async def post(client: TestClient, path: str, body: object, **headers: str) -> ClientResponse:
    return await client.post(path, data=orjson.dumps(body), headers=headers)


async def test_chat_completion(make_client: ClientFactory) -> None:
    client = await make_client()
    resp = await post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 12, "ignore_eos": True},
                      **{"x-request-id": "req-1"})
    assert resp.status == 200
    assert resp.headers["x-request-id"] == "req-1"  # echoed (vLLM --enable-request-id-headers)
    body = await resp.json()
    assert body["id"] == "chatcmpl-req-1" and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12
    assert usage["prompt_tokens"] > 8  # the template's role markers count too
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_prompt_tokens_come_from_the_template(make_client: ClientFactory,
                                                    sim_tokenizer) -> None:
    client = await make_client()
    short = await (await post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 1})).json()
    longer = {**CHAT, "max_tokens": 1,
              "messages": [{"role": "user", "content": "Tell me a story. " * 10}]}
    long_body = await (await post(client, "/v1/chat/completions", longer)).json()
    extra = len(sim_tokenizer.encode_texts([" Tell me a story." * 9])[0])
    assert long_body["usage"]["prompt_tokens"] - short["usage"]["prompt_tokens"] == pytest.approx(extra, abs=2)


async def test_generated_id_without_request_id(make_client: ClientFactory) -> None:
    client = await make_client()
    resp = await post(client, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    body = await resp.json()
    assert body["id"] == f"cmpl-{resp.headers['x-request-id']}"


async def test_completions_list_of_prompts_and_n(make_client: ClientFactory) -> None:
    client = await make_client()
    body = await (await post(client, "/v1/completions", {
        "model": MODEL, "prompt": ["one", "two two", "three three three"], "n": 2, "max_tokens": 4,
    })).json()
    assert body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3, 4, 5]  # prompt_index * n + i
    assert body["usage"]["prompt_tokens"] == 1 + 2 + 3  # once per prompt, not per choice
    assert 6 <= body["usage"]["completion_tokens"] <= 6 * 4  # 1..max_tokens per choice
    texts = [c["text"] for c in body["choices"]]
    assert texts[0] != texts[1]  # the n choices of one prompt differ


async def test_completions_token_prompts(make_client: ClientFactory) -> None:
    client = await make_client()
    body = await (await post(client, "/v1/completions", {
        "model": MODEL, "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 3,
    })).json()
    assert len(body["choices"]) == 2 and body["usage"]["prompt_tokens"] == 5


async def test_chat_streaming_with_usage(make_client: ClientFactory) -> None:
    client = await make_client()
    resp = await post(client, "/v1/chat/completions", {
        **CHAT, "max_tokens": 10, "ignore_eos": True, "seed": 1, "stream": True,
        "stream_options": {"include_usage": True},
    })
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = [e for _, e in await read_sse(resp)]
    assert events[-1] == "[DONE]"
    first, *content, usage = events[:-1]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    plain = await (await post(client, "/v1/chat/completions",
                              {**CHAT, "max_tokens": 10, "ignore_eos": True, "seed": 1})).json()
    assert text == plain["choices"][0]["message"]["content"]  # streaming changes only the framing


async def test_completion_streaming_without_usage(make_client: ClientFactory) -> None:
    client = await make_client()
    resp = await post(client, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 3,
                                                  "ignore_eos": True, "stream": True})
    events = [e for _, e in await read_sse(resp)]
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["choices"] for c in chunks)  # no usage chunk
    finished = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"])
    assert finished == [0, 1]


async def test_stream_chunks_are_spread_over_time(make_client: ClientFactory) -> None:
    cost = CostParams(decode_base_s=0.02, decode_per_seq_s=0.0, prefill_per_token_s=0.0)
    client = await make_client(time_scale=1.0, cost=cost)
    resp = await post(client, "/v1/chat/completions",
                      {**CHAT, "max_tokens": 10, "ignore_eos": True, "stream": True})
    times = [t for t, e in await read_sse(resp) if isinstance(e, dict) and "content" in
             e["choices"][0]["delta"] and e["choices"][0]["delta"]["content"]]
    assert len(times) >= 8  # one chunk per 20 ms step, not one burst at the end
    assert times[-1] - times[0] >= 0.12  # 9 further steps of 20 ms, some slack for the loop


async def test_stop_sequence(make_client: ClientFactory) -> None:
    client = await make_client()
    body = {**CHAT, "max_tokens": 30, "seed": 11, "ignore_eos": True}
    full = (await (await post(client, "/v1/chat/completions", body)).json())["choices"][0]
    words = full["message"]["content"].split(" ")
    stop = " " + words[5]
    cut = (await (await post(client, "/v1/chat/completions", {**body, "stop": [stop]})).json())
    choice = cut["choices"][0]
    assert choice["message"]["content"] == full["message"]["content"].split(stop)[0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert cut["usage"]["completion_tokens"] < 30


async def test_seed_determinism(make_client: ClientFactory) -> None:
    client = await make_client()
    body = {**CHAT, "max_tokens": 20, "seed": 1234, "temperature": 0.8}
    texts = set()
    for _ in range(3):
        data = await (await post(client, "/v1/chat/completions", body)).json()
        texts.add(data["choices"][0]["message"]["content"])
    assert len(texts) == 1
    other = await (await post(client, "/v1/chat/completions", {**body, "seed": 99})).json()
    assert other["choices"][0]["message"]["content"] not in texts


@pytest.mark.parametrize(
    ("path", "body", "status", "err_type"),
    [
        pytest.param("/v1/chat/completions", {**CHAT, "model": "gpt-nope"}, 404, "NotFoundError",
                     id="unknown model"),
        pytest.param("/v1/completions", {"model": MODEL}, 400, "BadRequestError", id="no prompt"),
        pytest.param("/v1/chat/completions", {**CHAT, "max_tokens": 9000}, 400, "BadRequestError",
                     id="past the 8192-token context"),
        pytest.param("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "BadRequestError",
                     id="token id out of vocabulary"),
    ],
)
async def test_errors(make_client: ClientFactory, path: str, body: object, status: int,
                      err_type: str) -> None:
    client = await make_client()
    resp = await post(client, path, body)
    assert resp.status == status
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == err_type and error["code"] == status


async def test_invalid_json(make_client: ClientFactory) -> None:
    client = await make_client()
    resp = await client.post("/v1/chat/completions", data=b"{not json")
    assert resp.status == 400 and (await resp.json())["error"]["type"] == "BadRequestError"


async def test_models_health_and_metrics(make_client: ClientFactory) -> None:
    client = await make_client()
    models = await (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert (card["id"], card["owned_by"], card["max_model_len"]) == (MODEL, "vllm", 8192)
    health = await client.get("/health")
    assert health.status == 200 and await health.read() == b""
    await post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 3})
    text = await (await client.get("/metrics")).text()
    label = f'model_name="{MODEL}"'
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    ):
        assert any(line.startswith(name + "{") and label in line for line in text.splitlines()), name


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


async def test_prefix_cache_hits_show_in_usage_and_metrics(make_client: ClientFactory) -> None:
    client = await make_client()
    long_chat = {"model": MODEL, "max_tokens": 2,
                 "messages": [{"role": "user", "content": "shared context " * 100}]}
    first = await (await post(client, "/v1/chat/completions", long_chat)).json()
    second = await (await post(client, "/v1/chat/completions", long_chat)).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt = second["usage"]["prompt_tokens"]
    assert cached == (prompt - 1) // 16 * 16  # every full block but the last token's
    text = await (await client.get("/metrics")).text()
    assert metric(text, "vllm:prefix_cache_hits_total") == cached
    assert metric(text, "vllm:prefix_cache_queries_total") == 2 * prompt


async def test_continuous_finishes_mixed_workload_sooner(make_client: ClientFactory) -> None:
    # 20 ms steps: a loaded machine's stalled loop, which later steps catch up on, is small beside
    # the 90 ms static loses to dynamic here
    cost = CostParams(decode_base_s=0.02, decode_per_seq_s=0.0, prefill_per_token_s=0.0, max_num_seqs=8)
    latencies = {}
    for engine in ("continuous", "dynamic", "static"):
        client = await make_client(time_scale=1.0, cost=cost, engine=engine)

        async def timed(body: object, delay: float, client: TestClient = client) -> float:
            await asyncio.sleep(delay)  # the workload itself: the shorts arrive while the long one runs
            start = time.monotonic()
            await (await post(client, "/v1/completions", body)).read()
            return time.monotonic() - start

        long_job = {"model": MODEL, "prompt": "long", "max_tokens": 40, "ignore_eos": True}
        short_job = {"model": MODEL, "prompt": "short", "max_tokens": 3, "ignore_eos": True}
        results = await asyncio.gather(timed(long_job, 0), *(timed(short_job, 0.1) for _ in range(4)))
        latencies[engine] = sum(results[1:]) / 4
    # continuous: the shorts join at once (~3 steps); dynamic: they wait for the 40-step batch
    # and then run together; static: they also run one call after another.
    assert latencies["continuous"] < 0.3
    assert latencies["dynamic"] > 0.6
    assert latencies["static"] > latencies["dynamic"] + 0.02


async def test_record_requests(make_client: ClientFactory) -> None:
    client = await make_client(record=2)
    for i in range(3):
        await post(client, "/v1/completions", {"model": MODEL, "prompt": f"p{i}", "max_tokens": 1},
                   **{"x-tenant": f"t{i}"})
    recorded = (await (await client.get("/debug/requests")).json())["requests"]
    assert [r["body"]["prompt"] for r in recorded] == ["p1", "p2"]  # the last N, oldest first
    assert recorded[-1]["headers"]["x-tenant"] == "t2" and recorded[-1]["path"] == "/v1/completions"
    assert (await client.delete("/debug/requests")).status == 204
    assert (await (await client.get("/debug/requests")).json())["requests"] == []


async def test_recording_off_by_default(make_client: ClientFactory) -> None:
    client = await make_client()
    assert (await client.get("/debug/requests")).status == 404


async def test_error_injection(make_client: ClientFactory) -> None:
    client = await make_client(faults=FaultConfig(error_rate=1.0))
    statuses = set()
    for _ in range(12):
        resp = await post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 1})
        statuses.add(resp.status)
        assert (await resp.json())["error"]["code"] == resp.status
    assert statuses == {500, 503}


async def test_error_rate_is_seeded(make_client: ClientFactory) -> None:
    runs = []
    for _ in range(2):
        client = await make_client(faults=FaultConfig(error_rate=0.5), seed=3)
        runs.append([(await post(client, "/v1/completions",
                                 {"model": MODEL, "prompt": "x", "max_tokens": 1})).status
                     for _ in range(10)])
    assert runs[0] == runs[1] and 200 in runs[0] and len(set(runs[0])) > 1


async def test_spike_delays_first_token(make_client: ClientFactory) -> None:
    client = await make_client(faults=FaultConfig(spike_rate=1.0, spike_ms=150))
    start = time.monotonic()
    await (await post(client, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})).read()
    assert time.monotonic() - start >= 0.15


async def test_hang_never_answers(make_client: ClientFactory) -> None:
    client = await make_client(faults=FaultConfig(hang_rate=1.0))
    with pytest.raises(asyncio.TimeoutError):
        async with asyncio.timeout(0.3):
            await post(client, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})


async def test_crash_after(make_client: ClientFactory) -> None:
    crashed = asyncio.Event()
    client = await make_client(exit_process=crashed.set, faults=FaultConfig(crash_after=2))
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert (await post(client, "/v1/completions", body)).status == 200
    # Not a wait for something to happen: timers run in deadline order, so by the end of this one
    # an exit the 1st answer had scheduled (the pod's crash delay, 0.05 s) would have run.
    await asyncio.sleep(0.1)
    assert not crashed.is_set()
    assert (await post(client, "/v1/completions", body)).status == 200  # the 2nd is still answered
    async with asyncio.timeout(1):
        await crashed.wait()


async def test_die_after_tokens_ends_the_process_once_a_sequence_has_that_many(make_client: ClientFactory) -> None:
    received: list[int] = []  # content chunks the client had when the pod asked to end the process
    chunks = 0
    exited = asyncio.Event()

    def exit_process() -> None:
        received.append(chunks)
        exited.set()

    client = await make_client(exit_process=exit_process, faults=FaultConfig(die_after_tokens=4),
                               time_scale=1.0, cost=CostParams(decode_base_s=0.05, decode_per_seq_s=0.0,
                                                               prefill_per_token_s=0.0))
    short = await post(client, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True})
    assert (await short.read()).endswith(b"data: [DONE]\n\n") and not received  # 3 tokens: no fault
    resp = await post(client, "/v1/completions",
                      {"model": MODEL, "prompt": ["x", "y"], "max_tokens": 8, "ignore_eos": True, "stream": True})

    async def read() -> None:
        nonlocal chunks
        async for line in resp.content:
            chunks += line.startswith(b"data: {")

    reader = asyncio.create_task(read())
    async with asyncio.timeout(5):
        await exited.wait()
    reader.cancel()
    # The step of the 4th token is handed out (4 chunks per prompt), then the engine stops: no
    # chunk after them, and the process would end (a stub here).
    assert received == [2 * 4] and chunks == 2 * 4


async def test_client_disconnect_aborts_stream(make_client: ClientFactory) -> None:
    cost = CostParams(decode_base_s=0.01, decode_per_seq_s=0.0, prefill_per_token_s=0.0)
    client = await make_client(time_scale=1.0, cost=cost)
    resp = await post(client, "/v1/chat/completions",
                      {**CHAT, "max_tokens": 500, "ignore_eos": True, "stream": True})
    await resp.content.readline()
    busy = await (await client.get("/metrics")).text()
    assert metric(busy, "vllm:num_requests_running") == 1
    assert metric(busy, "vllm:kv_cache_usage_perc") > 0  # its prompt and output blocks are reserved
    resp.close()

    async def idle() -> bool:
        text = await (await client.get("/metrics")).text()
        return metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:kv_cache_usage_perc") == 0

    await eventually(idle, 3, what="the pod dropping the request and freeing its blocks")  # 500 steps take 5 s
    text = await (await client.get("/metrics")).text()
    aborted = [line for line in text.splitlines()
               if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line]
    assert len(aborted) == 1 and aborted[0].endswith(" 1.0")


async def test_several_served_model_names(make_client: ClientFactory) -> None:
    client = await make_client(model="base", extra_models=("alias",))
    models = await (await client.get("/v1/models")).json()
    assert [(m["id"], m["root"]) for m in models["data"]] == [("base", "base"), ("alias", "base")]
    body = await (await post(client, "/v1/completions", {"model": "alias", "prompt": "x", "max_tokens": 1})).json()
    assert body["model"] == "alias"  # answered with the name asked for, as vLLM does
    no_model = await (await post(client, "/v1/completions", {"prompt": "x", "max_tokens": 1})).json()
    assert no_model["model"] == "base"
