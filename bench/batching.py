"""``python -m bench.batching``: gateway-side batching against direct forwarding, in one run.

One stack, two identical pools of simulated pods: ``direct`` (batching off) and ``batched``
(batching on, default window 50 ms), each serving its own model name, so the same Envoy, extproc
workers and client reach both. Lanes alternate, ``--rounds`` times; medians are reported.

- ``low``: open loop, Poisson arrivals at ``--low-rate`` requests/s: the window must not add
  latency when pods have room (target: p50 within 5% of direct);
- ``saturated``: closed loop, ``--concurrency`` clients back to back: throughput must hold
  (target: >= 0.95x of direct).

The pods run ``--engine`` (continuous by default, as vLLM). One JSON line; PNG under ``docs/``.
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


def config(pods: int) -> dict[str, Any]:
    """Two pools alike but for batching."""
    return {
        "pools": [{"name": lane, "simulate": pods, "batching": {"enabled": lane == "batched"}} for lane in LANES],
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


async def saturated(url: str, lane: str, concurrency: int, requests: int, max_tokens: int,
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
    return {"rps": len(latencies) / wall, "p50_ms": percentile(latencies, 50) * 1000,
            "p99_ms": percentile(latencies, 99) * 1000, "requests": len(latencies)}


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict[str, float]]]] = {case: {lane: [] for lane in LANES}
                                                           for case in ("low", "saturated")}
    with Progress(transient=True) as progress:
        task = progress.add_task("rounds", total=args.rounds * 2 * len(LANES))
        for round_ in range(args.rounds):
            for lane in (LANES if round_ % 2 == 0 else LANES[::-1]):
                runs["low"][lane].append(await low_load(url, lane, args.low_rate, args.low_seconds,
                                                        args.max_tokens, round_))
                progress.advance(task)
            for lane in (LANES if round_ % 2 == 0 else LANES[::-1]):
                runs["saturated"][lane].append(await saturated(url, lane, args.concurrency, args.requests,
                                                               args.max_tokens, round_))
                progress.advance(task)
    return {case: {lane: {key: round(median([r[key] for r in found]), 2) for key in found[0]}
                   for lane, found in lanes.items()} for case, lanes in runs.items()}


def plot(result: dict[str, Any], path: Path) -> None:
    """Latency and throughput per lane and case."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for i, lane in enumerate(LANES):
        left.bar([i - 0.2], [result["low"][lane]["p50_ms"]], width=0.4, color=f"C{i}", label=f"{lane} p50")
        left.bar([i + 0.2], [result["low"][lane]["p99_ms"]], width=0.4, color=f"C{i}", alpha=0.5,
                 label=f"{lane} p99")
        right.scatter([result["saturated"][lane]["rps"]], [result["saturated"][lane]["p50_ms"]], color=f"C{i}",
                      label=lane, s=60)
    left.set_xticks(range(len(LANES)), LANES)
    left.set_ylabel("latency at low load (ms)")
    left.legend(fontsize=8)
    right.set_xlabel("throughput at saturation (requests/s)")
    right.set_ylabel("p50 latency (ms)")
    right.legend()
    fig.suptitle(f"bench.batching: {result['engine']} engine")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    """Start the stack, alternate the lanes, print one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m bench.batching", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("continuous", "static"), default="continuous")
    parser.add_argument("--pods", type=int, default=2, help="pods per pool")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--low-rate", type=float, default=4.0, help="requests/s in the low-load case")
    parser.add_argument("--low-seconds", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=400, help="per saturated run")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    with TemporaryDirectory(prefix="llmgw-batching-") as tmp:
        run_dir = Path(tmp)
        path = run_dir / "llmgw.yaml"
        path.write_text(yaml.safe_dump(config(args.pods)))
        options = StackOptions(config_path=path, run_dir=run_dir, port=0, workers=2, envoy_concurrency=2,
                               log_level="WARNING", sim_args=("--engine", args.engine, "--log-level", "ERROR",
                                                              "--ignore-eos"))
        with LocalStack(options) as info:
            result = asyncio.run(run(info.base_url, args))
    low, sat = result["low"], result["saturated"]
    out: dict[str, Any] = {
        "bench": "batching", **vars(args), **result,
        "low_p50_ratio": round(low["batched"]["p50_ms"] / low["direct"]["p50_ms"], 3),
        "saturated_rps_ratio": round(sat["batched"]["rps"] / sat["direct"]["rps"], 3),
    }
    if args.engine == "continuous":
        out["targets_met"] = {"low_p50_within_5pct": out["low_p50_ratio"] <= 1.05,
                              "saturated_rps_at_least_0.95x": out["saturated_rps_ratio"] >= 0.95}
    DOCS.mkdir(exist_ok=True)
    plot({**result, "engine": args.engine}, DOCS / f"batching-{args.engine}.png")
    emit(f"batching-{args.engine}", out)


if __name__ == "__main__":
    main()
