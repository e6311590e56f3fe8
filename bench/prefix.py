"""``python -m bench.prefix``: the endpoint picker against round robin and least-in-flight, on a
workload that rewards prefix-cache affinity.

Many users share a few long system prompts and hold multi-turn sessions (each turn resends the
whole conversation, as chat clients do). One stack runs three identical pools of simulated pods,
each picked by one policy (``scored``: the picker with its default weights; ``least_in_flight``;
``round_robin``), and the same workload drives the three at once, so they share the machine's
noise. Each pod's KV cache is sized so that it cannot hold every system prompt: a policy that
scatters a prompt over all pods evicts and prefills it again.

Reported per policy: the prefix-cache hit rate from the pods' own metrics
(``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``, deltas over the run), the
time to first token (p50/p99) seen by the clients, streamed, and how often a session's next turn
went to the pod of its previous turn (from the pods' request records). One JSON line; a PNG plot.
Targets: hit rate >= 85 % for ``scored``, and its TTFT p50 below both baselines.

``--engine llamacpp`` runs real llama.cpp pods instead (SmolLM2-135M on CPU, 4 slots each: CPU
figures): the hit rate is then llama.cpp's own (``llamacpp:prompt_tokens_cached_total`` over
cached plus processed prompt tokens), and stickiness is not reported (the engine keeps no
request records).
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

from bench.common import RESULTS, emit, percentile
from extproc.launcher import LocalStack, StackOptions
from extproc.routing.engines import PROFILES
from extproc.routing.podstate import parse_metrics

POLICIES = ("scored", "least_in_flight", "round_robin")
TARGET_HIT_RATE = 0.85
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu amber birch cedar dune ember fjord "
         "glade harbor islet jade karst lagoon mesa north orchid prairie quartz ridge savanna tundra").split()


def system_prompt(rng: random.Random, words: int) -> str:
    """A long, distinct system prompt (a product's instructions, policies and examples)."""
    return "You are the assistant of a product team. Follow these instructions. " + " ".join(
        rng.choice(WORDS) for _ in range(words))


def user_turn(rng: random.Random, words: int) -> str:
    """A short user message."""
    return "Question: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "?"


def config(pods: int, weights: dict[str, float] | None = None, engine: str = "vllm") -> dict[str, Any]:
    """Three identical pools, one per policy, and one model in each (``weights``: the scored
    picker's, else its defaults)."""
    def picker(policy: str) -> dict[str, Any]:
        return {"kind": policy, **({"weights": weights} if weights and policy == "scored" else {})}

    return {
        "pools": [{"name": policy, "simulate": pods, "picker": picker(policy), "engine": engine}
                  for policy in POLICIES],
        "models": [{"name": f"model-{policy}", "pool": policy} for policy in POLICIES],
        "endpoint_picker": {"scrape": {"interval_s": 0.2}},
    }


async def prefix_counters(session: aiohttp.ClientSession, urls: list[str], engine: str = "vllm"
                          ) -> tuple[float, float]:
    """(hits, queries) summed over the pods' prefix-cache counters, in tokens, read under their
    engine's names (``extproc.routing.engines``)."""
    hits = queries = 0.0
    for url in urls:
        async with session.get(f"{url}/metrics") as response:
            text = await response.text()
        state = parse_metrics(url, text, 0.0, profile=PROFILES[engine])
        if state is not None:
            hits += state.prefix_hits
            queries += state.prefix_queries
    return hits, queries


async def chat_turn(session: aiohttp.ClientSession, url: str, model: str, messages: list[dict[str, str]],
                    max_tokens: int, request_id: str) -> tuple[float, str]:
    """One streamed turn: (seconds to the first content, the answer's text)."""
    body = {"model": model, "messages": messages, "stream": True, "max_tokens": max_tokens}
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    async with session.post(f"{url}/v1/chat/completions", data=orjson.dumps(body),
                            headers={"content-type": "application/json", "x-request-id": request_id}) as response:
        if response.status != 200:
            raise RuntimeError(f"{model}: HTTP {response.status}: {(await response.text())[:200]}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(line[6:])
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    if first is None:
                        first = time.perf_counter() - started
                    parts.append(text)
    return (first if first is not None else time.perf_counter() - started), "".join(parts)


async def drive(base_url: str, policy: str, sessions: list[tuple[str, list[str]]], concurrency: int,
                max_tokens: int, progress: Progress, task: Any) -> list[float]:
    """Every session's turns in order, ``concurrency`` sessions at a time: the TTFTs."""
    ttfts: list[float] = []
    queue = list(sessions)
    timeout = aiohttp.ClientTimeout(total=120)

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue:
            number = len(sessions) - len(queue)
            system, turns = queue.pop(0)
            messages = [{"role": "system", "content": system}]
            for i, turn in enumerate(turns):
                messages.append({"role": "user", "content": turn})
                ttft, answer = await chat_turn(session, base_url, f"model-{policy}", messages, max_tokens,
                                               f"{policy}:{number}:{i}")
                ttfts.append(ttft)
                messages.append({"role": "assistant", "content": answer})
                progress.advance(task)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return ttfts


async def stickiness(session: aiohttp.ClientSession, urls: list[str]) -> float:
    """The share of follow-up turns served by the pod that served the session's previous turn
    (from the pods' request records)."""
    pod_of: dict[tuple[str, int], str] = {}
    for url in urls:
        async with session.get(f"{url}/debug/requests") as response:
            for seen in (await response.json())["requests"]:
                request_id = {k.lower(): v for k, v in seen["headers"].items()}.get("x-request-id", "")
                _, number, turn = request_id.split(":")
                pod_of[(number, int(turn))] = url
    follow_ups = [(number, turn) for number, turn in pod_of if turn > 0]
    same = sum(pod_of.get((number, turn - 1)) == pod_of[(number, turn)] for number, turn in follow_ups)
    return same / max(1, len(follow_ups))


async def run(info: Any, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompts = [system_prompt(rng, args.system_words) for _ in range(args.system_prompts)]
    # Users come back to their product's prompt; sessions of a prompt are spread over the run.
    sessions = [(prompts[rng.randrange(len(prompts))], [user_turn(rng, args.user_words) for _ in range(args.turns)])
                for _ in range(args.sessions)]
    async with aiohttp.ClientSession() as session:
        before = {p: await prefix_counters(session, info.pod_urls[p], args.engine) for p in POLICIES}
    with Progress(transient=True) as progress:
        tasks = {p: progress.add_task(p, total=len(sessions) * args.turns) for p in POLICIES}
        results = await asyncio.gather(*(drive(info.base_url, p, sessions, args.concurrency, args.max_tokens,
                                               progress, tasks[p]) for p in POLICIES))
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        for policy, ttfts in zip(POLICIES, results, strict=True):
            hits, queries = await prefix_counters(session, info.pod_urls[policy], args.engine)
            hit_rate = (hits - before[policy][0]) / max(1.0, queries - before[policy][1])
            out[policy] = {"hit_rate": round(hit_rate, 4), "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 1),
                           "ttft_p99_ms": round(percentile(ttfts, 99) * 1000, 1), "requests": len(ttfts)}
            if args.engine == "vllm":  # the simulated pods keep request records; a real engine does not
                out[policy]["session_stickiness"] = round(await stickiness(session, info.pod_urls[policy]), 3)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Hit rate and TTFT per policy, side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(POLICIES, [result[p]["hit_rate"] * 100 for p in POLICIES], color=["tab:green", "tab:gray", "tab:gray"])
    left.axhline(TARGET_HIT_RATE * 100, color="tab:red", linestyle="--", label="target")
    left.set_ylabel("prefix-cache hit rate (%)")
    left.legend()
    x = range(len(POLICIES))
    right.bar([i - 0.2 for i in x], [result[p]["ttft_p50_ms"] for p in POLICIES], width=0.4, label="p50")
    right.bar([i + 0.2 for i in x], [result[p]["ttft_p99_ms"] for p in POLICIES], width=0.4, label="p99")
    right.set_xticks(list(x), POLICIES)
    right.set_ylabel("time to first token (ms)")
    right.legend()
    fig.suptitle("bench.prefix: shared system prompts, multi-turn sessions")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    """Start the stack, run the workload on the three pools at once, print one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("vllm", "llamacpp"), default="vllm",
                        help="simulated vLLM pods, or real llama.cpp ones (SmolLM2 on CPU)")
    parser.add_argument("--pods", type=int, default=4, help="pods per pool")
    parser.add_argument("--system-prompts", type=int, default=12)
    parser.add_argument("--system-words", type=int, default=900, help="about 1.3 tokens each")
    parser.add_argument("--sessions", type=int, default=96)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user-words", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8, help="sessions at once, per pool")
    parser.add_argument("--kv-cache-tokens", type=int, default=8000,
                        help="per pod: room for about a third of the system prompts")
    parser.add_argument("--workers", type=int, default=2, help="extproc workers")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--weight", action="append", default=[], metavar="SCORER=W",
                        help="a scored-picker weight instead of the default (repeatable), e.g. prefix=3")
    args = parser.parse_args(argv)
    with TemporaryDirectory(prefix="llmgw-prefix-") as tmp:
        run_dir = Path(tmp)
        path = run_dir / "llmgw.yaml"
        weights = {name: float(value) for name, _, value in (w.partition("=") for w in args.weight)}
        path.write_text(yaml.safe_dump(config(args.pods, weights, args.engine)))
        options = StackOptions(config_path=path, run_dir=run_dir, port=0, workers=args.workers, envoy_concurrency=2,
                               log_level="WARNING", sim_args=(
                                   "--kv-cache-tokens", str(args.kv_cache_tokens),
                                   "--max-model-len", str(min(8192, args.kv_cache_tokens)),
                                   "--log-level", "ERROR", "--seed", str(args.seed),
                                   "--record", str(args.sessions * args.turns)))
        with LocalStack(options) as info:
            result = asyncio.run(run(info, args))
    scored = result["scored"]
    out: dict[str, Any] = {
        "bench": "prefix", **{k: v for k, v in vars(args).items()}, **result,
        "target_hit_rate": TARGET_HIT_RATE,
        "target_met": scored["hit_rate"] >= TARGET_HIT_RATE and all(
            scored["ttft_p50_ms"] < result[p]["ttft_p50_ms"] for p in POLICIES[1:]),
    }
    name = "prefix" if args.engine == "vllm" else f"prefix-{args.engine}"
    plot(result, RESULTS / f"{name}.png")
    emit(name, out)


if __name__ == "__main__":
    main()
