"""End to end: gateway-side batching through Envoy with the openai client. Batchable requests go to
the coordinator, which merges them into one completion call per pod and answers each client in
the shape it asked for, with its own usage; realtime requests, and everything while the
coordinator is down, go direct."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from extproc.launcher import StackInfo
from tests.e2e.conftest import MODEL, small_stack

BATCHED = {
    "pools": [{"name": "local", "simulate": 1, "batching": {"enabled": True, "max_wait_ms": {"default": 300}}}],
}


@pytest.fixture(scope="module")
def batching(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    # A static engine (one batch at a time): requests arriving while it runs a batch wait, and the
    # coordinator merges them for the next one.
    with small_stack(tmp_path_factory, "batching", pods=1, extra_config=BATCHED,
                     sim_args=("--engine", "static", "--record", "100")) as info:
        yield info


def _client(info: StackInfo) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{info.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _ask(info: StackInfo, i: int) -> tuple[str, dict[str, str], object]:
    client = _client(info)
    kind, stream = ("chat", "completion")[i % 2], i % 3 == 0
    if kind == "chat":
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"question {i}: say something"}],
            max_tokens=8, stream=stream, stream_options={"include_usage": True} if stream else None)
    else:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=f"prompt number {i}", max_tokens=8, stream=stream,
            stream_options={"include_usage": True} if stream else None)
    parsed = raw.parse()
    return kind, dict(raw.headers), (list(parsed) if stream else parsed)


def test_concurrent_clients_are_merged_and_each_gets_its_own_answer(batching: StackInfo) -> None:
    first = threading.Thread(target=_ask, args=(batching, 99))  # keeps the pod's one batch busy
    first.start()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _ask(batching, i), range(8)))
    first.join(60)
    sizes = [int(headers["x-llmgw-batch-size"]) for _, headers, _ in answers]
    assert max(sizes) > 1, sizes  # merged
    for kind, headers, answer in answers:
        assert headers["x-llmgw-batch-id"]
        if isinstance(answer, list):  # streamed: chunks of its own shape, then a usage chunk
            assert {c.object for c in answer} == {"chat.completion.chunk" if kind == "chat" else "text_completion"}
            usage = answer[-1].usage
            text = "".join((c.choices[0].delta.content or "") if kind == "chat" else c.choices[0].text
                           for c in answer if c.choices)
        else:
            assert answer.object == ("chat.completion" if kind == "chat" else "text_completion")
            usage = answer.usage
            text = answer.choices[0].message.content if kind == "chat" else answer.choices[0].text
        assert text and usage.completion_tokens == 8 and usage.prompt_tokens > 0


def test_realtime_and_unbatchable_requests_go_direct(batching: StackInfo) -> None:
    raw = _client(batching).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2)
    assert "x-llmgw-batch-id" not in raw.headers and len(raw.parse().choices) == 2


def test_with_the_coordinator_down_requests_go_direct(tmp_path_factory: pytest.TempPathFactory) -> None:
    stack = small_stack(tmp_path_factory, "nocoord", pods=1, extra_config=BATCHED, restart=False)
    with stack as info:
        coordinator = next(c for c in stack.group.children if c.name == "coordinator")
        coordinator.proc.kill()
        coordinator.proc.wait(10)
        deadline = time.monotonic() + 20
        while True:  # until extproc's probe marks it down
            try:
                raw = _client(info).chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
                if "x-llmgw-batch-id" not in raw.headers:
                    break
            except openai.APIStatusError:
                pass
            assert time.monotonic() < deadline, "requests still go to a dead coordinator"
        assert raw.parse().choices[0].message.content


def test_requests_with_different_parameters_share_a_batch_protocol_call(batching: StackInfo) -> None:
    import httpx
    import yaml

    coordinator = yaml.safe_load(batching.config_path.read_text())["server"]["coordinator"]

    def protocol_figures(kind: str) -> float:
        text = httpx.get(f"http://{coordinator}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f'llmgw_batch_size_{kind}{{') and 'protocol="llmgw.v1"' in line)

    def protocol_batches() -> float:
        return protocol_figures("sum")

    deadline = time.monotonic() + 30
    while protocol_batches() == 0:  # the coordinator learns that the pod speaks it after its first call
        _ask(batching, 100)
        assert time.monotonic() < deadline, "no batch went over the batch protocol"
    before, calls_before = protocol_batches(), protocol_figures("count")
    client = _client(batching)

    def ask(temperature: float) -> str:
        answer = client.completions.create(model=MODEL, prompt=f"t={temperature}", max_tokens=4,
                                           temperature=temperature)
        return answer.choices[0].text

    first = threading.Thread(target=_ask, args=(batching, 99))  # keeps the pod's one batch busy
    first.start()
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(ask, (0.1, 0.4, 0.7, 1.0)))
    first.join(60)
    assert all(texts) and protocol_batches() - before >= 4
    assert protocol_figures("count") - calls_before < protocol_batches() - before  # merged: fewer calls than requests
