"""``python -m bench.batching``: gateway-side batching against direct forwarding, in one run.

One stack, two identical pools of simulated pods: ``direct`` (batching off) and ``batched``
(batching on, default window 50 ms), each serving its own model name, so the same Envoy, extproc
workers and client reach both. Lanes alternate, ``--rounds`` times; medians are reported.

- ``low``: open loop, Poisson arrivals at ``--low-rate`` requests/s: the window must not add
  latency when pods have room (continuous engine: p50 within 5% of direct);
- ``curve``: closed loop at each of ``--concurrency`` (clients back to back), giving a
  latency-versus-throughput curve per lane; its last point is saturation (continuous engine:
  throughput >= 0.95x of direct; static engine: >= 4.8x, with a lower p99: the reference papers'
  83 -> 398 QPS).

The pods run ``--engine``: ``continuous`` (vLLM), ``dynamic`` (the server batches what waits) or
``static`` (a batch is one call, as a server without a batcher runs them; see
``llmgw_sim/README.md``), all simulated; or ``llamacpp``: real llama.cpp pods (SmolLM2-135M on
CPU, 4 slots each: CPU figures, not a GPU's). One JSON line; PNG under ``docs/``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import aiohttp
import orjson
import yaml
from rich.progress import Progress

from bench.common import emit, median, percentile
from extproc.launcher import LocalStack, StackOptions

LANES = ("direct", "batched")
DOCS = Path(__file__).resolve().parent.parent / "docs"


def config(pods: int, engine: str = "continuous") -> dict[str, Any]:
    """Two pools alike but for batching (merged calls whatever the engine: that is what is measured)."""
    real = {"engine": "llamacpp"} if engine == "llamacpp" else {}
    return {
        "pools": [{"name": lane, "simulate": pods, "batching": {"enabled": lane == "batched", "merge": "always"},
                   **real}
                  for lane in LANES],
        "models": [{"name": f"model-{lane}", "pool": lane} for lane in LANES],
    }


async def one(session: aiohttp.ClientSession, url: str, lane: str, max_tokens: int, rng: random.Random) -> float:
    """One chat request: its latency in seconds (raises on anything but 200)."""
    body = {"model": f"model-{lane}", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"question {rng.random():.6f}: tell me something"}]}
    started = time.perf_counter()
    async with session.post(f"{url}/v1/chat/completions", data=orjson.dumps(body),
                            headers={"content-type": "application/json"}) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{lane}: HTTP {response.status}")
    return time.perf_counter() - started


async def low_load(url: str, lane: str, rate: float, seconds: float, max_tokens: int, seed: int) -> dict[str, float]:
    """Poisson arrivals for ``seconds``: latency p50/p99."""
    rng = random.Random(seed)
    latencies: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            tasks.append(asyncio.create_task(one(session, url, lane, max_tokens, rng)))
            await asyncio.sleep(rng.expovariate(rate))
        latencies = list(await asyncio.gather(*tasks))
    return {"p50_ms": percentile(latencies, 50) * 1000, "p99_ms": percentile(latencies, 99) * 1000,
            "requests": len(latencies)}


async def closed_loop(url: str, lane: str, concurrency: int, requests: int, max_tokens: int,
                      seed: int) -> dict[str, float]:
    """``concurrency`` clients back to back until ``requests`` are answered: throughput and latency."""
    rng = random.Random(seed)
    latencies: list[float] = []
    left = requests

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            latencies.append(await one(session, url, lane, max_tokens, rng))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300), connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return {"concurrency": concurrency, "rps": len(latencies) / wall, "p50_ms": percentile(latencies, 50) * 1000,
            "p99_ms": percentile(latencies, 99) * 1000, "requests": len(latencies)}


def _medians(found: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(median([r[key] for r in found]), 2) for key in found[0]}


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    low: dict[str, list[dict[str, float]]] = {lane: [] for lane in LANES}
    curve: dict[str, dict[int, list[dict[str, float]]]] = {lane: {c: [] for c in args.concurrency} for lane in LANES}
    with Progress(transient=True) as progress:
        task = progress.add_task("rounds", total=args.rounds * len(LANES) * (1 + len(args.concurrency)))
        for round_ in range(args.rounds):
            lanes = LANES if round_ % 2 == 0 else LANES[::-1]
            for lane in lanes:
                low[lane].append(await low_load(url, lane, args.low_rate, args.low_seconds, args.max_tokens, round_))
                progress.advance(task)
            for concurrency in args.concurrency:
                requests = max(concurrency * args.requests_per_client, args.min_requests)
                for lane in lanes:
                    curve[lane][concurrency].append(await closed_loop(url, lane, concurrency, requests,
                                                                      args.max_tokens, round_))
                    progress.advance(task)
    return {"low": {lane: _medians(found) for lane, found in low.items()},
            "curve": {lane: [_medians(points[c]) for c in args.concurrency] for lane, points in curve.items()}}


def plot(result: dict[str, Any], engine: str, path: Path) -> None:
    """Latency against throughput per lane (closed loop), and latency at low load."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    for i, lane in enumerate(LANES):
        points = result["curve"][lane]
        rps = [p["rps"] for p in points]
        left.plot(rps, [p["p50_ms"] for p in points], "o-", color=f"C{i}", label=f"{lane} p50")
        left.plot(rps, [p["p99_ms"] for p in points], "s--", color=f"C{i}", alpha=0.6, label=f"{lane} p99")
        for p in points:
            left.annotate(f"c={int(p['concurrency'])}", (p["rps"], p["p50_ms"]), fontsize=7,
                          textcoords="offset points", xytext=(4, -9))
        right.bar([i - 0.2], [result["low"][lane]["p50_ms"]], width=0.4, color=f"C{i}", label=f"{lane} p50")
        right.bar([i + 0.2], [result["low"][lane]["p99_ms"]], width=0.4, color=f"C{i}", alpha=0.5,
                  label=f"{lane} p99")
    left.set_xlabel("throughput (requests/s)")
    left.set_ylabel("latency (ms)")
    left.set_yscale("log")
    left.set_title("closed loop, c clients", fontsize=9)
    left.legend(fontsize=8)
    right.set_xticks(range(len(LANES)), LANES)
    right.set_ylabel("latency (ms)")
    right.set_title("open loop, low load", fontsize=9)
    right.legend(fontsize=7)
    fig.suptitle(f"bench.batching: {engine} engine, direct vs batched (medians of rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    """Start the stack, alternate the lanes, print one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m bench.batching", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("continuous", "dynamic", "static", "llamacpp"), default="continuous")
    parser.add_argument("--pods", type=int, default=2, help="pods per pool")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--low-rate", type=float, default=None,
                        help="requests/s in the low-load case (default 4; 1 for the static engine)")
    parser.add_argument("--low-seconds", type=float, default=15.0)
    parser.add_argument("--concurrency", type=lambda v: [int(c) for c in v.split(",")], default=[1, 4, 16, 64],
                        help="closed-loop clients at each point of the curve (comma-separated; the last is "
                             "saturation)")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--min-requests", type=int, default=16, help="per point of the curve")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if args.low_rate is None:
        args.low_rate = 1.0 if args.engine == "static" else 4.0
    with TemporaryDirectory(prefix="llmgw-batching-") as tmp:
        run_dir = Path(tmp)
        path = run_dir / "llmgw.yaml"
        path.write_text(yaml.safe_dump(config(args.pods, args.engine)))
        options = StackOptions(config_path=path, run_dir=run_dir, port=0, workers=2, envoy_concurrency=2,
                               log_level="WARNING", sim_args=("--engine", args.engine, "--log-level", "ERROR",
                                                              "--ignore-eos"))
        with LocalStack(options) as info:
            result = asyncio.run(run(info.base_url, args))
    low, direct, batched = result["low"], result["curve"]["direct"][-1], result["curve"]["batched"][-1]
    out: dict[str, Any] = {
        "bench": "batching", **vars(args), **result,
        "low_p50_ratio": round(low["batched"]["p50_ms"] / low["direct"]["p50_ms"], 3),
        "saturated_rps_ratio": round(batched["rps"] / direct["rps"], 3),
        "saturated_p99_ratio": round(batched["p99_ms"] / direct["p99_ms"], 3),
    }
    if args.engine == "continuous":
        out["targets_met"] = {"low_p50_within_5pct": out["low_p50_ratio"] <= 1.05,
                              "saturated_rps_at_least_0.95x": out["saturated_rps_ratio"] >= 0.95}
    elif args.engine == "static":
        out["targets_met"] = {"saturated_rps_at_least_4.8x": out["saturated_rps_ratio"] >= 4.8,
                              "saturated_p99_lower": out["saturated_p99_ratio"] < 1.0}
    DOCS.mkdir(exist_ok=True)
    plot(result, args.engine, DOCS / f"batching-{args.engine}.png")
    emit(f"batching-{args.engine}", out)


if __name__ == "__main__":
    main()
