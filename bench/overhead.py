"""What extproc adds: a ~4 KB chat request through Envoy alone vs Envoy + extproc, in one run.

One Envoy serves three listeners built from the same envoy/envoy.yaml, all reaching the same
simulated pod (instant: --time-scale 0): the gateway listener (both ext_proc filters, llmgw
extproc), a copy without ext_proc (Envoy alone), and a copy whose filters call a null ext_proc
server (the floor Python grpc.aio sets). Rounds alternate between the paths; figures are medians.
Prints one JSON line; writes bench/results/overhead.json and overhead.png.

    python -m bench.overhead [--rounds 3] [--requests-c1 600] [--requests-c32 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson
import yaml
from rich.progress import Progress

from bench.common import RESULTS, build_request, emit, median, process_cpu_seconds, run_load
from extproc import envoyconf
from extproc.launcher import LocalStack, ProcessGroup, StackOptions, free_port

MODEL = "llama-3-8b-instruct"
TARGET_ADDED_P50_MS = 1.5
TARGET_CPU_MS = 0.6


def chat_body(size: int = 4096) -> bytes:
    """A realistic ~4 KB chat request: system prompt, a few turns, a long user message."""
    filler = "The quick brown fox jumps over the lazy dog near the river bank. "
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0.2, "messages": [
        {"role": "system", "content": "You are a concise assistant for a platform team."},
        {"role": "user", "content": "Summarise the following text."},
        {"role": "assistant", "content": "Please paste the text."},
        {"role": "user", "content": ""},
    ]}
    base = len(orjson.dumps(body))
    body["messages"][-1]["content"] = (filler * (size // len(filler) + 1))[: size - base]
    return orjson.dumps(body)


def add_bench_listeners(direct_port: int, null_port: int, null_extproc_port: int, observer: bool = True) -> Any:
    """An envoy_patch adding two copies of the gateway listener, both routed straight to the pod:
    one without ext_proc (Envoy alone), one whose two ext_proc filters call the null server."""

    def patch(config: dict[str, Any], pod_urls: dict[str, list[str]]) -> None:
        resources = config["static_resources"]
        gateway = next(l for l in resources["listeners"] if l["name"] == "llm_gateway")
        if not observer:  # diagnosis: what the accounting observer costs
            filters = gateway["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
            filters[:] = [f for f in filters if not f["name"].endswith(".observer")]
        host, _, pod_port = pod_urls["bench"][0].removeprefix("http://").partition(":")
        for name, port in (("bench_direct", direct_port), ("bench_null", null_port)):
            listener = copy.deepcopy(gateway)
            listener["name"] = name
            listener["address"]["socket_address"]["port_value"] = port
            hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
            hcm["stat_prefix"] = name
            if name == "bench_direct":
                hcm["http_filters"] = [f for f in hcm["http_filters"] if "ext_proc" not in f["name"]]
            for f in hcm["http_filters"]:
                if "ext_proc" in f["name"]:
                    f["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = "bench_null_extproc"
            hcm["route_config"]["virtual_hosts"][0]["routes"] = [
                {"match": {"prefix": "/"}, "route": {"cluster": "bench_pod", "timeout": "0s"}}]
            resources["listeners"].append(listener)
        extproc = next(c for c in resources["clusters"] if c["name"] == envoyconf.EXTPROC_CLUSTER)
        null = copy.deepcopy(extproc)
        null["name"] = null["load_assignment"]["cluster_name"] = "bench_null_extproc"
        resources["clusters"].append(null)
        envoyconf.set_cluster_address(config, "bench_null_extproc", "127.0.0.1", null_extproc_port)
        resources["clusters"].append({
            "name": "bench_pod", "type": "STATIC", "connect_timeout": "2s",
            "load_assignment": {"cluster_name": "bench_pod", "endpoints": [{"lb_endpoints": [{"endpoint": {
                "address": {"socket_address": {"address": host, "port_value": int(pod_port)}}}}]}]},
        })

    return patch


async def measure(args: argparse.Namespace, ports: dict[str, int], cpu_pids: dict[str, list[int]]
                  ) -> dict[str, Any]:
    body = chat_body()
    paths = ports
    plan = [(c, n) for c, n in ((1, args.requests_c1), (32, args.requests_c32))]
    stats: dict[tuple[str, int], list[dict[str, float]]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    with Progress(transient=True) as progress:
        task = progress.add_task("benchmark", total=(len(plan) * args.rounds + 1) * len(paths))
        for name, port in paths.items():  # warm up connections, caches and JITs of every path
            await run_load("127.0.0.1", port, build_request("127.0.0.1", port, "/v1/chat/completions", body),
                           concurrency=8, requests=400)
            progress.advance(task)
        for concurrency, requests in plan:
            for _ in range(args.rounds):
                for name, port in paths.items():
                    raw = build_request("127.0.0.1", port, "/v1/chat/completions", body)
                    pids = cpu_pids.get(name, [])
                    before = process_cpu_seconds(pids)
                    result = await run_load("127.0.0.1", port, raw, concurrency=concurrency, requests=requests)
                    used = process_cpu_seconds(pids) - before
                    if result.errors:
                        raise SystemExit(f"{name}: {result.errors} non-200 answers")
                    if pids:
                        cpu.setdefault((name, concurrency), []).append(used * 1000 / requests)
                    stats.setdefault((name, concurrency), []).append(
                        {"rps": result.rps, "p50_ms": result.p(50), "p99_ms": result.p(99)})
                    progress.advance(task)

    out: dict[str, Any] = {"bench": "overhead", "request_bytes": len(body), "rounds": args.rounds}
    for (name, concurrency), runs in stats.items():
        out[f"{name}_c{concurrency}"] = {k: median([r[k] for r in runs]) for k in ("rps", "p50_ms", "p99_ms")}
    for c in (1, 32):
        envoy, extproc = out[f"envoy_c{c}"], out[f"extproc_c{c}"]
        out[f"ratio_c{c}"] = {"rps": round(extproc["rps"] / envoy["rps"], 3),
                              "p50": round(extproc["p50_ms"] / envoy["p50_ms"], 3),
                              "p99": round(extproc["p99_ms"] / envoy["p99_ms"], 3)}
        out[f"added_p50_ms_c{c}"] = round(extproc["p50_ms"] - envoy["p50_ms"], 3)
        out[f"added_p50_ms_null_c{c}"] = round(out[f"null_c{c}"]["p50_ms"] - envoy["p50_ms"], 3)
        out[f"extproc_cpu_ms_per_request_c{c}"] = median(cpu[("extproc", c)])
        out[f"null_cpu_ms_per_request_c{c}"] = median(cpu[("null", c)])
    out["extproc_cpu_ms_per_request"] = median(cpu[("extproc", 1)] + cpu[("extproc", 32)])
    out["null_cpu_ms_per_request"] = median(cpu[("null", 1)] + cpu[("null", 32)])
    out["targets"] = {"added_p50_ms_c1<=": TARGET_ADDED_P50_MS, "cpu_ms_per_request<=": TARGET_CPU_MS}
    out["met"] = out["added_p50_ms_c1"] <= TARGET_ADDED_P50_MS and out["extproc_cpu_ms_per_request"] <= TARGET_CPU_MS
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Grouped bars: p50 and p99 latency per path and concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, c in zip(axes, (1, 32)):
        names = ["envoy", "null", "extproc"]
        p50 = [result[f"{n}_c{c}"]["p50_ms"] for n in names]
        p99 = [result[f"{n}_c{c}"]["p99_ms"] for n in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], p50, width=0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], p99, width=0.4, label="p99")
        ax.set_xticks(list(xs), ["Envoy alone", "+ null ext_proc", "+ llmgw extproc"])
        ax.set_title(f"concurrency {c}: {result[f'envoy_c{c}']['rps']:.0f} vs {result[f'extproc_c{c}']['rps']:.0f} req/s")
        ax.set_ylabel("latency (ms)")
        ax.legend()
    fig.suptitle(f"~4 KB chat request; CPU per request: llmgw {result['extproc_cpu_ms_per_request']} ms, "
                 f"null ext_proc {result['null_cpu_ms_per_request']} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests-c1", type=int, default=600)
    parser.add_argument("--requests-c32", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=1, help="extproc processes")
    parser.add_argument("--envoy-concurrency", type=int, default=1)
    parser.add_argument("--no-observer", action="store_true", help="diagnosis: drop the observer filter")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        run_dir = Path(tmp)
        config = run_dir / "llmgw.yaml"
        config.write_text(yaml.safe_dump({"pools": [{"name": "bench", "simulate": 1}],
                                          "models": [{"name": MODEL, "pool": "bench"}]}))
        direct_port, null_port = free_port(), free_port()
        group = ProcessGroup(run_dir / "logs")
        null_child = group.spawn("null-extproc", [sys.executable, "-m", "bench.null_extproc", "--port", "0"])
        null_extproc_port = int(group.wait_ready_line(null_child, 20).rpartition(":")[2])
        options = StackOptions(config_path=config, run_dir=run_dir, port=free_port(), workers=args.workers,
                               envoy_concurrency=args.envoy_concurrency, log_level="WARNING",
                               sim_args=("--time-scale", "0", "--log-level", "ERROR"),
                               envoy_patch=add_bench_listeners(direct_port, null_port, null_extproc_port,
                                                               not args.no_observer))
        stack = LocalStack(options)
        try:
            with stack as info:
                pids = [c.pid for c in stack.group.children if c.name.startswith("extproc")]
                ports = {"envoy": direct_port, "null": null_port, "extproc": int(info.base_url.rpartition(":")[2])}
                result = asyncio.run(measure(args, ports, {"extproc": pids, "null": [null_child.pid]}))
        finally:
            group.stop()
    result["setup"] = {"extproc_workers": args.workers, "envoy_concurrency": args.envoy_concurrency,
                       "pod": "extproc.sim --time-scale 0", "null": "bench.null_extproc behind the same two filters"}
    emit("overhead", result)
    plot(result, RESULTS / "overhead.png")


if __name__ == "__main__":
    main()
