"""The batching coordinator's pure parts (merge keys, the merged call, usage shares, each client's
answer), extproc's decision to batch, and the coordinator's window against a scripted pod."""

from __future__ import annotations

import asyncio
import random
import time

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from extproc.accounting import Usage
from extproc.body import can_batch
from extproc.config import parse_config
from extproc.coordinator import merge
from extproc.coordinator.merge import CHAT, COMPLETION, Answer, BatchKey, Member, MergeError, pod_body, shares, split
from extproc.coordinator.server import Coordinator, build_app
from extproc.gateway import Gateway
from extproc.routing.picker import Picker
from extproc.templates import CHATML
from tests.helpers import eventually

CHATS = {"m": CHATML, "llama-3-8b-instruct": CHATML}  # the simulated pod's template, named in the config


def parse(body: bytes, endpoint: str, input_tokens: int) -> tuple[BatchKey, Member]:
    return merge.parse(body, endpoint, input_tokens, CHATS)


def chat(text: str, **extra: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 8, **extra})


def test_requests_merge_only_with_equal_pod_model_limit_and_sampling() -> None:
    key, member = parse(chat("hi", temperature=0.5, stream=True, user="u1"), "10.0.0.1:8000", 9)
    same, _ = parse(chat("other", temperature=0.5, user="u2"), "10.0.0.1:8000", 3)
    assert key == same  # the prompt, stream and user are each client's own
    assert parse(chat("hi", temperature=0.7), "10.0.0.1:8000", 9)[0] != key
    assert parse(chat("hi", temperature=0.5), "10.0.0.2:8000", 9)[0] != key
    assert member.kind == CHAT and member.stream and member.prompt.endswith("<|im_start|>assistant\n")
    completion = parse(orjson.dumps({"model": "m", "prompt": "abc"}), "p:1", 2)[1]
    assert completion.kind == COMPLETION and completion.prompt == "abc"
    for bad in (b"not json", orjson.dumps({"model": "m", "prompt": ["a", "b"]}),
                orjson.dumps({"model": "m", "prompt": "a", "n": 2})):
        with pytest.raises(MergeError):
            parse(bad, "p:1", 1)


def test_the_merged_call_streams_every_prompt_with_the_shared_parameters() -> None:
    key, _ = parse(chat("hi", temperature=0.5, seed=3), "p:1", 1)
    body = orjson.loads(pod_body(key, ["one", "two"]))
    assert body == {"model": "m", "prompt": ["one", "two"], "temperature": 0.5, "seed": 3, "max_tokens": 8,
                    "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(("total", "weights"), [(10, [1, 1, 1]), (7, [5, 0, 2]), (0, [3, 4]), (5, [0, 0]),
                                                (1001, [333, 333, 334])])
def test_usage_shares_add_up_to_the_pods_total(total: int, weights: list[int]) -> None:
    parts = split(total, weights)
    assert sum(parts) == total and all(p >= 0 for p in parts)


def test_each_member_gets_its_share_of_the_pods_usage() -> None:
    members = [parse(chat("a"), "p:1", 10)[1], parse(chat("bb"), "p:1", 30)[1]]
    got = shares({"prompt_tokens": 40, "completion_tokens": 12, "prompt_tokens_details": {"cached_tokens": 16}},
                 members, [4, 8])
    assert got == [Usage(10, 4, 4), Usage(30, 8, 12)]
    assert shares(None, members, [4, 8]) == [Usage(10, 4, 0), Usage(30, 8, 0)]  # the call was cut


def test_answers_take_the_shape_each_client_asked_for() -> None:
    streamed = Answer(parse(chat("hi", stream=True, stream_options={"include_usage": True}), "p:1", 5)[1], "id1", "m")
    events = streamed.delta("Hel", None) + streamed.delta("lo", "length") + streamed.end(Usage(5, 2, 0))
    chunks = [orjson.loads(line[6:]) for line in events.split(b"\n\n") if line.startswith(b"data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:3]] == ["Hel", "lo"]
    assert chunks[2]["choices"][0]["finish_reason"] == "length" and chunks[3]["usage"]["total_tokens"] == 7
    assert events.endswith(b"data: [DONE]\n\n")
    plain = Answer(parse(orjson.dumps({"model": "m", "prompt": "x"}), "p:1", 1)[1], "id2", "m")
    assert plain.delta("abc", "stop") == b""
    body = orjson.loads(plain.end(Usage(1, 1, 0)))
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "abc"


def test_extproc_batches_only_what_can_share_a_call() -> None:
    assert can_batch(orjson.loads(chat("hi")))
    for extra in ({"n": 2}, {"tools": [{"type": "function", "function": {"name": "f"}}]},
                  {"response_format": {"type": "json_object"}}, {"logprobs": True}):
        assert not can_batch(orjson.loads(chat("hi", **extra)))
    image = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}
    assert not can_batch(image)
    assert not can_batch({"model": "m", "input": "embed me"})


DOCUMENT = {
    "server": {"coordinator": "127.0.0.1:8081"},
    "pools": [{"name": "gpu", "endpoints": ["10.0.0.1:8000"], "batching": {"enabled": True}}],
    "models": [{"name": "m", "pool": "gpu", "chat_template": "chatml"}],
    "tenants": [{"name": "t", "keys": [{"env": "KEY"}], "qos": ["balanced", "realtime"]}],
}


def _route(gateway: Gateway, qos: str, body: bytes) -> dict[str, str]:
    state = gateway.new_request()
    gateway.request_headers(state, {":method": "POST", ":path": "/v1/chat/completions",
                                    "content-type": "application/json", "authorization": "Bearer sk-test",
                                    "x-llmgw-qos": qos}, False)
    return dict(gateway.request_body(state, body).set_headers)


@pytest.mark.parametrize(("qos", "body", "route"), [
    ("balanced", chat("hi"), "batch"),
    ("realtime", chat("hi"), "direct"),
    ("balanced", chat("hi", n=2), "direct"),
])
def test_the_route_depends_on_the_class_and_the_body(qos: str, body: bytes, route: str) -> None:
    gateway = Gateway(parse_config(DOCUMENT, env={"KEY": "sk-test"}), Picker(random.Random(0)))
    headers = _route(gateway, qos, body)
    assert headers["x-llmgw-route"] == route
    assert ("x-llmgw-batch" in headers) == (route == "batch")
    if route == "batch":
        assert headers["x-llmgw-batch"] == "wait_ms=50; size=32; tokens=4096; group=0.72"
    gateway.router.health.probed("127.0.0.1:8081", False)  # the coordinator stops answering its probe
    assert _route(gateway, qos, body)["x-llmgw-route"] == "direct"


# -- the window, against a scripted pod ------------------------------------------------------------

class ScriptedPod:
    """Answers merged completion calls; holds each call until released; records the prompt lists."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.release = asyncio.Event()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append(body["prompt"])
        await self.release.wait()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i, _ in enumerate(body["prompt"]):
            chunk = {"choices": [{"index": i, "text": f"answer {i}", "finish_reason": "stop"}]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        usage = {"prompt_tokens": 3 * len(body["prompt"]), "completion_tokens": len(body["prompt"])}
        await response.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
        return response


async def _serve(handler: object) -> TestClient:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)  # type: ignore[arg-type]
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def test_requests_arriving_while_the_pod_is_busy_leave_together() -> None:
    pod = ScriptedPod()
    pod_client = await _serve(pod.completions)
    endpoint = f"127.0.0.1:{pod_client.port}"
    coordinator = Coordinator(templates=CHATS)
    client = TestClient(TestServer(build_app(coordinator)))
    await client.start_server()
    headers = {"x-gateway-destination-endpoint": endpoint, "x-llmgw-batch": "wait_ms=5000; size=3; tokens=4096",
               "x-llmgw-input-tokens": "3"}

    async def ask(i: int) -> dict:
        response = await client.post("/v1/completions", headers=headers,
                                     data=orjson.dumps({"model": "m", "prompt": f"p{i}", "max_tokens": 4}))
        return {"status": response.status, "size": response.headers["x-llmgw-batch-size"], **(await response.json())}

    first = asyncio.create_task(ask(0))  # the pod is idle: it leaves at once, alone
    await eventually(lambda: pod.calls, what="the first call at the pod")
    rest = [asyncio.create_task(ask(i)) for i in (1, 2, 3)]  # the pod is busy: they wait, and fill a batch
    await eventually(lambda: len(pod.calls) >= 2, what="the batch at the pod")
    pod.release.set()
    answers = [await first, *[await task for task in rest]]
    assert pod.calls == [["p0"], ["p1", "p2", "p3"]]  # size 3 reached long before the 5 s window
    assert [a["size"] for a in answers] == ["1", "3", "3", "3"]
    assert [a["choices"][0]["text"] for a in answers] == ["answer 0", "answer 0", "answer 1", "answer 2"]
    assert all(a["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                              "prompt_tokens_details": {"cached_tokens": 0}} for a in answers)
    metrics = await (await client.get("/metrics")).text()
    assert 'llmgw_batch_departures_total{reason="room"} 1.0' in metrics
    assert 'llmgw_batch_departures_total{reason="full"} 1.0' in metrics
    assert 'llmgw_batch_size_sum{gen_ai_request_model="m",protocol="http"} 4.0' in metrics
    await client.close()
    await pod_client.close()


class FlakyPod:
    """Streams one chunk per prompt, then drops the connection (a pod dying mid-batch)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append(body)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i, _ in enumerate(body["prompt"]):
            chunk = {"choices": [{"index": i, "text": f"start{i} ", "finish_reason": None}]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        request.transport.close()  # cut mid-answer
        return response


class SteadyPod(ScriptedPod):
    """Answers at once, and keeps every call's body."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict] = []
        self.release.set()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        return await super().completions(request)


async def test_a_batch_cut_mid_answer_is_resumed_on_the_fallback_pod() -> None:
    flaky, steady = FlakyPod(), SteadyPod()
    flaky_client, steady_client = await _serve(flaky.completions), await _serve(steady.completions)
    picks = f"127.0.0.1:{flaky_client.port},127.0.0.1:{steady_client.port}"
    client = TestClient(TestServer(build_app(Coordinator(templates=CHATS))))
    await client.start_server()
    headers = {"x-gateway-destination-endpoint": picks, "x-llmgw-batch": "wait_ms=0", "x-llmgw-input-tokens": "2"}
    streamed = await client.post("/v1/completions", headers=headers, data=orjson.dumps(
        {"model": "m", "prompt": "tell me", "max_tokens": 10, "stream": True}))
    text = "".join(orjson.loads(line[6:])["choices"][0]["text"] for line in (await streamed.read()).split(b"\n\n")
                   if line.startswith(b"data: {") and b'"choices":[{' in line)
    assert text == "start0 answer 0"  # the client's stream simply continues
    assert steady.bodies[0]["prompt"] == ["tell me" + "start0 "] and steady.bodies[0]["max_tokens"] == 9
    for c in (client, flaky_client, steady_client):
        await c.close()


class CuttingPod:
    """Streams ``words`` one-word chunks per prompt, then drops the connection (a pod dying mid-batch)."""

    def __init__(self, words: int) -> None:
        self.words = words

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for word in range(self.words):
            for i, _ in enumerate(body["prompt"]):
                chunk = {"choices": [{"index": i, "text": f" w{word}", "finish_reason": None}]}
                await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        request.transport.close()
        return response


class WordPod:
    """Counts a word a token; answers a call only once ``together`` calls are in (then all of them)."""

    def __init__(self, together: int) -> None:
        self.bodies: list[dict] = []
        self.all_in = asyncio.Event()
        self.together = together

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if len(self.bodies) == self.together:
            self.all_in.set()
        await self.all_in.wait()
        (prompt,) = body["prompt"]
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"choices": [{"index": 0, "text": " x" * body["max_tokens"], "finish_reason": "length"}]}
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": body["max_tokens"]}
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\ndata: " +
                             orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
        return response


async def _cut_batch(words: int, fallback: WordPod, prompts: list[str], max_tokens: int) -> list[dict]:
    """Two plain clients merged into one call to a pod that dies after ``words`` words each."""
    cutting = await _serve(CuttingPod(words).completions)
    steady = await _serve(fallback.completions)
    client = TestClient(TestServer(build_app(Coordinator(templates=CHATS))))
    await client.start_server()
    headers = {"x-gateway-destination-endpoint": f"127.0.0.1:{cutting.port},127.0.0.1:{steady.port}",
               "x-llmgw-batch": f"wait_ms=5000; size={len(prompts)}", "x-llmgw-input-tokens": "2"}

    async def ask(prompt: str) -> dict:
        response = await client.post("/v1/completions", headers=headers, data=orjson.dumps(
            {"model": "m", "prompt": prompt, "max_tokens": max_tokens}))
        assert response.status == 200 and response.headers["x-llmgw-batch-size"] == str(len(prompts))
        return await response.json()

    try:
        async with asyncio.timeout(10):
            return list(await asyncio.gather(*(ask(p) for p in prompts)))
    finally:
        for c in (client, cutting, steady):
            await c.close()


async def test_cut_members_are_resumed_together_and_count_what_they_got_as_completion() -> None:
    fallback = WordPod(together=2)  # answers only once both retries are in: none waits for the other's
    answers = await _cut_batch(2, fallback, ["tell me", "ask you"], max_tokens=5)
    assert sorted(b["prompt"] for b in fallback.bodies) == [["ask you w0 w1"], ["tell me w0 w1"]]
    assert [b["max_tokens"] for b in fallback.bodies] == [3, 3]  # 5, less the 2 it had
    for answer in answers:
        assert answer["choices"][0]["text"] == " w0 w1 x x x"
        # Its own prompt (2 words) and all 5 words of its answer; the retry's pod counted the 2 it
        # had before as prompt.
        assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]) == (2, 5)


async def test_a_member_cut_after_its_last_token_is_complete_without_a_retry() -> None:
    fallback = WordPod(together=1)
    answers = await _cut_batch(4, fallback, ["tell me", "ask you"], max_tokens=4)
    assert fallback.bodies == []  # not asked for one more token past max_tokens
    for answer in answers:
        assert answer["choices"][0] == {"index": 0, "text": " w0 w1 w2 w3", "logprobs": None,
                                        "finish_reason": "length"}
        assert answer["usage"]["completion_tokens"] == 4


async def test_a_failing_pod_and_a_failing_retry_end_in_a_clear_error() -> None:
    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    pod = await _serve(broken)
    client = TestClient(TestServer(build_app(Coordinator(templates=CHATS))))
    await client.start_server()
    headers = {"x-gateway-destination-endpoint": f"127.0.0.1:{pod.port}", "x-llmgw-batch": "wait_ms=0"}
    response = await client.post("/v1/completions", headers=headers,
                                 data=orjson.dumps({"model": "m", "prompt": "x", "max_tokens": 3}))
    assert response.status == 502 and (await response.json())["error"]["code"] == "upstream_failed"
    await client.close()
    await pod.close()


# -- the adaptive window ---------------------------------------------------------------------------

def test_the_window_grows_after_full_batches_and_shrinks_when_pods_idle() -> None:
    from extproc.coordinator.window import FULL, ROOM, WINDOW, AdaptiveWindow

    window = AdaptiveWindow()
    assert window.wait_s(0.05, queued=1, size=32) == pytest.approx(0.05)
    window.departed(FULL)
    assert window.factor == 1.0  # one overflow is not a trend
    for _ in range(10):
        window.departed(FULL)
    assert window.factor == pytest.approx(2.0)  # grown by 1.2x a step, capped at twice the setting
    window.departed(WINDOW)
    for _ in range(30):
        window.departed(ROOM)
    assert window.factor == pytest.approx(0.1)
    assert window.reasons == {FULL: 11, WINDOW: 1, ROOM: 30}


def test_the_window_never_waits_longer_than_a_call_or_than_filling_takes() -> None:
    from extproc.coordinator.window import AdaptiveWindow

    window = AdaptiveWindow()
    for i in range(20):  # 100 requests per second
        window.arrived(i * 0.01)
    assert window.arrival_rate == pytest.approx(100.0)
    assert window.wait_s(1.0, queued=2, size=4) == pytest.approx(0.02)  # two more come in 20 ms
    window.answered(0.005)
    assert window.wait_s(1.0, queued=2, size=4) == pytest.approx(0.005)  # the pod is faster than that


def test_a_batch_class_request_yields_to_later_ones_but_not_forever() -> None:
    from extproc.coordinator.server import Pending, _rank

    key, member = parse(chat("x"), "p:1", 1)

    def pending(qos: str, arrived: float) -> Pending:
        return Pending(key, member, Answer(member, "id", "m"), None, 0.05, 32, 4096, qos, arrived=arrived)

    old_batch, newer, much_later = pending("batch", 10.0), pending("balanced", 10.5), pending("balanced", 11.5)
    assert sorted([old_batch, newer, much_later], key=_rank) == [newer, old_batch, much_later]


async def test_one_span_per_batch_linked_to_its_members_and_parent_of_the_pod_call() -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from extproc.telemetry.tracing import RequestTracer

    pod, seen = SteadyPod(), []
    pod.release.clear()

    async def recording(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        return await pod.completions(request)

    pod_client = await _serve(recording)
    exporter = InMemorySpanExporter()
    client = TestClient(TestServer(build_app(Coordinator(tracer=RequestTracer(SimpleSpanProcessor(exporter))))))
    await client.start_server()
    endpoint = f"127.0.0.1:{pod_client.port}"
    members = [("a" * 32, "1" * 16, "01"), ("b" * 32, "2" * 16, "00")]  # sampled, and not

    async def ask(i: int) -> None:
        trace, span, flags = members[i]
        response = await client.post("/v1/completions", data=orjson.dumps({"model": "m", "prompt": f"p{i}"}), headers={
            "x-gateway-destination-endpoint": endpoint, "x-llmgw-batch": "wait_ms=5000; size=2",
            "traceparent": f"00-{trace}-{span}-{flags}"})
        assert response.status == 200

    tasks = [asyncio.create_task(ask(i)) for i in range(2)]
    await eventually(lambda: pod.bodies, what="the batch at the pod")
    pod.release.set()
    await asyncio.gather(*tasks)
    (span,) = exporter.get_finished_spans()
    assert span.name == "batch m" and span.attributes["llmgw.batch.size"] == 2
    assert [(f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") for link in span.links] == \
        [("a" * 32, "1" * 16)]  # only sampled members' spans
    assert seen[0]["traceparent"] == f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-01"
    assert seen[0]["baggage"] == f"llmgw.batch_id={span.attributes['llmgw.batch.id']}"
    await client.close()
    await pod_client.close()


async def test_pods_that_speak_the_batch_protocol_get_one_call_with_each_prompts_own_parameters() -> None:
    from extproc.coordinator.merge import PROTOCOL, protocol_key
    from extproc.coordinator.server import Pending
    from extproc.resources import DEFAULT_TOKENIZER
    from llmgw_sim import SimOptions
    from llmgw_sim import build_app as build_pod
    from llmgw_sim.tokens import SimTokenizer

    pod_app = build_pod(SimOptions(time_scale=0.0, batch_grpc_port=0, record=10),
                        SimTokenizer.from_spec(DEFAULT_TOKENIZER))
    pod = TestClient(TestServer(pod_app))
    await pod.start_server()
    endpoint = f"127.0.0.1:{pod.port}"
    coordinator = Coordinator(templates=CHATS)
    client = TestClient(TestServer(build_app(coordinator)))
    await client.start_server()
    headers = {"x-gateway-destination-endpoint": endpoint, "x-llmgw-batch": "wait_ms=0"}
    first = await client.post("/v1/completions", headers=headers,
                              data=orjson.dumps({"model": "llama-3-8b-instruct", "prompt": "hi", "max_tokens": 2}))
    assert first.status == 200  # over HTTP: the pod's answer to "do you speak it?" was not in yet
    await eventually(lambda: coordinator._protocols.get(endpoint, (None, 0))[0] is not None, 5,
                     what="the pod's answer to \"do you speak the batch protocol?\"")

    bodies = [{"prompt": "one", "max_tokens": 3, "temperature": 0.1},
              {"prompt": "two", "max_tokens": 5, "temperature": 0.9, "seed": 7},
              {"messages": [{"role": "user", "content": "three"}], "max_tokens": 7, "stream": True,
               "stream_options": {"include_usage": True}}]
    batch = []
    for body in bodies:
        key, member = parse(orjson.dumps({"model": "llama-3-8b-instruct", "ignore_eos": True, **body}), endpoint, 0)
        shared = protocol_key(key, member)
        assert shared is not None and shared.sampling == PROTOCOL
        batch.append(Pending(shared, member, Answer(member, f"id{len(batch)}", shared.model), None, 0, 32, 4096))
    assert len({p.key for p in batch}) == 1  # different parameters, one queue
    await coordinator._send(batch[0].key, batch)
    outputs = []
    for pending in batch:
        parts = []
        while (chunk := await pending.out.get()) is not None:
            parts.append(chunk)
        outputs.append(b"".join(parts))
    plain = [orjson.loads(out) for out in outputs[:2]]
    assert [p["usage"]["completion_tokens"] for p in plain] == [3, 5]  # exact, from the protocol
    streamed = [orjson.loads(line[6:]) for line in outputs[2].split(b"\n\n") if line.startswith(b"data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"])
    assert streamed[-1]["usage"]["completion_tokens"] == 7  # a delta may hold several steps' tokens
    calls = [r for r in (await (await pod.get("/debug/requests")).json())["requests"] if "batch" in str(r).lower()]
    assert calls  # the gRPC call is in the pod's record
    await client.close()
    await pod.close()


async def _protocol_pod(**options: object) -> tuple[TestClient, int]:
    """An in-process simulated pod serving the batch protocol: its HTTP client and its gRPC port."""
    from extproc.resources import DEFAULT_TOKENIZER
    from llmgw_sim import SIM_POD, SimOptions
    from llmgw_sim import build_app as build_pod
    from llmgw_sim.tokens import SimTokenizer

    app = build_pod(SimOptions(time_scale=0.0, batch_grpc_port=0, **options),  # type: ignore[arg-type]
                    SimTokenizer.from_spec(DEFAULT_TOKENIZER))
    pod = TestClient(TestServer(app))
    await pod.start_server()
    port = app[SIM_POD].batch_grpc_port
    assert port is not None
    return pod, port


async def _protocol_known(coordinator: Coordinator, endpoint: str, address: str) -> None:
    def known() -> bool:
        if coordinator._protocols.get(endpoint, (None, 0.0))[0] == address:
            return True
        coordinator._protocol_address(endpoint)  # asks again once the old answer is forgotten
        return False

    await eventually(known, 5, what=f"the batch protocol of {endpoint} at {address}", interval=0.01)


async def test_a_pod_gone_from_its_batch_protocol_address_is_asked_again() -> None:
    from extproc.launcher import free_port

    pod, grpc_port = await _protocol_pod()
    endpoint = f"127.0.0.1:{pod.port}"
    coordinator = Coordinator(templates=CHATS)
    client = TestClient(TestServer(build_app(coordinator)))
    await client.start_server()
    # What it learnt before the pod was started again elsewhere: nothing listens there now.
    stale = f"127.0.0.1:{free_port()}"
    coordinator._protocols[endpoint] = (stale, time.monotonic())
    headers = {"x-gateway-destination-endpoint": endpoint, "x-llmgw-batch": "wait_ms=0"}
    body = orjson.dumps({"model": "llama-3-8b-instruct", "prompt": "hi", "max_tokens": 2})
    assert (await client.post("/v1/completions", headers=headers, data=body)).status == 200  # retried over HTTP
    assert coordinator._protocols.get(endpoint, (None,))[0] != stale  # not trusted for PROTOCOL_RECHECK_S
    await _protocol_known(coordinator, endpoint, f"127.0.0.1:{grpc_port}")
    assert (await client.post("/v1/completions", headers=headers, data=body)).status == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'llmgw_batch_size_count{gen_ai_request_model="llama-3-8b-instruct",protocol="llmgw.v1"} 2.0' in metrics
    await client.close()
    await pod.close()


async def test_a_silent_batch_protocol_call_fails_like_a_silent_http_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from extproc.coordinator import server
    from llmgw_sim.faults import FaultConfig

    monkeypatch.setattr(server, "POD_SILENCE_S", 0.3)
    pod, grpc_port = await _protocol_pod(faults=FaultConfig(hang_rate=1.0))  # accepts calls, never answers
    endpoint = f"127.0.0.1:{pod.port}"
    coordinator = Coordinator(templates=CHATS)
    client = TestClient(TestServer(build_app(coordinator)))
    await client.start_server()
    await _protocol_known(coordinator, endpoint, f"127.0.0.1:{grpc_port}")
    headers = {"x-gateway-destination-endpoint": endpoint, "x-llmgw-batch": "wait_ms=0"}
    async with asyncio.timeout(10):  # the call, then its retry over HTTP, each given up after 0.3 s
        response = await client.post("/v1/completions", headers=headers, data=orjson.dumps(
            {"model": "llama-3-8b-instruct", "prompt": "hi", "max_tokens": 2}))
        assert response.status == 502 and (await response.json())["error"]["code"] == "upstream_failed"
    metrics = await (await client.get("/metrics")).text()
    assert 'llmgw_batch_size_count{gen_ai_request_model="llama-3-8b-instruct",protocol="llmgw.v1"} 1.0' in metrics
    await client.close()
    await pod.close()


async def test_a_bug_in_a_batch_answers_its_members_with_a_500_not_silence() -> None:
    class Broken(Coordinator):
        async def _call(self, *args: object, **kwargs: object) -> list:  # type: ignore[override]
            raise RuntimeError("a bug")

    client = TestClient(TestServer(build_app(Broken())))
    await client.start_server()
    headers = {"x-gateway-destination-endpoint": "127.0.0.1:9", "x-llmgw-batch": "wait_ms=0"}
    plain = await client.post("/v1/completions", headers=headers,
                              data=orjson.dumps({"model": "m", "prompt": "x", "max_tokens": 3}))
    assert plain.status == 500 and (await plain.json())["error"]["code"] == "internal_error"
    streamed = await client.post("/v1/completions", headers=headers,
                                 data=orjson.dumps({"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}))
    assert b'"code":"internal_error"' in await streamed.read()
    await client.close()
