"""Envoy CPU per streamed chunk of the response Lua filter (``envoy.filters.http.lua.response``),
against Envoy without it and against a Lua filter that only iterates the chunks (the floor any Lua
body filter pays), in one run. Each Envoy (one worker) proxies the same paced simulated pod; 256
tokens per stream, 32 concurrent streams, the usage chunk stripped as for a client that did not ask
for it. Medians of the rounds. Prints one JSON line (bench/results/response_filter.json).

    python -m bench.response_filter [--rounds 5] [--streams 160]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson
import yaml
from rich.progress import Progress

from bench.common import build_request, emit, run_stream_load
from extproc import envoyconf
from extproc.launcher import free_port

TARGET_ADDED_US = 5.0
FLOOR = '''function envoy_on_request(handle)
  handle:streamInfo():dynamicMetadata():set("llmgw.response", "on", true)
end
function envoy_on_response(handle)
  local mark = handle:streamInfo():dynamicMetadata():get("llmgw.response")
  for chunk in handle:bodyChunks() do end
end'''


def shipped_lua() -> str:
    """The response filter's script as envoy/envoy.yaml ships it."""
    config = yaml.safe_load(envoyconf.default_envoy_yaml().read_text())
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    lua = next(f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.lua.response")
    return str(lua["typed_config"]["default_source_code"]["inline_string"])


def envoy_config(port: int, pod_port: int, lua: str | None) -> dict[str, Any]:
    """One listener: [Lua] + router to the pod."""
    filters: list[dict[str, Any]] = []
    if lua is not None:
        filters.append({"name": "envoy.filters.http.lua", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": lua}}})
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    socket = {"socket_address": {"address": "127.0.0.1", "port_value": port}}
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [{"name": "bench", "address": socket, "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                             ".HttpConnectionManager",
                    "stat_prefix": "bench", "http_filters": filters,
                    "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                        {"match": {"prefix": "/"}, "route": {"cluster": "pod", "timeout": "0s"}}]}]}}}]}]}],
            "clusters": [{"name": "pod", "type": "STATIC", "connect_timeout": "2s", "load_assignment": {
                "cluster_name": "pod", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                    "address": "127.0.0.1", "port_value": pod_port}}}}]}]}}]}}


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` (schedstat: nanosecond resolution)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
        except OSError:
            continue  # a thread that ended
    return total / 1e9


async def measure(args: argparse.Namespace, ports: dict[str, tuple[int, int]]) -> dict[str, list[float]]:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                         "max_tokens": 256})
    headers = {"x-llmgw-route": "direct", "x-llmgw-strip-usage": "1"}  # as extproc marks a forwarded stream
    per_chunk: dict[str, list[float]] = {name: [] for name in ports}
    with Progress(transient=True, console=None) as progress:
        task = progress.add_task("rounds", total=args.rounds * len(ports))
        for _ in range(args.rounds):
            for name, (pid, port) in ports.items():
                raw = build_request("127.0.0.1", port, "/v1/chat/completions", body, headers)
                await run_stream_load("127.0.0.1", port, raw, concurrency=8, requests=8)  # warm
                before = cpu_seconds(pid)
                result = await run_stream_load("127.0.0.1", port, raw, concurrency=32, requests=args.streams)
                used = cpu_seconds(pid) - before
                if result.errors:
                    raise SystemExit(f"{name}: {result.failures}")
                per_chunk[name].append(used / sum(result.events) * 1e6)
                progress.advance(task)
    return per_chunk


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.response_filter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=160)
    args = parser.parse_args()
    variants = {"envoy": None, "lua_floor": FLOOR, "llmgw": shipped_lua()}
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        try:
            pod = subprocess.Popen([sys.executable, "-m", "llmgw_sim", "--host", "127.0.0.1", "--port", "0",
                                    "--log-level", "ERROR", "--model", "m", "--time-scale", "1", "--ignore-eos",
                                    "--prefill-per-token-ms", "0", "--decode-base-ms", "1.0",
                                    "--decode-per-seq-ms", "0.1"], stdout=subprocess.PIPE)
            procs.append(pod)
            assert pod.stdout is not None
            pod_port = int(pod.stdout.readline().decode().split()[1].rpartition(":")[2])
            ports: dict[str, tuple[int, int]] = {}
            for name, lua in variants.items():
                port = free_port()
                path = Path(tmp) / f"{name}.yaml"
                path.write_text(yaml.safe_dump(envoy_config(port, pod_port, lua)))
                envoy = subprocess.Popen([envoyconf.envoy_binary(), "-c", str(path), "--use-dynamic-base-id",
                                          "--concurrency", "1", "--log-level", "error"])
                procs.append(envoy)
                ports[name] = (envoy.pid, port)
            asyncio.run(_wait_listening(ports))
            per_chunk = asyncio.run(measure(args, ports))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    medians = {name: round(statistics.median(values), 2) for name, values in per_chunk.items()}
    added = round(medians["llmgw"] - medians["envoy"], 2)
    emit("response_filter", {
        "bench": "response_filter", "rounds": args.rounds, "streams_per_round": args.streams, "tokens": 256,
        "envoy_us_per_chunk": medians, "added_us_per_chunk": added,
        "lua_floor_added_us_per_chunk": round(medians["lua_floor"] - medians["envoy"], 2),
        "target_added_us<=": TARGET_ADDED_US, "met": added <= TARGET_ADDED_US,
        "rounds_us_per_chunk": {k: [round(v, 2) for v in vs] for k, vs in per_chunk.items()},
    })


async def _wait_listening(ports: dict[str, tuple[int, int]], timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    for _, port in ports.values():
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                if asyncio.get_running_loop().time() > deadline:
                    raise SystemExit(f"Envoy on {port} did not start") from None
                await asyncio.sleep(0.1)


if __name__ == "__main__":
    main()
