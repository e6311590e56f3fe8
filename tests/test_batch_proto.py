"""The batch protocol (``protos/llmgw/v1/batch.proto``): its generated code is current, and the
simulated pod serves it as its HTTP API would answer each item alone."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from extproc.protos import generate as protogen
from extproc.protos.llmgw.v1 import batch_pb2, batch_pb2_grpc
from extproc.resources import DEFAULT_TOKENIZER
from llmgw_sim import SIM_POD, SimOptions, SimPod, build_app
from llmgw_sim.batch_protocol import DeltaCursor, batch_problem, item_body
from llmgw_sim.costmodel import CostParams
from llmgw_sim.faults import FaultConfig
from llmgw_sim.generate import OutputPlan
from llmgw_sim.scheduler import SimSequence
from llmgw_sim.tokens import SimTokenizer
from tests.helpers import eventually

REPO = Path(__file__).resolve().parents[1]
MODEL = "llama-3-8b-instruct"
Item = batch_pb2.BatchItem
Params = batch_pb2.SamplingParams


# -- generated code ---------------------------------------------------------------------------

def test_generated_code_is_current() -> None:
    fresh = protogen.generate()
    committed = protogen.committed_files()
    stale = sorted(str(p) for p in fresh.keys() | committed.keys() if fresh.get(p) != committed.get(p))
    assert not stale, (f"generated code under extproc/protos/ differs from protos/ for {stale}: "
                       "run `python -m extproc.protos.generate` (with the grpcio-tools of the dev extras)")


def test_generated_imports_name_the_package() -> None:
    # grpcio-tools writes "from llmgw.v1 import batch_pb2"; that only imports with protos/ on sys.path.
    grpc_module = protogen.generate()[Path("llmgw/v1/batch_pb2_grpc.py")].decode()
    assert "from extproc.protos.llmgw.v1 import batch_pb2 as" in grpc_module
    assert "\nfrom llmgw" not in grpc_module


# -- the pure translation ---------------------------------------------------------------------

@pytest.mark.parametrize(("item", "batch_model", "body"), [
    pytest.param(Item(index=0, text="hi"), "", {"prompt": "hi", "stop": [], "ignore_eos": False, "min_tokens": 0},
                 id="unset-parameters-are-left-out"),
    pytest.param(Item(index=1, token_ids=batch_pb2.TokenIds(ids=[5, 6]), model="lora-a",
                      params=Params(max_tokens=4, temperature=0.0, top_p=0.5, seed=-3, stop=["."],
                                    ignore_eos=True, min_tokens=2)), "base",
                 {"prompt": [5, 6], "model": "lora-a", "max_tokens": 4, "temperature": 0.0, "top_p": 0.5,
                  "seed": -3, "stop": ["."], "ignore_eos": True, "min_tokens": 2},
                 id="every-parameter-and-the-item-model-wins"),
    pytest.param(Item(index=2, params=Params(max_tokens=0)), "base",
                 {"model": "base", "max_tokens": 0, "stop": [], "ignore_eos": False, "min_tokens": 0},
                 id="no-prompt-and-max-tokens-0-are-left-for-the-http-checks"),
])
def test_item_body(item: batch_pb2.BatchItem, batch_model: str, body: dict[str, object]) -> None:
    assert item_body(item, batch_model) == body


@pytest.mark.parametrize(("indices", "problem"), [
    pytest.param([], "items: a batch needs at least one item", id="empty"),
    pytest.param([0, 7, 7], "items[2].index: 7 is used by an earlier item", id="repeated-index"),
    pytest.param([3, 1, 2], None, id="any-order"),
])
def test_batch_problem(indices: list[int], problem: str | None) -> None:
    request = batch_pb2.GenerateRequest(items=[Item(index=i, text="x") for i in indices])
    assert batch_problem(request) == problem


def test_delta_cursor_merges_steps_and_ends_with_usage() -> None:
    plans = [OutputPlan([1, 2, 3], [" a", " b", " c"], "length"), OutputPlan([4, 5], [" d", ""], "stop", "x")]
    seqs = [SimSequence(prompt_len=20, block_hashes=[], output_len=3, cached_tokens=16),
            SimSequence(prompt_len=5, block_hashes=[], output_len=2)]
    cursor = DeltaCursor([9, 4], plans, seqs, [20, 5])
    assert [(d.index, d.text) for d in cursor.take([2, 1])] == [(9, " a b"), (4, " d")]
    assert cursor.take([2, 1]) == []  # nothing new
    last = cursor.take([3, 2])
    assert [(d.index, d.text, d.finish_reason, d.stop_reason) for d in last] == [
        (9, " c", "length", ""), (4, "", "stop", "x")]  # a final delta is sent even without text
    assert (last[0].usage.prompt_tokens, last[0].usage.completion_tokens, last[0].usage.cached_tokens) == (20, 3, 16)


# -- the simulated pod ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer() -> SimTokenizer:
    return SimTokenizer.from_spec(DEFAULT_TOKENIZER)


@dataclass
class Pod:
    """An in-process pod: its HTTP test client, its ``SimPod`` and a stub on its gRPC port."""

    http: TestClient
    sim: SimPod
    stub: batch_pb2_grpc.BatchGenerationStub

    async def post(self, path: str, body: object) -> dict[str, object]:
        resp = await self.http.post(path, data=orjson.dumps(body))
        assert resp.status == 200, await resp.text()
        return await resp.json()

    async def metric(self, name: str) -> float:
        text = await (await self.http.get("/metrics")).text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith((name + "{", name + " ")))


PodFactory = Callable[..., Awaitable[Pod]]


@pytest.fixture
async def make_pod(tokenizer: SimTokenizer) -> AsyncIterator[PodFactory]:
    """``await make_pod(time_scale=0.0, ...)``: a pod with the batch protocol on a free port."""
    started: list[tuple[TestClient, grpc.aio.Channel]] = []

    async def factory(**overrides: object) -> Pod:
        fields: dict[str, object] = {"time_scale": 0.0, "batch_grpc_port": 0, **overrides}
        app = build_app(SimOptions(**fields), tokenizer)  # type: ignore[arg-type]
        http = TestClient(TestServer(app))
        await http.start_server()
        sim = app[SIM_POD]
        assert sim.batch_grpc_port
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{sim.batch_grpc_port}")
        started.append((http, channel))
        return Pod(http, sim, batch_pb2_grpc.BatchGenerationStub(channel))

    yield factory
    for http, channel in started:
        await channel.close()
        await http.close()


@dataclass
class ItemResult:
    """What the stream said about one index."""

    text: str = ""
    deltas: int = 0
    finish_reason: str = ""
    stop_reason: str = ""
    usage: batch_pb2.Usage | None = None
    error: batch_pb2.Error | None = None
    responses: list[int] = field(default_factory=list)  # which responses carried its deltas


async def run_batch(pod: Pod, items: list[batch_pb2.BatchItem], model: str = "") -> dict[int, ItemResult]:
    """Call Generate and gather the stream per index; nothing may follow an item's last delta."""
    results: dict[int, ItemResult] = {}
    number = 0
    async for response in pod.stub.Generate(batch_pb2.GenerateRequest(model=model, batch_id="b1", items=items)):
        assert response.deltas, "a response carries at least one delta"
        for delta in response.deltas:
            result = results.setdefault(delta.index, ItemResult())
            assert not (result.finish_reason or result.error), f"index {delta.index}: delta after its last"
            result.deltas += 1
            result.text += delta.text
            result.responses.append(number)
            result.finish_reason, result.stop_reason = delta.finish_reason, delta.stop_reason
            if delta.HasField("usage"):
                result.usage = delta.usage
            if delta.HasField("error"):
                result.error = delta.error
        number += 1
    return results



STORY = "Once upon a time in a land far away there lived a king who had three daughters and a dragon."


async def test_items_with_their_own_parameters_answer_as_http_would(make_pod: PodFactory,
                                                                    tokenizer: SimTokenizer) -> None:
    pod = await make_pod()
    # (prompt, params): different max_tokens, seeds and temperatures, one ignore_eos, one stop string.
    cases = [
        (STORY, Params(max_tokens=3, seed=1)),
        ("Write a haiku about the sea.", Params(max_tokens=40, seed=2, temperature=0.0)),
        ("List three colours.", Params(max_tokens=17, seed=3, ignore_eos=True)),
        (STORY + " The end.", Params(max_tokens=1, seed=4)),
        ("Count to ten.", Params(max_tokens=25, seed=5, temperature=1.5, stop=[","])),
    ]
    items = [Item(index=10 + i, text=prompt, params=params, request_id=f"r{i}")
             for i, (prompt, params) in enumerate(cases)]
    results = await run_batch(pod, items)
    assert sorted(results) == [10, 11, 12, 13, 14]  # every index, and only those

    for i, (prompt, params) in enumerate(cases):
        got = results[10 + i]
        assert got.error is None and got.usage is not None and got.deltas >= 1
        http = await pod.post("/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": params.max_tokens, "seed": params.seed,
            "temperature": params.temperature if params.HasField("temperature") else 1.0,
            "ignore_eos": params.ignore_eos, "stop": list(params.stop)})
        choice, usage = http["choices"][0], http["usage"]
        # The same prompt and seed through /v1/completions: the same text, reason and counts.
        assert (got.text, got.finish_reason) == (choice["text"], choice["finish_reason"]), f"item {i}"
        assert got.stop_reason == (choice["stop_reason"] or "")
        assert got.usage.prompt_tokens == usage["prompt_tokens"]
        assert got.usage.completion_tokens == usage["completion_tokens"] <= params.max_tokens
        if not params.stop:  # the text re-encodes to exactly the tokens counted
            assert len(tokenizer.encode_texts([got.text])[0]) == got.usage.completion_tokens
        if got.finish_reason == "length":
            assert got.usage.completion_tokens == params.max_tokens
    assert results[12].finish_reason == "length" and results[12].usage.completion_tokens == 17  # ignore_eos
    assert results[13].finish_reason == "length" and results[13].usage.completion_tokens == 1

    # Cached tokens come from the same prefix cache as HTTP's: the story's blocks are cached now.
    again = await run_batch(pod, [Item(index=0, text=STORY, params=Params(max_tokens=1))])
    http = await pod.post("/v1/completions", {"model": MODEL, "prompt": STORY, "max_tokens": 1})
    cached = again[0].usage.cached_tokens
    assert cached == http["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert await pod.metric("vllm:num_requests_running") == 0


async def test_token_id_prompts_and_the_batch_model(make_pod: PodFactory) -> None:
    pod = await make_pod(model="base", extra_models=("alias",))
    results = await run_batch(pod, [
        Item(index=0, token_ids=batch_pb2.TokenIds(ids=[100, 200, 300]), params=Params(max_tokens=2, ignore_eos=True)),
        Item(index=1, text="x", model="base", params=Params(max_tokens=2, ignore_eos=True)),
    ], model="alias")
    assert results[0].usage.prompt_tokens == 3 and results[0].usage.completion_tokens == 2
    assert results[1].usage.completion_tokens == 2


async def test_items_share_engine_batches(make_pod: PodFactory) -> None:
    # The static engine runs one batch until its longest member is done: four items of 2..8
    # tokens take 8 steps together, and would take 2 + 4 + 6 + 8 = 20 one after another.
    pod = await make_pod(engine="static")
    items = [Item(index=i, text=f"prompt {i}", params=Params(max_tokens=2 * (i + 1), ignore_eos=True))
             for i in range(4)]
    results = await run_batch(pod, items)
    assert [results[i].usage.completion_tokens for i in range(4)] == [2, 4, 6, 8]
    assert await pod.metric("vllm:iteration_tokens_total_count") == 8
    assert all(r.responses[0] == 0 for r in results.values())  # all four spoke in the first step


async def test_cancelling_the_call_aborts_its_sequences(make_pod: PodFactory) -> None:
    cost = CostParams(decode_base_s=0.01, decode_per_seq_s=0.0, prefill_per_token_s=0.0)
    pod = await make_pod(time_scale=1.0, cost=cost)
    items = [Item(index=i, text=STORY, params=Params(max_tokens=1000, ignore_eos=True)) for i in range(3)]
    call = pod.stub.Generate(batch_pb2.GenerateRequest(items=items))
    first = await call.read()
    assert {d.index for d in first.deltas} == {0, 1, 2}
    assert await pod.metric("vllm:num_requests_running") == 3
    assert await pod.metric("vllm:kv_cache_usage_perc") > 0
    call.cancel()

    async def freed() -> bool:
        return (await pod.metric("vllm:num_requests_running") == 0
                and await pod.metric("vllm:kv_cache_usage_perc") == 0)

    await eventually(freed)
    text = await (await pod.http.get("/metrics")).text()
    aborted = [line for line in text.splitlines()
               if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line]
    assert len(aborted) == 1 and aborted[0].endswith(" 3.0")


async def test_a_refused_item_does_not_fail_the_others(make_pod: PodFactory) -> None:
    pod = await make_pod(max_model_len=64)
    long_prompt = "word " * 100  # past the 64-token context
    results = await run_batch(pod, [
        Item(index=0, text="fine", params=Params(max_tokens=3, ignore_eos=True)),
        Item(index=1, text=long_prompt),
        Item(index=2, text="fine", model="no-such-model"),
        Item(index=3, params=Params(max_tokens=1)),  # no prompt
        Item(index=4, text="also fine", params=Params(max_tokens=2, ignore_eos=True)),
        Item(index=5, text="fine", params=Params(max_tokens=0)),
    ])
    # (status, type, param) as /v1/completions answers each alone
    expected_errors = {
        1: (400, "BadRequestError", "prompt"),  # longer than max_model_len
        2: (404, "NotFoundError", "model"),
        3: (400, "BadRequestError", "prompt"),  # prompt is required
        5: (400, "BadRequestError", "max_tokens"),  # at least 1
    }
    for index, (status, err_type, param) in expected_errors.items():
        error = results[index].error
        assert error is not None and (error.status, error.type, error.param) == (status, err_type, param), index
        assert results[index].deltas == 1 and results[index].responses == [0]  # at once, before any text
    assert "maximum context length is 64 tokens" in results[1].error.message
    assert results[0].usage.completion_tokens == 3 and results[4].usage.completion_tokens == 2
    assert results[0].error is None and results[4].error is None


@pytest.mark.parametrize(("items", "detail"), [
    pytest.param([], "items: a batch needs at least one item", id="empty"),
    pytest.param([Item(index=1, text="a"), Item(index=1, text="b")], "items[1].index: 1 is used by an earlier item",
                 id="repeated-index"),
])
async def test_a_malformed_call_is_invalid_argument(make_pod: PodFactory, items: list[batch_pb2.BatchItem],
                                                    detail: str) -> None:
    pod = await make_pod()
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await run_batch(pod, items)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert failed.value.details() == detail


async def test_an_injected_failure_fails_the_call(make_pod: PodFactory) -> None:
    pod = await make_pod(faults=FaultConfig(error_rate=1.0))
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await run_batch(pod, [Item(index=0, text="x", params=Params(max_tokens=1))])
    assert failed.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)


async def test_calls_are_recorded(make_pod: PodFactory) -> None:
    pod = await make_pod(record=4)
    await run_batch(pod, [Item(index=0, text="x", params=Params(max_tokens=1))], model=MODEL)
    recorded = (await (await pod.http.get("/debug/requests")).json())["requests"]
    assert recorded[-1]["path"] == "/llmgw.v1.BatchGeneration/Generate"
    assert recorded[-1]["body"] == {"model": MODEL, "batch_id": "b1",
                                    "items": [{"text": "x", "params": {"max_tokens": 1}}]}


async def test_the_pod_declares_the_protocol_over_http(make_pod: PodFactory, tokenizer: SimTokenizer) -> None:
    pod = await make_pod()
    info = await (await pod.http.get("/llmgw/v1/batch")).json()
    assert info == {"service": "llmgw.v1.BatchGeneration", "grpc_port": pod.sim.batch_grpc_port}
    plain = TestClient(TestServer(build_app(SimOptions(time_scale=0.0), tokenizer)))
    await plain.start_server()
    try:
        assert (await plain.get("/llmgw/v1/batch")).status == 404  # as vLLM answers: use its HTTP API
    finally:
        await plain.close()


def test_cli_announces_the_port_before_ready() -> None:
    with tempfile.TemporaryFile("w+") as stderr:  # a file: a chatty pod never blocks on a pipe
        proc = subprocess.Popen([sys.executable, "-m", "llmgw_sim", "--port", "0", "--batch-grpc-port", "0",
                                 "--time-scale", "0"], cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True)
        _check_cli(proc)


def _check_cli(proc: subprocess.Popen[str]) -> None:
    try:
        assert proc.stdout is not None
        announced, ready = proc.stdout.readline().split(), proc.stdout.readline().split()
        assert announced[0] == "BATCH-GRPC" and ready[0] == "READY", (announced, ready)
        with grpc.insecure_channel(announced[1]) as channel:
            stub = batch_pb2_grpc.BatchGenerationStub(channel)
            params = Params(max_tokens=4, ignore_eos=True)
            request = batch_pb2.GenerateRequest(items=[Item(index=7, text="x", params=params)])
            deltas = [d for response in stub.Generate(request, timeout=30) for d in response.deltas]
        assert {d.index for d in deltas} == {7} and deltas[-1].usage.completion_tokens == 4
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0  # SIGTERM is a clean stop with the gRPC server too
