"""How Envoy's ext_proc streams spread over one node's extproc workers.

The workers share one port (SO_REUSEPORT): the kernel gives each new connection to one of them,
and an Envoy worker thread keeps one HTTP/2 connection to the extproc cluster. Two stacks alike
but for the cluster's ``max_requests_per_connection``: ``recycled`` (the built config: a new
connection every ``EXTPROC_STREAMS_PER_CONNECTION`` streams) and ``kept`` (one connection for
ever, as before). Each round starts a fresh stack (2 extproc workers, 2 Envoy threads, one
simulated pod; a tenant with limits, so quota, ledger and metrics run) and sends chat requests
from ``--clients`` clients, half of them streamed; the figure is the busiest worker's share of
the workers' CPU seconds (0.5: an even split), the median over rounds, alternating the stacks.

    python -m bench.worker_spread [--rounds 5] [--clients 8] [--requests 800]
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
import yaml
from rich.progress import Progress

from bench.common import emit, median, process_cpu_seconds
from extproc.envoybuild.clusters import EXTPROC_STREAMS_PER_CONNECTION
from extproc.envoybuild.names import EXTPROC_CLUSTER
from extproc.launcher import LocalStack, StackOptions

KEY = "sk-bench-spread"
os.environ.setdefault("BENCH_SPREAD_KEY", KEY)  # the launcher reads the config too
CONFIG = {
    "pools": [{"name": "p", "simulate": 1}],
    "models": [{"name": "m", "pool": "p"}],
    "tenants": [{"name": "bench", "keys": [{"env": "BENCH_SPREAD_KEY"}], "limits": {"rpm": 1_000_000}}],
}


def keep_connections(rendered: dict[str, Any], _pods: object) -> None:
    """The ``kept`` stack: the extproc cluster without max_requests_per_connection."""
    for cluster in rendered["static_resources"]["clusters"]:
        if cluster["name"] == EXTPROC_CLUSTER:
            for options in cluster.get("typed_extension_protocol_options", {}).values():
                options.pop("common_http_protocol_options", None)


def one_round(config: Path, run_dir: Path, kept: bool, clients: int, requests: int) -> dict[str, float]:
    options = StackOptions(config_path=config, run_dir=run_dir, port=0, workers=2, envoy_concurrency=2,
                           log_level="WARNING", env={"BENCH_SPREAD_KEY": KEY},
                           envoy_patch=keep_connections if kept else None)
    stack = LocalStack(options)
    with stack as info:
        workers = [child.pid for child in stack.group.children if child.name.startswith("extproc")]
        before = [process_cpu_seconds([pid]) for pid in workers]

        def client(index: int) -> None:
            with httpx.Client(timeout=30, headers={"authorization": f"Bearer {KEY}"}) as http:
                for n in range(requests // clients):
                    body = {"model": "m", "messages": [{"role": "user", "content": f"hi {index} {n}"}],
                            "max_tokens": 4, "stream": n % 2 == 1}
                    http.post(f"{info.base_url}/v1/chat/completions", json=body).raise_for_status()

        started = time.monotonic()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, range(clients)))
        took = time.monotonic() - started
        used = [process_cpu_seconds([pid]) - b for pid, b in zip(workers, before, strict=True)]
    return {"busiest_share": max(used) / sum(used), "requests_per_s": requests / took}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_spread", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=800)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"recycled": [], "kept": []}
    with TemporaryDirectory(prefix="llmgw-spread-") as scratch, Progress(transient=True) as progress:
        config = Path(scratch) / "llmgw.yaml"
        config.write_text(yaml.safe_dump(CONFIG))
        task = progress.add_task("stacks", total=2 * args.rounds)
        for round_ in range(args.rounds):
            for name in ("recycled", "kept"):
                run_dir = Path(scratch) / f"{name}-{round_}"
                results[name].append(one_round(config, run_dir, name == "kept", args.clients, args.requests))
                progress.advance(task)
    summary: dict[str, object] = {"bench": "worker_spread", "workers": 2, "envoy_threads": 2,
                                  "clients": args.clients, "requests": args.requests, "rounds": args.rounds,
                                  "streams_per_connection": EXTPROC_STREAMS_PER_CONNECTION}
    for name, rounds in results.items():
        summary[name] = {"busiest_share_median": round(median([r["busiest_share"] for r in rounds]), 3),
                         "busiest_share_rounds": [round(r["busiest_share"], 3) for r in rounds],
                         "requests_per_s_median": round(median([r["requests_per_s"] for r in rounds]), 1)}
    emit("worker_spread", summary)


if __name__ == "__main__":
    main()
