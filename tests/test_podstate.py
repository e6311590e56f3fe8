"""Pod state for the endpoint picker: vLLM's /metrics parsed, staleness, and one scraper per node
shared by every worker through a snapshot file (against real simulated pods)."""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import math
import os
import signal
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from extproc.resources import DEFAULT_TOKENIZER
from extproc.routing.engines import VLLM
from extproc.routing.podstate import (
    MODELS_EVERY,
    PodState,
    PodStates,
    default_state_path,
    gather_forever,
    parse_metrics,
    parse_models,
)
from llmgw_sim import SimOptions, build_app
from llmgw_sim.tokens import SimTokenizer
from tests.helpers import eventually

REPO = Path(__file__).resolve().parents[1]
BASE = "llama-3-8b-instruct"


def state(endpoint: str = "p:1", scraped_at: float = 100.0, **fields: object) -> PodState:
    values: dict[str, object] = {
        "waiting": 0.0, "running": 0.0, "kv_usage": 0.0, "prefix_queries": 0.0, "prefix_hits": 0.0,
        "running_adapters": frozenset(), "waiting_adapters": frozenset(), "max_lora": 0, "models": frozenset(),
        **fields}
    return PodState(endpoint=endpoint, scraped_at=scraped_at, **values)  # type: ignore[arg-type]



# -- parse_metrics ------------------------------------------------------------------------------

TWO_ENGINES = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 3.0
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.4
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 5.0
"""
OLD_NAMES = """\
vllm:num_requests_waiting{model_name="m"} 1.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
vllm:gpu_prefix_cache_queries_total{model_name="m"} 80.0
vllm:gpu_prefix_cache_created{model_name="m"} 1.7e9
vllm:gpu_prefix_cache_hits_total{model_name="m"} 16.0
"""
NEW_AND_OLD = """\
vllm:num_requests_running{engine="0"} 1.0
vllm:kv_cache_usage_perc{engine="0"} 0.5
vllm:gpu_cache_usage_perc{engine="0"} 0.5
vllm:prefix_cache_queries_total{engine="0"} 64.0
vllm:gpu_prefix_cache_queries_total{engine="0"} 64.0
"""
LORA_SERIES = """\
vllm:num_requests_running{model_name="m"} 2.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="math"} 1.7000001e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.6e9
"""
BROKEN_LINES = """\
vllm:num_requests_waiting{engine="0"} 7
vllm:num_requests_waiting{engine="1 3
vllm:num_requests_running{engine="0"} NaN
vllm:kv_cache_usage_perc{engine="0"} not-a-number
vllm:num_requests_running{engine="1"} 2
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(TWO_ENGINES, {"waiting": 5.0, "running": 5.0, "kv_usage": pytest.approx(0.3),
                                   "prefix_queries": 150.0, "prefix_hits": 15.0},
                     id="two engines: counts summed, KV usage their mean"),
        pytest.param(OLD_NAMES, {"waiting": 1.0, "kv_usage": 0.25, "prefix_queries": 80.0, "prefix_hits": 16.0},
                     id="older vLLM: gpu_* names only"),
        pytest.param(NEW_AND_OLD, {"kv_usage": 0.5, "prefix_queries": 64.0},
                     id="a name and its deprecated alias count once"),
        pytest.param(LORA_SERIES, {"running_adapters": frozenset({"sql", "chat"}),
                                   "waiting_adapters": frozenset({"math"}), "max_lora": 2},
                     id="LoRA: the series with the latest time wins, not the last line"),
        pytest.param(BROKEN_LINES, {"waiting": 7.0, "running": 2.0, "prefix_hits": 0.0},
                     id="a bad line or value costs only itself"),
    ],
)
def test_parse_metrics(text: str, expected: dict[str, object]) -> None:
    parsed = parse_metrics("10.0.0.1:8000", text, 123.0, frozenset({"m"}))
    assert parsed is not None
    assert (parsed.endpoint, parsed.scraped_at, parsed.models) == ("10.0.0.1:8000", 123.0, frozenset({"m"}))
    assert {name: getattr(parsed, name) for name in expected} == expected


def test_a_kv_cache_the_pod_does_not_report_is_unknown_not_empty() -> None:
    parsed = parse_metrics("10.0.0.1:8000", BROKEN_LINES, 123.0)  # its only KV line is unreadable
    assert parsed is not None and math.isnan(parsed.kv_usage)


@pytest.mark.parametrize("text", [
    pytest.param("<html>502 Bad Gateway</html>\n\x00{{{", id="garbage"),
    pytest.param("", id="empty"),
    pytest.param("llamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n", id="another engine's names"),
])
def test_a_text_without_the_engines_load_metrics_is_no_state(text: str) -> None:
    assert parse_metrics("10.0.0.1:8000", text, 123.0) is None  # unknown, never idle


def test_parse_models() -> None:
    body = orjson.dumps({"object": "list", "data": [{"id": BASE, "root": BASE},
                                                     {"id": "sql", "parent": BASE}, {"no": "id"}]})
    assert parse_models(body) == frozenset({BASE, "sql"})
    assert parse_models(b"not json") is None
    assert parse_models(b'{"data": 3}') is None


# -- against the real simulator -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> SimTokenizer:
    return SimTokenizer.from_spec(DEFAULT_TOKENIZER)


class Hits:
    """Requests a pod received, by path, with their arrival times (``time.time()``, as ``scraped_at``)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        self.times[request.path].append(time.time())
        return await handler(request)


Serve = Callable[[web.Application], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Serve aiohttp apps on ports bound to 0; returns each one's ``host:port``."""
    servers: list[TestServer] = []

    async def start(app: web.Application) -> str:
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return f"127.0.0.1:{server.port}"

    yield start
    for server in servers:
        await server.close()


async def sim_pod(serve: Serve, tokenizer: SimTokenizer, **fields: object) -> tuple[str, Hits]:
    hits = Hits()
    app = build_app(SimOptions(**{"time_scale": 0.0, **fields}), tokenizer)  # type: ignore[arg-type]
    app.middlewares.append(hits.middleware)
    return await serve(app), hits


async def scrape(endpoint: str) -> PodState:
    """What the node's scraper would make of the pod now."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{endpoint}/metrics") as resp:
            text = await resp.text()
        async with session.get(f"http://{endpoint}/v1/models") as resp:
            models = parse_models(await resp.read())
    return parse_metrics(endpoint, text, time.time(), models or frozenset())


async def test_parse_the_simulators_metrics(serve: Serve, tokenizer: SimTokenizer) -> None:
    endpoint, _ = await sim_pod(serve, tokenizer)
    prompt = {"model": BASE, "messages": [{"role": "user", "content": "A shared prompt. " * 20}], "max_tokens": 1}
    usages = []
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            async with session.post(f"http://{endpoint}/v1/chat/completions", json=prompt) as resp:
                usages.append((await resp.json())["usage"])
    parsed = await scrape(endpoint)
    # vLLM counts every prompt token as a query and the tokens served from cache as hits.
    assert parsed.prefix_queries == sum(u["prompt_tokens"] for u in usages)
    assert parsed.prefix_hits == usages[1]["prompt_tokens_details"]["cached_tokens"] > 0
    assert (parsed.waiting, parsed.running, parsed.kv_usage) == (0.0, 0.0, 0.0)  # idle: KV freed
    assert parsed.models == frozenset({BASE}) and parsed.max_lora == 0


async def test_parse_a_busy_simulator_with_lora(serve: Serve, tokenizer: SimTokenizer) -> None:
    endpoint, _ = await sim_pod(serve, tokenizer, time_scale=1.0, enable_lora=True, max_loras=1,
                                lora_modules=(("sql", "/a/sql"), ("chat", "/a/chat")))

    def body(model: str) -> dict[str, object]:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000,
                "ignore_eos": True}

    async with aiohttp.ClientSession() as session:
        calls = [asyncio.create_task(session.post(f"http://{endpoint}/v1/chat/completions", json=body(m)))
                 for m in ("sql", "chat")]
        parsed = await scrape(endpoint)
        deadline = time.monotonic() + 5.0
        while parsed.waiting + parsed.running < 2:
            assert time.monotonic() < deadline, parsed
            parsed = await scrape(endpoint)
        for call in calls:
            call.cancel()  # the pod aborts them when the client goes away
        await asyncio.gather(*calls, return_exceptions=True)
    assert (parsed.running, parsed.waiting) == (1.0, 1.0)  # max_loras=1: one adapter at a time
    assert parsed.running_adapters | parsed.waiting_adapters == {"sql", "chat"}
    assert len(parsed.running_adapters) == len(parsed.waiting_adapters) == 1
    assert parsed.max_lora == 1 and 0 < parsed.kv_usage < 1
    assert parsed.models == frozenset({BASE, "sql", "chat"})


# -- PodStates ----------------------------------------------------------------------------------


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_pod_states_staleness() -> None:
    clock = Clock(100.0)
    states = PodStates(stale_after_s=3.0, clock=clock)
    assert states.get("p:1") is None  # never seen: unknown
    states.update([state("p:1", 100.0, waiting=4.0), state("p:2", 99.0)])
    clock.now = 101.5
    assert states.get("p:1").waiting == 4.0 and set(states.snapshot()) == {"p:1", "p:2"}
    clock.now = 102.5
    assert states.get("p:2") is None and set(states.snapshot()) == {"p:1"}  # 3.5 s old: unknown
    states.update([state("p:1", 99.0, waiting=9.0)])
    assert states.get("p:1").waiting == 4.0  # an older state never replaces a newer one
    states.update([state("p:2", 99.0)])
    assert states.get("p:2") is None  # stale on arrival: still unknown
    clock.now = 103.0
    assert states.get("p:1") is not None  # exactly stale_after_s old: still known
    clock.now = 103.01
    assert states.get("p:1") is None and states.snapshot() == {}
    with pytest.raises(ValueError):
        PodStates(stale_after_s=0)


def test_default_state_path() -> None:
    a = default_state_path(["10.0.0.2:8000", "10.0.0.1:8000"])
    assert a == default_state_path(("10.0.0.1:8000", "10.0.0.2:8000"))  # order does not matter
    assert a != default_state_path(["10.0.0.1:8000"])
    assert a.parent == Path(tempfile.gettempdir())
    assert a.name.startswith(f"llmgw-pods-{os.getuid()}-") and a.suffix == ".json"


# -- one scraper per node -----------------------------------------------------------------------

INTERVAL = 0.2


def between_rounds(path: Path, pods: list[tuple[str, Hits]]) -> bool:
    """The last round is in the snapshot file and the next is not due for a while: a scraper
    stopped now does not die mid-round (a round it never wrote down cannot space the next one)."""
    try:
        scraped = {pod["endpoint"]: pod["scraped_at"] for pod in orjson.loads(path.read_bytes())["pods"]}
    except (FileNotFoundError, orjson.JSONDecodeError):
        return False
    now = time.time()
    return all(scraped.get(ep, 0.0) >= hits.times["/metrics"][-1] > now - INTERVAL / 2 for ep, hits in pods)


def assert_one_scrape_per_interval(times: list[float]) -> None:
    """Rounds are spaced by at least the interval, node-wide. Arrivals jitter: the pods share the
    test's event loop, and a request it handles late (one the scraper gave up on, the loop short
    of CPU) lands just before the next round's. So every two gaps must span more than 1.5
    intervals: a late arrival only moves time between its two gaps, while a round scraped twice
    (two leaders, or a takeover that did not wait) leaves two gaps within about one interval."""
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(first + second for first, second in itertools.pairwise(gaps)) > 1.5 * INTERVAL, gaps
    assert len(times) <= 1 + (times[-1] - times[0]) / INTERVAL + 0.5, gaps


async def test_two_workers_share_one_scraper_and_the_other_takes_over(
        serve: Serve, tokenizer: SimTokenizer, tmp_path: Path) -> None:
    pods = [await sim_pod(serve, tokenizer) for _ in range(2)]
    endpoints = tuple(endpoint for endpoint, _ in pods)
    path = tmp_path / "pods.json"
    first, second = PodStates(stale_after_s=5 * INTERVAL), PodStates(stale_after_s=5 * INTERVAL)
    scraper = asyncio.create_task(gather_forever(lambda: dict.fromkeys(endpoints, VLLM), path, INTERVAL, first))
    await eventually(path.exists, 20.0, "the first worker wrote a snapshot")
    other = asyncio.create_task(gather_forever(lambda: dict.fromkeys(endpoints, VLLM), path, INTERVAL, second))
    try:
        await eventually(lambda: all(second.get(ep) for ep in endpoints), 20.0, "the second worker loaded it")
        assert all(first.get(ep) for ep in endpoints)
        assert second.get(endpoints[0]).models == frozenset({BASE})
        for _, hits in pods:
            await eventually(lambda hits=hits: len(hits.times["/metrics"]) >= 8, 20.0, "8 rounds")
            assert_one_scrape_per_interval(hits.times["/metrics"])  # not one per worker
            # /v1/models on the first round, then every MODELS_EVERY rounds
            rounds = len(hits.times["/metrics"])
            assert len(hits.times["/v1/models"]) in {1 + (rounds - 1) // MODELS_EVERY, 2 + (rounds - 1) // MODELS_EVERY}

        await eventually(lambda: between_rounds(path, pods), 20.0, "a round written")
        scraper.cancel()  # the scraper goes away: its lock with it
        await asyncio.gather(scraper, return_exceptions=True)
        gone = time.time()
        await eventually(lambda: all(second.get(ep).scraped_at > gone for ep in endpoints), 3.0,
                         "the second worker took over")
        for _, hits in pods:
            count = len(hits.times["/metrics"])
            await eventually(lambda hits=hits, count=count: len(hits.times["/metrics"]) >= count + 3, 20.0, "3 rounds")
            assert_one_scrape_per_interval(hits.times["/metrics"])  # the takeover kept the spacing too
    finally:
        for task in (scraper, other):
            task.cancel()
        await asyncio.gather(scraper, other, return_exceptions=True)


WORKER = """
import asyncio, sys
from pathlib import Path
from extproc.routing.engines import VLLM
from extproc.routing.podstate import PodStates, gather_forever
endpoint, path, interval = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
asyncio.run(gather_forever(lambda: {endpoint: VLLM}, path, interval, PodStates(60.0)))
"""


async def test_a_worker_takes_over_when_the_scraper_process_dies(
        serve: Serve, tokenizer: SimTokenizer, tmp_path: Path) -> None:
    endpoint, hits = await sim_pod(serve, tokenizer)
    path = tmp_path / "pods.json"
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", WORKER, endpoint, str(path), str(INTERVAL),
                                                   cwd=REPO)
    states = PodStates(stale_after_s=5 * INTERVAL)
    task: asyncio.Task[None] | None = None
    try:
        await eventually(path.exists, 30.0, "the worker process scrapes")
        task = asyncio.create_task(gather_forever(lambda: {endpoint: VLLM}, path, INTERVAL, states))
        await eventually(lambda: states.get(endpoint) is not None, 20.0, "this worker reads the process's snapshot")
        count = len(hits.times["/metrics"])
        await eventually(lambda: len(hits.times["/metrics"]) >= count + 3, 20.0, "3 more rounds")
        assert_one_scrape_per_interval(hits.times["/metrics"])
        await eventually(lambda: between_rounds(path, [(endpoint, hits)]), 20.0, "a round written")
        process.send_signal(signal.SIGKILL)  # no cleanup: the kernel drops its flock
        await process.wait()
        killed = time.time()
        await eventually(lambda: states.get(endpoint).scraped_at > killed, 3.0, "this worker took over")
        assert_one_scrape_per_interval(hits.times["/metrics"])
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class FakePod:
    """A pod with fixed metrics that can stop answering (it then holds requests open)."""

    def __init__(self, waiting: float) -> None:
        self.hits = Hits()
        self.answering = True
        self.waiting = waiting
        self._released = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.hits.middleware])
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.on_shutdown.append(self._release)
        return app

    async def _release(self, _app: web.Application) -> None:
        self._released.set()

    async def _metrics(self, _request: web.Request) -> web.Response:
        if not self.answering:
            await self._released.wait()
        return web.Response(text=f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}\n')

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": BASE}]})


async def test_a_pod_that_stops_answering_goes_stale_and_is_logged_once(
        serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.podstate")
    pods = [FakePod(waiting=1.0), FakePod(waiting=2.0)]
    endpoints = tuple([await serve(pod.app()) for pod in pods])
    states = PodStates(stale_after_s=3 * INTERVAL)
    task = asyncio.create_task(gather_forever(lambda: dict.fromkeys(endpoints, VLLM), tmp_path / "pods.json",
                                              INTERVAL, states, timeout_s=INTERVAL / 2))
    hung, alive = pods[0], endpoints[1]
    try:
        await eventually(lambda: all(states.get(ep) for ep in endpoints), 20.0, "both pods scraped")
        hung.answering = False
        stopped = time.time()
        count = len(hung.hits.times["/metrics"])
        await eventually(lambda: states.get(endpoints[0]) is None, 20.0, "the silent pod went stale")
        await eventually(lambda: len(hung.hits.times["/metrics"]) >= count + 3, 20.0, "3 failed rounds")
        assert states.get(alive).scraped_at > stopped  # the other pod is unaffected
        failures = [r for r in caplog.records if r.levelno == logging.WARNING and endpoints[0] in r.getMessage()]
        assert len(failures) == 1, [r.getMessage() for r in failures]  # once, not every interval
        hung.answering = True
        await eventually(lambda: states.get(endpoints[0]) is not None, 20.0, "the pod is back")
        assert any("answers again" in r.getMessage() for r in caplog.records)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_reader_loads_what_the_scraper_writes_and_takes_over_when_it_can(
        serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pod = FakePod(waiting=3.0)
    endpoint = await serve(pod.app())
    path = tmp_path / "pods.json"
    lock = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # this test is the node's scraper: the worker only reads
    states = PodStates(stale_after_s=60.0)
    task = asyncio.create_task(gather_forever(lambda: {endpoint: VLLM}, path, INTERVAL, states))
    try:
        path.write_bytes(b"{ not a snapshot")
        await eventually(lambda: "malformed" in caplog.text, 20.0, "the worker met the malformed snapshot")
        assert not task.done()  # and lives on
        written = time.time()
        snapshot = {"version": 1, "round_started": written, "pods": [{
            "endpoint": endpoint, "scraped_at": written, "waiting": 7.0, "running": 1.0, "kv_usage": 0.5,
            "prefix_queries": 10.0, "prefix_hits": 5.0, "running_adapters": ["sql"], "waiting_adapters": [],
            "max_lora": 2, "models": [BASE, "sql"]}]}
        temp = tmp_path / "next.json"
        temp.write_bytes(orjson.dumps(snapshot))
        os.replace(temp, path)
        await eventually(lambda: states.get(endpoint) is not None, 20.0, "the worker loaded the snapshot")
        assert states.get(endpoint) == state(endpoint, written, waiting=7.0, running=1.0, kv_usage=0.5,
                                             prefix_queries=10.0, prefix_hits=5.0, max_lora=2,
                                             running_adapters=frozenset({"sql"}), models=frozenset({BASE, "sql"}))
        assert pod.hits.times["/metrics"] == []  # a reader never scrapes
        os.close(lock)
        lock = -1
        await eventually(lambda: states.get(endpoint).waiting == 3.0, 3.0, "the worker scrapes once the lock is free")
    finally:
        if lock >= 0:
            os.close(lock)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
