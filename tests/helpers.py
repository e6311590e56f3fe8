"""Shared builders for tests: configs, deterministic ids, ext_proc messages; and the one way a test
waits: ``wait_for`` (a thread) or ``eventually`` (a coroutine) poll a condition until a deadline,
never a fixed sleep."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.config import GatewayConfig, parse_config

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T], timeout: float = 20.0, interval: float = 0.02) -> T:
    """Poll ``check`` until it returns something truthy and return that; fail naming ``what`` past
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:g} s")
        time.sleep(interval)


async def eventually(check: Callable[[], T | Awaitable[T]], timeout: float = 10.0, what: str = "the condition",
                     interval: float = 0.005) -> float:
    """Poll ``check`` (a function or a coroutine function) until it returns something truthy;
    the seconds that took. Fails naming ``what`` past ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return loop.time() - started
        if loop.time() - started > timeout:
            pytest.fail(f"{what}: not within {timeout:g} s")
        await asyncio.sleep(interval)


CONFIG = {
    "server": {"max_body_bytes": 4096},
    "pools": [
        {"name": "general", "endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"]},
        {"name": "secure", "endpoints": ["10.0.1.1:8000"], "credential": {"env": "POOL_KEY"}},
    ],
    "models": [
        {"name": "llama-3-8b-instruct", "pool": "general", "aliases": ["gpt-4o-mini"]},
        {"name": "qwen-72b", "pool": "secure", "max_model_len": 32768},
    ],
}


def make_config(**server: object) -> GatewayConfig:
    """The test config, with optional server overrides."""
    document = {**CONFIG, "server": {**CONFIG["server"], **server}}
    return parse_config(document, env={"POOL_KEY": "sk-pool-secret"})


def counting_ids() -> Iterator[str]:
    """Deterministic hex ids: 000..001, 000..002, ..."""
    return (f"{n:x}" for n in itertools.count(1))


def deterministic_id_source():
    """An IdSource giving zero-padded counter ids of the requested size."""
    counter = itertools.count(1)
    return lambda nbytes: f"{next(counter):0{nbytes * 2}x}"


def header_map(headers: dict[str, str]) -> HeaderMap:
    """An Envoy HeaderMap as the ext_proc filter sends it (values in raw_value)."""
    return HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])


def request_headers(headers: dict[str, str], end_of_stream: bool = False) -> pb.ProcessingRequest:
    """A request_headers ProcessingRequest."""
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream))


def request_body(body: bytes, end_of_stream: bool = True) -> pb.ProcessingRequest:
    """A request_body ProcessingRequest (BUFFERED: the whole body)."""
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


def post_headers(path: str = "/v1/chat/completions", **extra: str) -> dict[str, str]:
    """Headers of a JSON POST as Envoy passes them."""
    return {":method": "POST", ":path": path, ":authority": "gw", "content-type": "application/json", **extra}


def make_decision(**overrides: object):
    """A forwarded request's decision, as extproc attaches it (override any field)."""
    from extproc.accounting import Decision

    fields: dict[str, object] = {
        "id": "0000000000000001", "request_id": "req-1", "started_ns": 1_700_000_000_000_000_000,
        "path": "/v1/chat/completions", "model": "gpt-4o-mini", "served_model": "llama-3-8b-instruct",
        "model_version": "", "pool": "general", "endpoint": "10.0.0.1:8000", "rule": "model", "stream": True,
        "input_tokens": 12, "max_tokens": 64, "tenant": "team-a", "qos": "standard",
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "span_id": "00f067aa0ba902b7", "sampled": True,
    }
    fields.update(overrides)
    return Decision(**fields)  # type: ignore[arg-type]
