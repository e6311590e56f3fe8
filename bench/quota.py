"""What quotas cost: the same ~4 KB chat request with limits enforced in Redis versus none.

One stack (instant simulated pod, one extproc worker, one Envoy worker) with ``redis_url`` set and
two tenants: one without limits (quotas off: no store call) and one with limits too high to bite
(quotas on: one atomic Lua admission and one settlement per request). Rounds alternate between the
two API keys; figures are medians over rounds. Prints one JSON line; writes bench/results/quota.json.

    python -m bench.quota [--rounds 5] [--requests-c1 500] [--requests-c32 2000]
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import yaml
from rich.progress import Progress

from bench.common import bench_redis, build_request, emit, median, process_cpu_seconds, run_load
from bench.overhead import MODEL, chat_body
from extproc.launcher import LocalStack, StackOptions, free_port

TARGET_RATIO = 1.3
KEYS = {"off": "sk-bench-unlimited", "on": "sk-bench-limited"}
HIGH = {"rpm": 10**9, "tpm": 10**12, "concurrency": 10**6, "daily_tokens": 10**14}


async def measure(args: argparse.Namespace, port: int, extproc_pids: list[int], redis_pid: int) -> dict[str, Any]:
    body = chat_body()
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    plan = [(1, args.requests_c1), (32, args.requests_c32)]
    with Progress(transient=True) as progress:
        task = progress.add_task("benchmark", total=(len(plan) * args.rounds + 1) * 2)
        raws = {mode: build_request("127.0.0.1", port, "/v1/chat/completions", body,
                                    {"authorization": f"Bearer {key}"}) for mode, key in KEYS.items()}
        for raw in raws.values():  # warm-up: connections, Lua script load, predictor cold start
            await run_load("127.0.0.1", port, raw, concurrency=8, requests=300)
            progress.advance(task)
        for concurrency, requests in plan:
            for _ in range(args.rounds):
                for mode, raw in raws.items():
                    cpu_before = process_cpu_seconds(extproc_pids)
                    redis_before = process_cpu_seconds([redis_pid])
                    result = await run_load("127.0.0.1", port, raw, concurrency=concurrency, requests=requests)
                    if result.errors:
                        raise SystemExit(f"quotas {mode}: {result.errors} non-200 answers")
                    runs.setdefault((mode, concurrency), []).append({
                        "rps": result.rps, "p50_ms": result.p(50), "p99_ms": result.p(99),
                        "cpu_ms": (process_cpu_seconds(extproc_pids) - cpu_before) * 1000 / requests,
                        "redis_cpu_ms": (process_cpu_seconds([redis_pid]) - redis_before) * 1000 / requests,
                    })
                    progress.advance(task)
    out: dict[str, Any] = {"bench": "quota", "request_bytes": len(body), "rounds": args.rounds}
    for (mode, concurrency), found in runs.items():
        out[f"quota_{mode}_c{concurrency}"] = {k: median([r[k] for r in found]) for k in found[0]}
    for c in (1, 32):
        on, off = out[f"quota_on_c{c}"], out[f"quota_off_c{c}"]
        out[f"cpu_ratio_c{c}"] = round(on["cpu_ms"] / off["cpu_ms"], 3)
        out[f"p50_ratio_c{c}"] = round(on["p50_ms"] / off["p50_ms"], 3)
        out[f"added_p50_ms_c{c}"] = round(on["p50_ms"] - off["p50_ms"], 3)
    out["cpu_ratio"] = median([out["cpu_ratio_c1"], out["cpu_ratio_c32"]])
    out["target"] = {"cpu_ratio<=": TARGET_RATIO}
    out["met"] = out["cpu_ratio_c1"] <= TARGET_RATIO and out["cpu_ratio_c32"] <= TARGET_RATIO
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quota", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests-c1", type=int, default=500)
    parser.add_argument("--requests-c32", type=int, default=2000)
    args = parser.parse_args()
    with bench_redis("llmgw-bench-quota-") as redis:
        run_dir = redis.workdir
        config = run_dir / "llmgw.yaml"
        config.write_text(yaml.safe_dump({
            "redis_url": redis.url,
            "pools": [{"name": "bench", "simulate": 1}],
            "models": [{"name": MODEL, "pool": "bench"}],
            "tenants": [{"name": "unlimited", "keys": [{"env": "BENCH_OFF_KEY"}]},
                        {"name": "limited", "keys": [{"env": "BENCH_ON_KEY"}], "limits": HIGH}],
        }))
        options = StackOptions(config_path=config, run_dir=run_dir, port=free_port(), workers=1,
                               envoy_concurrency=1, log_level="WARNING",
                               sim_args=("--time-scale", "0", "--log-level", "ERROR"),
                               env={"BENCH_OFF_KEY": KEYS["off"], "BENCH_ON_KEY": KEYS["on"]})
        stack = LocalStack(options)
        with stack as info:
            pids = [c.pid for c in stack.group.children if c.name.startswith("extproc")]
            port = int(info.base_url.rpartition(":")[2])
            assert redis.proc is not None
            result = asyncio.run(measure(args, port, pids, redis.proc.pid))
    result["setup"] = {"store": "redis (one Lua admission + one settlement per request)", "extproc_workers": 1,
                       "envoy_concurrency": 1, "pod": "llmgw_sim --time-scale 0"}
    emit("quota", result)


if __name__ == "__main__":
    main()
