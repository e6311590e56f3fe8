"""The coordinator learns how a pod treats concurrent calls. vLLM interleaves them (a call sent
while another runs starts at the next engine step); a server without a batcher runs them one after
another. For the latter, a batch whose window has closed waits in the coordinator while our call
runs, where later requests can still join it, instead of queueing behind it at the pod."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from extproc.coordinator.server import Coordinator, build_app
from extproc.routing.engines import LLAMACPP, VLLM
from tests.helpers import eventually


class GatedPod:
    """Streams a first chunk for each prompt, then holds the call until its gate opens. ``serial``:
    one call at a time (the next one starts, first chunk included, only when the last ended)."""

    def __init__(self, serial: bool) -> None:
        self.serial = serial
        self.calls: list[list[str]] = []
        self.started: list[list[str]] = []
        self.gates: list[asyncio.Event] = []
        self._lock = asyncio.Lock()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append(body["prompt"])
        gate = asyncio.Event()
        self.gates.append(gate)
        if self.serial:
            async with self._lock:
                return await self._answer(request, body["prompt"], gate)
        return await self._answer(request, body["prompt"], gate)

    async def _answer(self, request: web.Request, prompts: list[str], gate: asyncio.Event) -> web.StreamResponse:
        self.started.append(prompts)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i, _ in enumerate(prompts):
            await response.write(b"data: " + orjson.dumps({"choices": [{"index": i, "text": "a"}]}) + b"\n\n")
        await gate.wait()
        for i, _ in enumerate(prompts):
            chunk = {"choices": [{"index": i, "text": "b", "finish_reason": "stop"}]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        usage = {"prompt_tokens": len(prompts), "completion_tokens": 2 * len(prompts)}
        await response.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
        return response



async def _stack(serial: bool) -> tuple[GatedPod, Coordinator, TestClient, TestClient, str]:
    pod = GatedPod(serial)
    app = web.Application()
    app.router.add_post("/v1/completions", pod.completions)
    pod_client = TestClient(TestServer(app))
    await pod_client.start_server()
    coordinator = Coordinator()
    coordinator.serial_evidence_s = 0.0  # these pods hold calls at the test's pace: every wait counts
    client = TestClient(TestServer(build_app(coordinator)))
    await client.start_server()
    return pod, coordinator, client, pod_client, f"127.0.0.1:{pod_client.port}"


def _ask(client: TestClient, endpoint: str, i: int) -> asyncio.Task[dict]:
    headers = {"x-gateway-destination-endpoint": endpoint, "x-llmgw-batch": "wait_ms=0; size=8",
               "x-llmgw-input-tokens": "1"}

    async def ask() -> dict:
        response = await client.post("/v1/completions", headers=headers,
                                     data=orjson.dumps({"model": "m", "prompt": f"p{i}", "max_tokens": 4}))
        assert response.status == 200
        return {"size": response.headers["x-llmgw-batch-size"], **(await response.json())}

    return asyncio.create_task(ask())


async def test_batches_wait_in_the_coordinator_while_a_one_call_at_a_time_pod_runs_ours() -> None:
    pod, coordinator, client, pod_client, endpoint = await _stack(serial=True)
    first = _ask(client, endpoint, 0)
    await eventually(lambda: len(pod.started) == 1)
    second = _ask(client, endpoint, 1)  # nothing learned yet: its window (0 ms) sends it to the pod's queue
    await eventually(lambda: len(pod.calls) == 2)
    assert len(pod.started) == 1  # the pod runs one call at a time
    pod.gates[0].set()
    await eventually(lambda: len(pod.started) == 2)  # it started only once the first had ended: learned
    await eventually(lambda: coordinator.interleaves.get(endpoint) == 0.0)
    rest = [_ask(client, endpoint, i) for i in (2, 3, 4)]
    await eventually(lambda: sum(len(q) for q in coordinator.queues.values()) == 3)
    assert len(pod.calls) == 2  # held here while ours runs, although their window has closed
    pod.gates[1].set()
    await eventually(lambda: len(pod.calls) == 3)
    assert pod.calls[2] == ["p2", "p3", "p4"]  # one call, the moment the pod was free
    pod.gates[2].set()
    answers = [await task for task in (first, second, *rest)]
    assert [a["size"] for a in answers] == ["1", "1", "3", "3", "3"]
    assert all(a["choices"][0]["text"] == "ab" for a in answers)
    await client.close()
    await pod_client.close()


async def test_a_pod_that_interleaves_calls_gets_each_batch_when_its_window_closes() -> None:
    pod, coordinator, client, pod_client, endpoint = await _stack(serial=False)
    first = _ask(client, endpoint, 0)
    await eventually(lambda: len(pod.started) == 1)
    second = _ask(client, endpoint, 1)
    await eventually(lambda: coordinator.interleaves.get(endpoint) == 1.0)  # it started while the first still ran
    third = _ask(client, endpoint, 2)
    await eventually(lambda: len(pod.started) == 3)  # not held: the pod takes it at once
    for gate in pod.gates:
        gate.set()
    assert [(await task)["size"] for task in (first, second, third)] == ["1", "1", "1"]
    await client.close()
    await pod_client.close()


async def test_a_continuous_engine_is_not_labelled_serial_for_calls_that_simply_ended_first() -> None:
    pod, _, client, pod_client, endpoint = await _stack(serial=True)  # the pod holds each call until told
    coordinator = Coordinator(engines={endpoint: VLLM})  # its profile: a continuous engine
    gateway = TestClient(TestServer(build_app(coordinator)))
    await gateway.start_server()
    first = _ask(gateway, endpoint, 0)
    await eventually(lambda: len(pod.started) == 1)
    second = _ask(gateway, endpoint, 1)
    await eventually(lambda: len(pod.calls) == 2)
    pod.gates[0].set()  # the first ends; the second starts after it: one sample at most, from the profile's prior
    await eventually(lambda: len(pod.started) == 2)
    pod.gates[1].set()
    await first
    await second
    assert not coordinator.serializes(endpoint) and coordinator.interleaves.get(endpoint, 1.0) >= 0.5
    for closing in (gateway, client, pod_client):
        await closing.close()


async def test_llamacpp_streams_a_null_event_per_further_prompt_and_each_prompts_own_usage() -> None:
    async def completions(request: web.Request) -> web.StreamResponse:
        prompts = (await request.json())["prompt"]
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i, _ in enumerate(prompts):  # llama-server 0c1e57098: each further prompt begins with `data: null`
            if i:
                await response.write(b"data: null\n\n")
            await response.write(b"data: " + orjson.dumps({"choices": [{"index": i, "text": "hi"}]}) + b"\n\n")
            usage = {"prompt_tokens": 10 + i, "completion_tokens": 1 + i, "total_tokens": 11 + 2 * i,
                     "prompt_tokens_details": {"cached_tokens": i}}
            final = {"choices": [{"index": i, "text": "", "finish_reason": "stop"}], "usage": usage}
            await response.write(b"data: " + orjson.dumps(final) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    pod_client = TestClient(TestServer(app))
    await pod_client.start_server()
    endpoint = f"127.0.0.1:{pod_client.port}"
    busy = SimpleNamespace(waiting=1.0, running=4.0, kv_usage=0.5, scraped_at=0.0)  # no room: the two share a call
    coordinator = Coordinator(states=SimpleNamespace(get=lambda _: busy), engines={endpoint: LLAMACPP})
    client = TestClient(TestServer(build_app(coordinator)))
    await client.start_server()
    headers = {"x-gateway-destination-endpoint": endpoint, "x-llmgw-batch": "wait_ms=10000; size=2",
               "x-llmgw-input-tokens": "10"}

    async def ask(i: int) -> dict:
        response = await client.post("/v1/completions", headers=headers,
                                     data=orjson.dumps({"model": "m", "prompt": f"p{i}", "max_tokens": 4}))
        assert response.status == 200 and response.headers["x-llmgw-batch-size"] == "2"
        return await response.json()

    answers = await asyncio.gather(ask(0), ask(1))
    by_prompt = sorted((a["usage"]["prompt_tokens"], a["usage"]["completion_tokens"]) for a in answers)
    assert by_prompt == [(10, 1), (11, 2)]  # each its own, as the pod counted it (not a split of the last)
    assert all(a["choices"][0]["text"] == "hi" for a in answers)
    await client.close()
    await pod_client.close()


async def _chat_pod(rendered: str | None) -> tuple[TestClient, list[tuple[str, dict]]]:
    """A pod that records what it is sent: a merged completion call, a chat sent alone, and (with
    ``rendered``) llama.cpp's POST /apply-template."""
    seen: list[tuple[str, dict]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()  # the coordinator always streams a merged call
        seen.append((request.path, body))
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i, _ in enumerate(body["prompt"]):
            chunk = {"choices": [{"index": i, "text": "ok", "finish_reason": "stop"}]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        usage = {"prompt_tokens": 3, "completion_tokens": 1}
        await response.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
        return response

    async def chat(request: web.Request) -> web.Response:
        seen.append((request.path, await request.json()))
        return web.json_response({"id": "c", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "alone"}, "finish_reason": "stop"}]})

    async def apply_template(request: web.Request) -> web.Response:
        seen.append((request.path, await request.json()))
        return web.json_response({"prompt": rendered})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    if rendered is not None:
        app.router.add_post("/apply-template", apply_template)
    pod = TestClient(TestServer(app))
    await pod.start_server()
    return pod, seen


CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": False}


async def test_a_chat_with_no_known_template_goes_to_its_pod_alone_as_it_came() -> None:
    pod, seen = await _chat_pod(rendered=None)
    endpoint = f"127.0.0.1:{pod.port}"
    client = TestClient(TestServer(build_app(Coordinator(engines={endpoint: VLLM}))))
    await client.start_server()
    response = await client.post("/v1/chat/completions", data=orjson.dumps(CHAT_BODY), headers={
        "x-gateway-destination-endpoint": endpoint, "x-llmgw-batch": "wait_ms=0; size=8"})
    assert response.status == 200 and (await response.json())["choices"][0]["message"]["content"] == "alone"
    assert seen == [("/v1/chat/completions", CHAT_BODY)]  # never rendered with a guessed template
    await client.close()
    await pod.close()


async def test_llamacpp_renders_the_chat_itself_for_the_merged_call() -> None:
    pod, seen = await _chat_pod(rendered="<|im_start|>system\nYou are SmolLM<|im_end|>\n<|im_start|>user\nhi")
    endpoint = f"127.0.0.1:{pod.port}"
    client = TestClient(TestServer(build_app(Coordinator(engines={endpoint: LLAMACPP}))))
    await client.start_server()
    response = await client.post("/v1/chat/completions", data=orjson.dumps(CHAT_BODY), headers={
        "x-gateway-destination-endpoint": endpoint, "x-llmgw-batch": "wait_ms=0; size=8"})
    assert response.status == 200 and (await response.json())["choices"][0]["message"]["content"] == "ok"
    assert seen[0] == ("/apply-template", {"messages": CHAT_BODY["messages"]})
    assert seen[1][0] == "/v1/completions"
    assert seen[1][1]["prompt"] == ["<|im_start|>system\nYou are SmolLM<|im_end|>\n<|im_start|>user\nhi"]
    await client.close()
    await pod.close()
