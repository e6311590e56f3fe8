"""Fairness of work: one tenant's large bodies against another tenant's small requests.

Two stacks (2 extproc workers, 2 Envoy workers, one instant simulated pod each: the latency is the
gateway's), alike but for
where large bodies are analyzed: ``offload`` (the default: bodies from ``server.offload_body_bytes``
up go to a helper process) and ``inline`` (on the worker's event loop; structure bounds still apply).
In each round, tenant ``big`` sends 4 concurrent ~5 MB bodies (100,000 tools, an unknown model:
the hostile client's) while tenant ``small`` sends small chat requests at concurrency 4 for as long
as they are in flight. Rounds alternate between the stacks; figures are medians over rounds.

    python -m bench.fairness [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from contextlib import ExitStack
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import orjson
import yaml
from rich.progress import Progress

from bench.common import build_request, emit, median, percentile
from extproc.launcher import LocalStack, StackOptions, free_port

MODEL = "llama-3-8b-instruct"
KEYS = {"big": "sk-bench-big", "small": "sk-bench-small"}
TARGET_P99_MS = 100.0


def _config(offload: bool) -> dict[str, Any]:
    limits = {"rpm": 10**9, "concurrency": 10**6}
    return {
        "server": {"max_body_bytes": 8 << 20, **({} if offload else {"offload_body_bytes": 1 << 30})},
        "pools": [{"name": "local", "simulate": 1}],
        "models": [{"name": MODEL, "pool": "local"}],
        "tenants": [{"name": name, "keys": [{"env": f"BENCH_{name.upper()}_KEY"}], "limits": limits}
                    for name in KEYS],
    }


def big_body() -> bytes:
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
             for i in range(100_000)]
    return orjson.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "tools": tools})


async def _send(port: int, raw: bytes) -> tuple[int, float]:
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line[15:]) for line in head.split(b"\r\n") if line[:15].lower() == b"content-length:"), 0)
    if length:
        await reader.readexactly(length)
    writer.close()
    return int(head[9:12]), time.perf_counter() - started


async def one_round(port: int, big: bytes) -> dict[str, float]:
    big_raw = build_request("127.0.0.1", port, "/v1/chat/completions", big,
                            {"authorization": f"Bearer {KEYS['big']}"})
    small_raw = build_request("127.0.0.1", port, "/v1/chat/completions",
                              orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 1}),
                              {"authorization": f"Bearer {KEYS['small']}"})
    bigs = [asyncio.create_task(_send(port, big_raw)) for _ in range(4)]
    small: list[tuple[int, float]] = []

    async def small_client() -> None:
        while not all(task.done() for task in bigs) or len(small) < 40:
            small.append(await _send(port, small_raw))

    await asyncio.gather(*(small_client() for _ in range(4)))
    big_done = [task.result() for task in bigs]
    latencies = [latency for _, latency in small]
    return {"small_p50_ms": percentile(latencies, 50) * 1000, "small_p99_ms": percentile(latencies, 99) * 1000,
            "small_errors": sum(status != 200 for status, _ in small), "small_requests": len(small),
            "big_400": sum(status == 400 for status, _ in big_done),
            "big_503": sum(status == 503 for status, _ in big_done),
            "big_504": sum(status == 504 for status, _ in big_done),
            "big_max_s": max(latency for _, latency in big_done)}


def main(argv: list[str] | None = None) -> None:
    """Run the rounds and print one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m bench.fairness", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    big = big_body()
    with ExitStack() as stack:
        ports: dict[str, int] = {}
        for mode in ("offload", "inline"):
            run_dir = Path(stack.enter_context(TemporaryDirectory(prefix=f"llmgw-fair-{mode}-")))
            config = run_dir / "llmgw.yaml"
            config.write_text(yaml.safe_dump(_config(mode == "offload")))
            ports[mode] = free_port()
            stack.enter_context(LocalStack(StackOptions(
                config_path=config, run_dir=run_dir, port=ports[mode], workers=2, envoy_concurrency=2,
                log_level="WARNING", sim_args=("--time-scale", "0", "--log-level", "ERROR"),
                env={f"BENCH_{n.upper()}_KEY": k for n, k in KEYS.items()})))
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in ports}
        with Progress(transient=True) as progress:
            task = progress.add_task("fairness", total=args.rounds * len(ports))
            for _ in range(args.rounds):
                for mode, port in ports.items():
                    runs[mode].append(asyncio.run(one_round(port, big)))
                    progress.advance(task)
    out: dict[str, Any] = {"bench": "fairness", "big_body_bytes": len(big), "rounds": args.rounds,
                           "target_small_p99_ms": TARGET_P99_MS}
    for mode, found in runs.items():
        out[mode] = {key: median([r[key] for r in found]) for key in found[0]}
        out[mode]["small_errors_total"] = sum(r["small_errors"] for r in found)
    out["target_met"] = out["offload"]["small_p99_ms"] <= TARGET_P99_MS and out["offload"]["small_errors_total"] == 0
    emit("fairness", out)


if __name__ == "__main__":
    main()
