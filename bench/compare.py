"""llmgw beside Envoy alone, the LiteLLM proxy and the pod direct, on the same pods, in one run.

Four lanes reach the same two pods:

- ``direct``: the client talks to the pod itself;
- ``envoy``: Envoy alone (decompressors and router, no gateway filter or access log);
- ``llmgw``: the gateway as users run it (``llmgw up``'s Envoy and two extproc workers): a tenant
  with an API key and rpm/tpm/concurrency limits, prices, the models' tokenizer, the SQLite quota
  store, the JSON-lines ledger and multiprocess Prometheus metrics;
- ``litellm``: the LiteLLM proxy (``bench.litellm``: a pinned release in its own virtualenv, kept
  offline, one uvicorn worker, no database, cache or callbacks).

Pods: ``bench.instant_pod`` (answers at once and does not tokenize) for the plain and long cases;
``llmgw_sim`` paced at 1 ms per token, always 64 tokens, for the 64-token streams. Workloads,
each over every lane, rounds alternating the lanes' order:

- ``plain_4k_c1``, ``plain_4k_c32``: a ~4 KB chat, max_tokens 1;
- ``stream64_c1``, ``stream64_c8``: the same chat streamed, 64 tokens;
- ``stream_220k_c20``: a 220 KB chat streamed (16 tokens), 20 at a time;
- ``plain_1m_c4``: a 1 MB chat, 4 at a time.

CPU per request is read from /proc per process group (Envoy; the extproc workers with their
body-analysis helpers; LiteLLM with any child; each pod), net of each group's idle rate measured
before the rounds (the median of seven 1 s windows); a gateway lane's figure includes its access-log
settlement (the phase waits for Envoy's 1 s flush). "Gateway CPU" is what the lane adds in front of
the pod: Envoy plus extproc for llmgw, Envoy for Envoy alone, LiteLLM for LiteLLM. Figures are
medians over rounds, with the rounds' spread (min, max). Prints one JSON line; writes
bench/results/compare.json and compare.png.

    python -m bench.compare [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import Progress

from bench import litellm
from bench.common import (
    RESULTS,
    CpuMeter,
    RunResult,
    StreamRunResult,
    build_request,
    calibration_ms,
    emit,
    idle_rates,
    median,
    run_load,
    run_stream_load,
)
from bench.long_prompts import long_body
from bench.overhead import MODEL, POD_HEADER, STREAM_MODEL, TOKENIZER, Ports, _ready_address, bench_listeners, chat_body
from extproc.launcher import LocalStack, ProcessGroup, StackOptions, free_port

LANES = ("direct", "envoy", "llmgw", "litellm")
STREAM_TOKENS = 64
DONE = b'"length"'  # the last event's finish_reason (both pods stop at max_tokens)
FLUSH_S = 1.5  # Envoy's access-log flush interval (1 s) and then some: settlement counts for its phase
# The goals (#19): llmgw's gateway CPU per plain request at c=32 is 1/10 of LiteLLM's, and
# per 64-token stream at c=8 1/20.
GOAL_PLAIN_RATIO, GOAL_STREAM_RATIO = 10.0, 20.0


@dataclass(frozen=True, slots=True)
class Case:
    """One workload: a body size, streamed or not, at one concurrency, to one pod."""

    name: str
    size: int
    stream: bool
    concurrency: int
    requests: int
    paced: bool = False  # the paced pod (64-token streams), else the instant one
    max_tokens: int = 1

    def body(self) -> bytes:
        if self.size <= 8192:
            return chat_body(self.size, model=STREAM_MODEL if self.paced else MODEL, max_tokens=self.max_tokens,
                             stream=self.stream)
        return long_body(self.size, stream=self.stream, max_tokens=self.max_tokens)


def cases(scale: int) -> list[Case]:
    """The workloads; ``scale`` divides the request counts (--quick)."""
    return [
        Case("plain_4k_c1", 4096, False, 1, 300 // scale),
        Case("plain_4k_c32", 4096, False, 32, 1000 // scale),
        Case("stream64_c1", 4096, True, 1, 24 // scale, paced=True, max_tokens=STREAM_TOKENS),
        Case("stream64_c8", 4096, True, 8, 96 // scale, paced=True, max_tokens=STREAM_TOKENS),
        Case("stream_220k_c20", 220_000, True, 20, 100 // scale, max_tokens=16),
        Case("plain_1m_c4", 1 << 20, False, 4, 24 // scale),
    ]


def gateway_config(pods: dict[str, str], key: str) -> dict[str, Any]:
    """The llmgw lane's policy: bench.overhead's full one, with room for a 1 MB prompt."""
    config: dict[str, Any] = {
        "server": {"max_body_bytes": 8 << 20},
        "pools": [{"name": "instant", "endpoints": [pods["instant"]]},
                  {"name": "paced", "endpoints": [pods["paced"]]}],
        "models": [{"name": name, "pool": pool, "tokenizer": TOKENIZER, "max_model_len": 4_000_000,
                    "price": {"input": 0.05, "output": 0.08}}
                   for name, pool in ((MODEL, "instant"), (STREAM_MODEL, "paced"))],
        "tenants": [{"name": "bench", "keys": [{"sha256": hashlib.sha256(key.encode()).hexdigest()}],
                     "limits": {"rpm": 100_000_000, "tpm": 1_000_000_000_000, "concurrency": 100_000}}],
    }
    return config


def group_of(name: str) -> str:
    """A CpuMeter name's process group: envoy, extproc (workers and helpers), litellm, pod."""
    root = name.split("/")[0]
    for group in ("envoy", "extproc", "litellm", "pod"):
        if root.startswith(group):
            return group
    return root


@dataclass(frozen=True, slots=True)
class Sample:
    """One lane's run of one case."""

    ok: int
    errors: int
    failures: dict[str, int]
    rps: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float | None
    cpu_ms: dict[str, float]  # per request, per process group


class Compare:
    """The lanes and cases of one run: ``ports(lane, case)`` says where a lane's requests go."""

    def __init__(self, ports: Callable[[str, Case], int], meter: CpuMeter, key: str) -> None:
        self.ports, self.meter, self.key = ports, meter, key
        self.idle_rate: dict[str, float] = {}
        self.samples: dict[tuple[str, str], list[Sample]] = {}
        self._bodies: dict[str, bytes] = {}

    def raw(self, lane: str, case: Case) -> bytes:
        body = self._bodies.get(case.name)
        if body is None:
            body = self._bodies[case.name] = case.body()
        # The same headers everywhere: the key (LiteLLM runs without one and ignores it), and the
        # header Envoy alone routes the paced pod's requests by.
        headers = {"authorization": f"Bearer {self.key}", **({POD_HEADER: "paced"} if case.paced else {})}
        return build_request("127.0.0.1", self.ports(lane, case), "/v1/chat/completions", body, headers)

    async def load(self, lane: str, case: Case, concurrency: int | None = None, requests: int | None = None
                   ) -> RunResult:
        raw, port = self.raw(lane, case), self.ports(lane, case)
        concurrency, requests = concurrency or case.concurrency, requests or case.requests
        if case.stream:
            return await run_stream_load("127.0.0.1", port, raw, concurrency=concurrency, requests=requests,
                                         done=DONE)
        return await run_load("127.0.0.1", port, raw, concurrency=concurrency, requests=requests)

    def _groups(self, used: dict[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, seconds in used.items():
            out[group_of(name)] = out.get(group_of(name), 0.0) + seconds
        return out

    async def idle(self, windows: int = 7, seconds: float = 1.0) -> None:
        """Each group's idle CPU rate: the median of short windows, so that one burst of background
        work (LiteLLM's, a scrape) does not inflate what every later phase has taken off."""
        rates: dict[str, list[float]] = {}
        for _ in range(windows):
            for g, rate in self._groups(await idle_rates(self.meter, seconds)).items():
                rates.setdefault(g, []).append(rate)
        self.idle_rate = {g: statistics.median(r) for g, r in rates.items()}

    async def measure(self, lane: str, case: Case) -> Sample:
        before, started = self.meter.read(), time.perf_counter()
        result = await self.load(lane, case)
        await asyncio.sleep(FLUSH_S)
        wall = time.perf_counter() - started
        used = self._groups(CpuMeter.used(before, self.meter.read()))
        cpu = {g: round((s - self.idle_rate.get(g, 0.0) * wall) * 1000 / case.requests, 3) for g, s in used.items()}
        stream = result if isinstance(result, StreamRunResult) else None
        failures = stream.failures if stream is not None else ({"not 200": result.errors} if result.errors else {})
        ttft = round(stream.first_event_p(50), 2) if stream is not None and stream.first_events else None
        return Sample(case.requests - result.errors, result.errors, failures, round(result.rps, 1),
                      round(result.p(50), 2) if result.latencies else 0.0,
                      round(result.p(99), 2) if result.latencies else 0.0, ttft, cpu)

    async def run(self, workloads: list[Case], rounds: int) -> None:
        with Progress(transient=True, console=Console(stderr=True)) as progress:
            task = progress.add_task("compare", total=len(LANES) * (1 + rounds * len(workloads)))
            for lane in LANES:  # connections, tokenizers, LiteLLM's lazy imports, the helper
                for case in workloads:
                    await self.load(lane, case, 2, 4)
                progress.advance(task)
            await asyncio.sleep(FLUSH_S)
            await self.idle()
            for round_ in range(rounds):
                order = LANES[round_ % len(LANES):] + LANES[:round_ % len(LANES)]
                for case in workloads:
                    for lane in order:
                        progress.update(task, description=f"round {round_ + 1}/{rounds} {case.name} {lane}")
                        self.samples.setdefault((lane, case.name), []).append(await self.measure(lane, case))
                        progress.advance(task)


def _spread(values: list[float]) -> list[float]:
    return [round(min(values), 3), round(max(values), 3)]


def gateway_cpu(lane: str, cpu: dict[str, float]) -> float:
    """What ``lane`` adds in front of the pod, per request (ms)."""
    if lane == "llmgw":
        return cpu.get("envoy", 0.0) + cpu.get("extproc", 0.0)
    if lane == "envoy":
        return cpu.get("envoy", 0.0)
    if lane == "litellm":
        return cpu.get("litellm", 0.0)
    return 0.0


def summarize(bench: Compare, workloads: list[Case]) -> dict[str, Any]:
    """Per case and lane: medians and spreads; per case: each lane's gateway CPU and LiteLLM's over llmgw's."""
    out: dict[str, Any] = {}
    for case in workloads:
        entry: dict[str, Any] = {}
        for lane in LANES:
            runs = bench.samples[(lane, case.name)]
            groups = sorted({g for r in runs for g in r.cpu_ms})
            gateway = [round(gateway_cpu(lane, r.cpu_ms), 3) for r in runs]
            entry[lane] = {
                "ok": sum(r.ok for r in runs), "errors": sum(r.errors for r in runs),
                "failures": {k: sum(r.failures.get(k, 0) for r in runs) for r in runs for k in r.failures},
                "rps": median([r.rps for r in runs]), "p50_ms": median([r.p50_ms for r in runs]),
                "p50_ms_spread": _spread([r.p50_ms for r in runs]), "p99_ms": median([r.p99_ms for r in runs]),
                **({"ttft_p50_ms": median([r.ttft_p50_ms or 0.0 for r in runs]),
                    "ttft_p50_ms_spread": _spread([r.ttft_p50_ms or 0.0 for r in runs])} if case.stream else {}),
                "cpu_ms": {g: median([r.cpu_ms.get(g, 0.0) for r in runs]) for g in groups},
                "gateway_cpu_ms": median(gateway), "gateway_cpu_ms_spread": _spread(gateway),
            }
        llmgw, lite = entry["llmgw"]["gateway_cpu_ms"], entry["litellm"]["gateway_cpu_ms"]
        entry["litellm_over_llmgw_cpu"] = round(lite / llmgw, 2) if llmgw > 0 else None
        key = "ttft_p50_ms" if case.stream else "p50_ms"
        entry["added_ms_over_direct"] = {lane: round(entry[lane][key] - entry["direct"][key], 2)
                                         for lane in LANES if lane != "direct"}
        out[case.name] = entry
    return out


def goals(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's ratios: LiteLLM's gateway CPU over llmgw's."""
    plain, stream = results["plain_4k_c32"]["litellm_over_llmgw_cpu"], results["stream64_c8"]["litellm_over_llmgw_cpu"]
    return {
        "plain_4k_c32.litellm_over_llmgw_cpu": {"goal": GOAL_PLAIN_RATIO, "value": plain,
                                                "met": plain is not None and plain >= GOAL_PLAIN_RATIO},
        "stream64_c8.litellm_over_llmgw_cpu": {"goal": GOAL_STREAM_RATIO, "value": stream,
                                               "met": stream is not None and stream >= GOAL_STREAM_RATIO},
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """Per case: each lane's p50 (streams: time to first event), and its gateway CPU per request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases_ = result["cases"]
    names = list(cases_)
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.2
    for i, lane in enumerate(LANES):
        xs = [x + (i - 1.5) * width for x in range(len(names))]
        latency = [cases_[c][lane].get("ttft_p50_ms", cases_[c][lane]["p50_ms"]) for c in names]
        axes[0].bar(xs, latency, width, label=lane, color=f"C{i}")
        if lane != "direct":
            axes[1].bar(xs, [max(cases_[c][lane]["gateway_cpu_ms"], 1e-3) for c in names], width, label=lane,
                        color=f"C{i}")
    axes[0].set_title("p50 ms (streams: time to first event)")
    axes[1].set_title("gateway CPU ms per request (llmgw: Envoy + extproc)")
    for ax in axes:
        ax.set_yscale("log")
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.legend(fontsize=8)
    ratios = ", ".join(f"{c}: {cases_[c]['litellm_over_llmgw_cpu']}x" for c in names)
    fig.suptitle(f"llmgw, Envoy alone, LiteLLM {result['setup']['litellm']} and the pod direct. "
                 f"LiteLLM CPU / llmgw CPU: {ratios}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="extproc processes of the llmgw lane")
    parser.add_argument("--quick", action="store_true", help="a short smoke run: 1 round, fewer requests")
    args = parser.parse_args()
    scale = 4 if args.quick else 1
    workloads = cases(scale)
    rounds = 1 if args.quick else args.rounds
    started = time.monotonic()
    key = "sk-bench-" + secrets.token_hex(16)
    litellm.ensure_venv()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-compare-") as tmp:
        run_dir = Path(tmp)
        group = ProcessGroup(run_dir / "logs")
        stack: LocalStack | None = None
        proxy = None
        try:
            pids: dict[str, int] = {}
            pods: dict[str, str] = {}
            pids["pod-instant"], pods["instant"] = _ready_address(
                group, "pod-instant", [sys.executable, "-m", "bench.instant_pod", "--model", MODEL])
            pids["pod-paced"], pods["paced"] = _ready_address(group, "pod-paced", [
                sys.executable, "-m", "llmgw_sim", "--host", "127.0.0.1", "--port", "0", "--log-level", "ERROR",
                "--model", STREAM_MODEL, "--time-scale", "1", "--ignore-eos", "--prefill-per-token-ms", "0",
                "--decode-base-ms", "1.0", "--decode-per-seq-ms", "0.1"])
            pids["null"], null_address = _ready_address(group, "null-extproc",
                                                        [sys.executable, "-m", "bench.null_extproc", "--port", "0"])
            config_path = run_dir / "llmgw.yaml"
            config_path.write_text(yaml.safe_dump(gateway_config(pods, key), sort_keys=False))
            ports = Ports(free_port(), free_port(), int(null_address.rpartition(":")[2]), pods)
            tails: dict[str, float] = {}
            stack = LocalStack(StackOptions(config_path=config_path, run_dir=run_dir / "llmgw", port=free_port(),
                                            workers=args.workers, log_level="WARNING",
                                            envoy_patch=bench_listeners(ports, tails)))
            info = stack.start()
            for child in stack.group.children:
                pids[child.name] = child.pid
            proxy, proxy_url = litellm.start_proxy({MODEL: pods["instant"], STREAM_MODEL: pods["paced"]},
                                                   [MODEL, STREAM_MODEL], run_dir / "litellm")
            pids["litellm"] = proxy.pid
            gateway_port, proxy_port = int(info.base_url.rpartition(":")[2]), int(proxy_url.rpartition(":")[2])

            def port_of(lane: str, case: Case) -> int:
                if lane == "direct":
                    return int(pods["paced" if case.paced else "instant"].rpartition(":")[2])
                return {"envoy": ports.direct, "llmgw": gateway_port, "litellm": proxy_port}[lane]

            del pids["null"]  # its listener is not measured here (bench.overhead does)
            bench = Compare(port_of, CpuMeter(pids), key)
            calibrated = calibration_ms()
            asyncio.run(bench.run(workloads, rounds))
            calibration = (calibrated, calibration_ms())
            exits = [e.describe() for e in (*group.exits, *stack.group.exits)]
        finally:
            if proxy is not None:
                litellm.stop_proxy(proxy)
            if stack is not None:
                stack.stop()
            group.stop()

    results = summarize(bench, workloads)
    targets = goals(results)
    result = {
        "bench": "compare", "rounds": rounds, "goals": targets, "met": all(t["met"] for t in targets.values()),
        "cases": results,
        "setup": {"litellm": litellm.LITELLM_VERSION, "extproc_workers": args.workers,
                  "cases": {c.name: c.requests for c in workloads},
                  "pods": "bench.instant_pod (plain, long); llmgw_sim paced 1 ms/token, 64 tokens (stream64)",
                  "calibration_ms": calibration, "child_exits": exits, "wall_s": round(time.monotonic() - started, 1)},
    }
    emit("compare", result)
    plot(result, RESULTS / "compare.png")


if __name__ == "__main__":
    main()
