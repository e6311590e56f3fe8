"""``python -m llmgw_sim`` as a real process, driven by the official ``openai`` client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = "sim-model"
ALIAS = "sim-alias"


def start_sim(*flags: str, ready: str = "READY ") -> tuple[subprocess.Popen[str], str]:
    """Start a pod and wait for its READY line (or the first line, ``BATCH-GRPC``, with
    ``ready="BATCH-GRPC "``); returns (process, the line's address)."""
    stderr = tempfile.TemporaryFile("w+")  # a file, so a chatty pod can never block on a pipe
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw_sim", "--port", "0", "--model", MODEL, *flags],
        cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until READY (or EOF if it died)
    if not line.startswith(ready):
        proc.kill()
        proc.wait()
        stderr.seek(0)
        raise AssertionError(f"no READY line: {line!r}\n{stderr.read()}")
    return proc, line.split()[1]


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    proc, url = start_sim("--model", ALIAS, "--time-scale", "0.05", "--seed", "1")
    try:
        yield url
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0  # SIGTERM is a clean stop


def test_ready_line_is_the_only_stdout(sim_url: str) -> None:
    assert sim_url.startswith("http://127.0.0.1:") and not sim_url.endswith(":0")


def test_openai_chat_and_stream(sim_url: str) -> None:
    client = openai.OpenAI(base_url=f"{sim_url}/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]  # --model twice

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=16, seed=5)
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens <= 16

    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=16, seed=5,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content  # same seed and prompt: same text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_openai_completions_and_errors(sim_url: str) -> None:
    client = openai.OpenAI(base_url=f"{sim_url}/v1", api_key="x", max_retries=0)
    done = client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=4)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    streamed = list(client.completions.create(model=MODEL, prompt="a", max_tokens=4, stream=True))
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])


def test_openai_embeddings(sim_url: str) -> None:
    client = openai.OpenAI(base_url=f"{sim_url}/v1", api_key="x", max_retries=0)
    result = client.embeddings.create(model=ALIAS, input=["alpha", "beta"])  # the client asks base64
    assert [item.index for item in result.data] == [0, 1]
    assert len(result.data[0].embedding) == 4096
    assert abs(sum(x * x for x in result.data[0].embedding) - 1.0) < 1e-3


def test_crash_after_exits_hard() -> None:
    proc, url = start_sim("--crash-after", "1", "--time-scale", "0")
    try:
        request = urllib.request.Request(f"{url}/v1/completions", method="POST",
                                         data=b'{"prompt": "x", "max_tokens": 1}')
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 200  # the N-th request is still answered
        assert proc.wait(timeout=10) == 1  # then os._exit(1)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_die_after_tokens_cuts_the_stream_and_exits_hard() -> None:
    proc, url = start_sim("--die-after-tokens", "3", "--time-scale", "1")
    try:
        chunks = [0, 0]  # per prompt: one token each, the reader keeping up
        body = {"prompt": ["a", "b"], "max_tokens": 10, "ignore_eos": True, "stream": True}
        with (pytest.raises(httpx.RemoteProtocolError),  # cut: no end of the chunked body
              httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10) as resp):
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    assert choice["finish_reason"] is None and choice["text"]
                    chunks[choice["index"]] += 1
        assert proc.wait(timeout=10) == 1
        assert chunks == [3, 3]  # the 3rd token's step was sent, then nothing
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_die_after_tokens_cuts_a_batch_protocol_call() -> None:
    import asyncio

    import grpc

    from extproc.protos.llmgw.v1 import batch_pb2, batch_pb2_grpc

    proc, address = start_sim("--die-after-tokens", "3", "--time-scale", "1", "--batch-grpc-port", "0",
                              ready="BATCH-GRPC ")
    params = batch_pb2.SamplingParams(max_tokens=10, ignore_eos=True)
    items = [batch_pb2.BatchItem(index=i, text=f"prompt {i}", params=params) for i in range(2)]

    async def call() -> tuple[list[int], grpc.StatusCode]:
        deltas = [0, 0]
        async with grpc.aio.insecure_channel(address) as channel:
            try:
                async for response in batch_pb2_grpc.BatchGenerationStub(channel).Generate(
                        batch_pb2.GenerateRequest(items=items)):
                    for delta in response.deltas:
                        assert not delta.finish_reason and delta.text
                        deltas[delta.index] += 1
            except grpc.aio.AioRpcError as error:
                return deltas, error.code()
        raise AssertionError("the call was not cut")

    try:
        deltas, code = asyncio.run(call())
        assert code == grpc.StatusCode.UNAVAILABLE and proc.wait(timeout=10) == 1
        assert deltas == [3, 3]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_bad_flag_exits_2() -> None:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "llmgw_sim", "--error-rate", "2"],
                            cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "error_rate" in result.stderr
    assert time.monotonic() - started < 30
