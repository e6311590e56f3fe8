"""The quota store on one Redis against a Redis Cluster: admissions per second, the store client's
CPU per admission, latency, and the Redis processes' CPU.

One process drives ``RedisStore`` as an extproc worker does (one pipelined connection per Redis
primary): ``--concurrency`` tasks each admit a lease for one of ``--tenants`` tenants (limits that
never bite: rpm, tpm, concurrency, daily tokens) and release it with its usage, for
``--requests`` admissions a round. Targets: one redis-server; clusters of 2 and 3 primaries (what
one more primary buys); all from the same binary, on this machine. Rounds alternate between the
targets; figures are medians over rounds. Every process involved is counted: the client's CPU,
and the Redis processes' summed.

    python -m bench.quota_cluster [--rounds 5] [--requests 20000] [--concurrency 64] [--tenants 60]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.progress import Progress

from bench.common import emit, median, percentile, process_cpu_seconds
from extproc.quota.limits import Admission, Limits, Quota
from extproc.quota.redis_store import RedisStore
from llmgw_testing.redis_cluster import RedisCluster
from llmgw_testing.redis_server import RedisServer, redis_binary

HIGH = Quota(Limits(rpm=10**9, tpm=10**12, concurrency=10**6, daily_tokens=10**14))


async def one_round(url: str, requests: int, concurrency: int, tenants: list[str]) -> dict[str, float]:
    store = RedisStore.from_url(url, timeout_s=5.0)
    ids = itertools.count()
    latencies: list[float] = []

    async def worker(requests_each: int) -> None:
        for _ in range(requests_each):
            n = next(ids)
            started = time.perf_counter()
            verdict = await store.admit(Admission(tenants[n % len(tenants)], f"l{n}", 100), HIGH)
            latencies.append(time.perf_counter() - started)
            assert verdict.admitted and verdict.lease is not None
            await store.release(verdict.lease, 80)

    try:
        await asyncio.gather(*(worker(10) for _ in range(concurrency)))  # connections, scripts loaded
        latencies.clear()
        cpu = time.process_time()
        wall = time.perf_counter()
        await asyncio.gather(*(worker(requests // concurrency) for _ in range(concurrency)))
        wall = time.perf_counter() - wall
        cpu = time.process_time() - cpu
    finally:
        await store.close()
    done = len(latencies)
    latencies.sort()
    return {"admissions_per_s": done / wall, "client_cpu_us": cpu * 1e6 / done,
            "p50_ms": percentile(latencies, 50) * 1000, "p99_ms": percentile(latencies, 99) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quota_cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tenants", type=int, default=60)
    args = parser.parse_args()
    binary = redis_binary()
    if binary is None:
        raise SystemExit("no redis-server")
    tenants = [f"bench-{i}" for i in range(args.tenants)]
    with tempfile.TemporaryDirectory(prefix="llmgw-quota-cluster-") as scratch:
        single = RedisServer(binary, Path(scratch))
        clusters = {masters: RedisCluster(binary, Path(scratch) / f"cluster-{masters}", masters=masters)
                    for masters in (2, 3)}
        targets: dict[str, tuple[str, list[int]]] = {}
        try:
            single.start()
            assert single.proc is not None
            targets["single"] = (single.url, [single.proc.pid])
            for masters, cluster in clusters.items():
                cluster.start()
                targets[f"cluster_{masters}"] = (cluster.url, [n.proc.pid for n in cluster.nodes if n.proc])
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
            with Progress(transient=True) as progress:
                task = progress.add_task("rounds", total=args.rounds * len(targets))
                for _ in range(args.rounds):
                    for name, (url, pids) in targets.items():
                        redis_cpu = process_cpu_seconds(pids)
                        result = asyncio.run(one_round(url, args.requests, args.concurrency, tenants))
                        result["redis_cpu_us"] = (process_cpu_seconds(pids) - redis_cpu) * 1e6 / args.requests
                        runs[name].append(result)
                        progress.advance(task)
        finally:
            single.stop()
            for cluster in clusters.values():
                cluster.stop()
    summary: dict[str, Any] = {"bench": "quota_cluster", "rounds": args.rounds, "requests": args.requests,
                               "concurrency": args.concurrency, "tenants": args.tenants, "cores": os.cpu_count()}
    for name, rounds in runs.items():
        summary[name] = {key: round(median([r[key] for r in rounds]), 3) for key in rounds[0]}
    emit("quota_cluster", summary)


if __name__ == "__main__":
    main()
