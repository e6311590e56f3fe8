"""``python -m bench.cache``: the response cache's penetration guard, a cache hit's latency, and a
pool failing mid-run with and without a fallback chain, in one run.

1. ``penetration``: three stacks, each with its own redis-server and a model that caches answers,
   differing only in ``response_cache``: ``guard_on`` (the Bloom filter, 1 MiB, k=3, and the hot-key
   allow-list, as shipped), ``guard_off`` (every lookup reaches Redis: no filter, no allow-list) and
   ``guard_small`` (a filter of ``--small-bloom-bits``, so small that false positives show, to check
   the measurement against the formula). Each round floods every stack in turn (the order rotates)
   with ``--flood`` never-seen deterministic prompts (temperature 0, ``max_tokens`` 1,
   ``--flood-concurrency`` clients). Redis commands per request are ``INFO commandstats`` deltas,
   net of what each Redis serves idle (key-table polls, the stream tail), measured before the
   rounds; a phase ends once every miss's answer is stored (``XLEN llmgw:rc:added``). The
   false-positive rate is the share of lookups that passed the filter and missed in Redis, from
   Redis (net GETs / requests) and from extproc's own counters (``llmgw_cache_lookups_total``:
   ``miss`` / (``miss`` + ``filtered``)), next to the filter's expected rate
   ``(1 - e^(-k n / m))^k`` for the ``n`` keys it held.
2. ``hit_latency``: on the ``guard_on`` stack, at concurrency 1, one warmed key asked ``--hits``
   times (``hit``: after its third hit it is on the hot-key allow-list, answered without Redis), the
   same on the ``guard_off`` stack (``hit_redis``: every hit a GET), never-seen prompts (``miss``:
   the filter answers, the pod answers, the answer is stored) and the hit's bytes sent to a listener
   of the same Envoy that routes straight to the pod (``envoy``: Envoy alone; decompressors and
   router, as ``bench.overhead`` builds it). Pods answer instantly (``--time-scale 0``). The lanes
   take turns; the added p50 of a hit over Envoy alone is p50(hit) - p50(envoy), and
   p50(hit_redis) - p50(envoy) for a hit that reaches Redis.
3. ``pool_failure``: per round two fresh stacks run at once, pools ``big`` and ``small`` (2 pods
   each, the simulator's default cost model), ``big-model`` with ``fallback: [small-model]``
   (``chain``) and without (``no_chain``); both get the same open-loop Poisson arrivals to
   ``big-model`` for ``--fail-seconds``; ``--fail-at`` seconds in, every ``big`` pod is set to fail
   (``PUT /debug/faults {"error_rate": 1.0}``: 500 or 503, even odds). Breakers are the product's
   defaults. Success is an HTTP 200; p99 is over every request of the run.
4. ``lookup_us``: ``ResponseCache.lookup`` alone, in this process, against a real redis-server: a
   key on the hot-key allow-list, the same key with the allow-list off (one GET), and a never-seen
   key the Bloom filter answers; median and p99 microseconds over ``--lookups`` each.
5. ``semantic``: ``bench.cache_semantic.evaluate()``: the semantic cache with the product's
   defaults on this project's own pairs (the learned check's training pairs: in-sample).

Medians over ``--rounds``. ``checks.foreign_cpu_pct_of_a_core``: CPU the machine spent outside
the bench and its processes (latencies are a quiet machine's only near 0). One JSON line
(bench/results/cache.json); docs/cache.png.

    python -m bench.cache [--rounds 3] [--flood 400] [--hits 300] [--fail-seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import math
import os
import random
import secrets
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import aiohttp
import orjson
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families
from rich.progress import Progress

from bench.common import (
    bench_redis,
    emit,
    machine_busy_seconds,
    percentile,
    process_tree,
)
from extproc import envoyconf
from extproc.cache.store import ADDED_STREAM
from extproc.config import BreakerSpec, ResponseCacheSpec
from extproc.launcher import ChildFailed, LocalStack, StackInfo, StackOptions
from llmgw_testing.redis_server import RedisServer

MODEL = "cached-model"
BIG, SMALL = "big-model", "small-model"
HIT_LANES = ("envoy", "hit", "hit_redis", "miss")
FAIL_LANES = ("chain", "no_chain")
DIRECT_LISTENER = "bench_direct"
RedisClient = redis.Redis  # (a field of GuardLane is named redis)
REFERENCE: dict[str, Any] = {"success_rate": 0.923, "p99_ms": 410.0,
                             "source": "the reference papers' table (fallback chain)"}
BENCH_COMMANDS = {"cmdstat_info", "cmdstat_xlen"}  # what this bench itself sends to Redis
TIMEOUT = aiohttp.ClientTimeout(total=30)
SETTLE_S = 1.2  # extproc copies its counters into the metrics once a second: a phase's counts land by then
DOCS = Path(__file__).resolve().parent.parent / "docs"


# ---------------------------------------------------------------------------------------------
# Configs and the Envoy-alone listener


def cache_config(redis_url: str, guard: bool, bloom_bits: int, bloom_hashes: int) -> dict[str, Any]:
    """One pool of instant pods; its model caches deterministic answers in Redis (without the
    guard, without the hot-key allow-list too: every lookup reaches Redis)."""
    return {
        "redis_url": redis_url,
        "pools": [{"name": "local", "simulate": 1}],
        "models": [{"name": MODEL, "pool": "local", "cache": {"ttl_s": 3600}}],
        "response_cache": {"guard": guard, "bloom_bits": bloom_bits, "bloom_hashes": bloom_hashes,
                           **({} if guard else {"hot_keys": 0})},
    }


def failure_config(chain: bool, pods: int) -> dict[str, Any]:
    """Pools big and small; big-model falls back to small-model only with ``chain``."""
    return {
        "pools": [{"name": "big", "simulate": pods}, {"name": "small", "simulate": pods}],
        "models": [{"name": BIG, "pool": "big", **({"fallback": [SMALL]} if chain else {})},
                   {"name": SMALL, "pool": "small"}],
    }


def _calls_grpc(node: Any) -> bool:
    if isinstance(node, dict):
        return "envoy_grpc" in node or "google_grpc" in node or any(_calls_grpc(v) for v in node.values())
    if isinstance(node, list):
        return any(_calls_grpc(v) for v in node)
    return False


def direct_listener(config: dict[str, Any], pod_urls: dict[str, list[str]]) -> None:
    """An envoy_patch: beside the gateway listener, one on a free port (read back from the admin)
    that routes straight to the first pod, through the decompressors and the router only: Envoy
    alone, as ``bench.overhead``'s ``envoy`` lane."""
    resources = config["static_resources"]
    gateway = next(ls for ls in resources["listeners"] if ls["name"] == envoyconf.LISTENER)
    direct = copy.deepcopy(gateway)
    direct["name"] = DIRECT_LISTENER
    direct["address"]["socket_address"]["port_value"] = 0
    direct["access_log"] = [a for a in direct.get("access_log", []) if not _calls_grpc(a)]
    hcm = direct["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["stat_prefix"] = DIRECT_LISTENER
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.router"
                           or f["name"].startswith("envoy.filters.http.decompressor")]
    hcm["access_log"] = [a for a in hcm.get("access_log", []) if not _calls_grpc(a)]
    hcm.pop("tracing", None)
    hcm["route_config"]["virtual_hosts"][0]["routes"] = [
        {"match": {"prefix": "/"}, "route": {"cluster": "bench_direct_pod", "timeout": "0s"}}]
    host, _, port = next(iter(pod_urls.values()))[0].removeprefix("http://").partition(":")
    resources["listeners"].append(direct)
    resources["clusters"].append({
        "name": "bench_direct_pod", "type": "STATIC", "connect_timeout": "2s",
        "load_assignment": {"cluster_name": "bench_direct_pod", "endpoints": [{"lb_endpoints": [{
            "endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}]}]},
    })


async def listener_url(session: aiohttp.ClientSession, admin_url: str, name: str) -> str:
    """``http://host:port`` of the Envoy listener ``name`` (bound to port 0)."""
    async with session.get(f"{admin_url}/listeners?format=json") as response:
        statuses = (await response.json(content_type=None))["listener_statuses"]
    socket = next(s for s in statuses if s["name"] == name)["local_address"]["socket_address"]
    return f"http://{socket['address']}:{socket['port_value']}"


# ---------------------------------------------------------------------------------------------
# Requests


def chat_body(prompt: str, model: str = MODEL, max_tokens: int = 1, temperature: float | None = 0.0) -> bytes:
    """A chat request; deterministic (cacheable) with temperature 0."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": prompt}]}
    if temperature is not None:
        body["temperature"] = temperature
    return orjson.dumps(body)


@dataclass(frozen=True, slots=True)
class Answer:
    """One request as the client saw it: status (or what failed), latency in seconds, headers."""

    status: str  # "200", "503", ... or "timeout", "connection"
    latency: float
    cache: str = ""  # x-llmgw-cache
    decision: str = ""  # x-llmgw-decision
    model: str = ""  # the answer's "model" (who served it)
    error: str = ""  # an error answer's error.code (pool_unavailable: the gateway refused)
    sent_at: float = 0.0  # seconds since the start of its run


async def post(session: aiohttp.ClientSession, url: str, body: bytes, *, parse_model: bool = False,
               sent_at: float = 0.0) -> Answer:
    """POST ``body`` to ``url``/v1/chat/completions and read the whole answer; never raises on a
    failed request (it is an ``Answer`` too)."""
    started = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", data=body,
                                headers={"content-type": "application/json"}) as response:
            raw = await response.read()
            latency = time.perf_counter() - started
            model = error = ""
            if parse_model:
                with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                    parsed = orjson.loads(raw)
                    if response.status == 200:
                        model = str(parsed.get("model", ""))
                    else:
                        error = str(parsed.get("error", {}).get("code", ""))
            return Answer(str(response.status), latency, response.headers.get("x-llmgw-cache", ""),
                          response.headers.get("x-llmgw-decision", ""), model, error, sent_at)
    except TimeoutError:
        return Answer("timeout", time.perf_counter() - started, sent_at=sent_at)
    except aiohttp.ClientError as error:
        return Answer(f"connection: {type(error).__name__}", time.perf_counter() - started, sent_at=sent_at)


async def closed_loop(session: aiohttp.ClientSession, url: str, bodies: list[bytes], concurrency: int) -> list[Answer]:
    """Send every body, ``concurrency`` at a time, back to back."""
    queue = iter(bodies)
    answers: list[Answer] = []

    async def client() -> None:
        for body in queue:
            answers.append(await post(session, url, body))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return answers


def never_seen(count: int, tag: str) -> list[bytes]:
    """``count`` deterministic requests nobody asked before."""
    return [chat_body(f"never seen {tag} {i} {secrets.token_hex(8)}: what is the answer?") for i in range(count)]


def ms(values: list[float], q: float) -> float:
    """The q-th percentile of seconds, in ms (NaN for none)."""
    return round(percentile(values, q) * 1000, 3) if values else math.nan


# ---------------------------------------------------------------------------------------------
# 1. Penetration flood


@dataclass
class GuardLane:
    """One cache stack and its own redis-server."""

    name: str
    guard: bool
    bloom_bits: int
    bloom_hashes: int
    redis: RedisServer
    info: StackInfo
    client: RedisClient
    stack: LocalStack
    idle_per_s: dict[str, float] = field(default_factory=dict)  # command -> calls per second, idle


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Calls so far per command (``INFO commandstats``), the bench's own left out; under
    ``usec:NAME``, the microseconds Redis spent in them."""
    calls: dict[str, int] = {}
    for name, stats in client.info("commandstats").items():
        if name not in BENCH_COMMANDS:
            calls[name] = int(stats["calls"])
            calls[f"usec:{name}"] = int(stats["usec"])
    return calls


def announced(client: redis.Redis) -> int:
    """Keys stored (and announced) so far: the length of the announcement stream."""
    return int(client.xlen(ADDED_STREAM))


def expected_fp_rate(keys: int, m_bits: int, k: int) -> float:
    """A Bloom filter's false-positive rate holding ``keys``: (1 - e^(-k n / m))^k."""
    return (1.0 - math.exp(-k * keys / m_bits)) ** k


def keys_for_fp_rate(rate: float, m_bits: int, k: int) -> int:
    """How many keys a filter holds when its false-positive rate reaches ``rate``."""
    return int(-m_bits / k * math.log(1.0 - rate ** (1.0 / k)))


async def lookups(session: aiohttp.ClientSession, metrics_url: str | None) -> dict[str, float]:
    """extproc's ``llmgw_cache_lookups_total`` by outcome, summed over the node's workers."""
    if metrics_url is None:
        return {}
    async with session.get(metrics_url) as response:
        text = await response.text()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "llmgw_cache_lookups_total":
                outcome = sample.labels.get("outcome", "")
                found[outcome] = found.get(outcome, 0.0) + sample.value
    return found


async def wait_stored(client: redis.Redis, target: int, timeout_s: float = 15.0) -> bool:
    """Until ``target`` keys were announced (every miss's answer stored): True, or False at the timeout."""
    deadline = time.monotonic() + timeout_s
    while announced(client) < target:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def flood(session: aiohttp.ClientSession, lane: GuardLane, requests: int, concurrency: int,
                tag: str) -> dict[str, Any]:
    """One flood of never-seen prompts on ``lane``: Redis commands per request, the filter's
    false positives, what extproc counted."""
    calls_before, keys_before = command_calls(lane.client), announced(lane.client)
    lookups_before = await lookups(session, lane.info.metrics_url)
    started = time.monotonic()
    answers = await closed_loop(session, lane.info.base_url, never_seen(requests, tag), concurrency)
    wall = time.monotonic() - started
    misses = sum(a.status == "200" and a.cache == "miss" for a in answers)
    stored = await wait_stored(lane.client, keys_before + misses)
    await asyncio.sleep(SETTLE_S)
    calls_after, keys_after = command_calls(lane.client), announced(lane.client)
    lookups_after = await lookups(session, lane.info.metrics_url)
    elapsed = time.monotonic() - started
    deltas = {name: calls - calls_before.get(name, 0) for name, calls in calls_after.items()}
    net_all = {name: max(0.0, calls - lane.idle_per_s.get(name, 0.0) * elapsed) for name, calls in deltas.items()}
    raw = {name: calls for name, calls in deltas.items() if not name.startswith("usec:")}
    net = {name: calls for name, calls in net_all.items() if not name.startswith("usec:")}
    usec = {name.removeprefix("usec:"): calls for name, calls in net_all.items() if name.startswith("usec:")}
    outcomes = {o: lookups_after.get(o, 0.0) - lookups_before.get(o, 0.0) for o in lookups_after}
    passed = outcomes.get("miss", 0.0)  # never-seen keys: a lookup that reached the store missed there
    looked_up = passed + outcomes.get("filtered", 0.0)
    keys_mid = (keys_before + keys_after) / 2  # the filter grows during the flood
    return {
        "requests": requests, "wall_s": round(wall, 3), "rps": round(requests / wall, 1),
        "statuses": dict(Counter(a.status for a in answers)),
        "cache_header": dict(Counter(a.cache or "-" for a in answers)),
        "all_stored": stored, "keys_in_filter": keys_after,
        "get_per_request": round(net.get("cmdstat_get", 0.0) / requests, 4),
        "get_per_request_raw": round(raw.get("cmdstat_get", 0) / requests, 4),
        "commands_per_request": round(sum(net.values()) / requests, 3),
        "commands_per_request_raw": round(sum(raw.values()) / requests, 3),
        "by_command": {name.removeprefix("cmdstat_"): round(calls / requests, 3)
                       for name, calls in sorted(net.items()) if calls >= 0.5},
        # Redis's own time in those commands (commandstats usec), net of idle.
        "redis_us_per_request": round(sum(usec.values()) / requests, 2),
        "redis_us_by_command": {name.removeprefix("cmdstat_"): round(us / requests, 2)
                                for name, us in sorted(usec.items()) if us >= 1},
        "lookups": {o: int(v) for o, v in outcomes.items()},
        # Never-seen keys: every lookup that passed the filter is a false positive.
        "fp_rate_redis": round(net.get("cmdstat_get", 0.0) / requests, 4) if lane.guard else None,
        "fp_rate_extproc": round(passed / looked_up, 4) if lane.guard and looked_up else None,
        "expected_fp_rate": (expected_fp_rate(round(keys_mid), lane.bloom_bits, lane.bloom_hashes)
                             if lane.guard else None),
    }


def idle_rates(lanes: list[GuardLane], seconds: float) -> None:
    """What each Redis serves with no traffic, per command per second (subtracted from every phase)."""
    before = [command_calls(lane.client) for lane in lanes]
    started = time.monotonic()
    time.sleep(seconds)
    after = [command_calls(lane.client) for lane in lanes]
    elapsed = time.monotonic() - started
    for lane, b, a in zip(lanes, before, after, strict=True):
        lane.idle_per_s = {name: (calls - b.get(name, 0)) / elapsed for name, calls in a.items()}



# ---------------------------------------------------------------------------------------------
# 2. Hit latency


async def warm(session: aiohttp.ClientSession, url: str, body: bytes, timeout_s: float = 20.0) -> bool:
    """Ask until the cache answers (the answer is stored once its access-log entry is settled)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (await post(session, url, body)).cache == "hit":
            return True
        await asyncio.sleep(0.05)
    return False


async def hit_round(session: aiohttp.ClientSession, urls: dict[str, str], body: bytes, requests: int,
                    order: tuple[str, ...], tag: str) -> dict[str, dict[str, Any]]:
    """One round of the lanes at concurrency 1 (``urls``: where each lane sends)."""
    out: dict[str, dict[str, Any]] = {}
    for lane in order:
        if lane == "miss":
            answers = await closed_loop(session, urls[lane], never_seen(requests, tag), 1)
        else:
            answers = await closed_loop(session, urls[lane], [body] * requests, 1)
        ok = [a.latency for a in answers if a.status == "200"]
        out[lane] = {"p50_ms": ms(ok, 50), "p99_ms": ms(ok, 99), "requests": len(answers),
                     "errors": len(answers) - len(ok),
                     "cache_header": dict(Counter(a.cache or "-" for a in answers))}
    return out


# ---------------------------------------------------------------------------------------------
# 3. A pool failing mid-run


async def set_faults(session: aiohttp.ClientSession, pod_urls: list[str], faults: dict[str, Any]) -> list[str]:
    """``PUT /debug/faults`` on each pod: the problems met (empty when all took it)."""
    problems = []
    for url in pod_urls:
        try:
            async with session.put(f"{url}/debug/faults", json=faults) as response:
                if response.status not in (200, 204):
                    problems.append(f"{url}: HTTP {response.status}")
        except (TimeoutError, aiohttp.ClientError) as error:
            problems.append(f"{url}: {type(error).__name__}")
    return problems


async def failure_round(stacks: dict[str, StackInfo], seconds: float, fail_at: float, rate: float,
                        max_tokens: int, seed: int) -> tuple[dict[str, list[Answer]], list[str]]:
    """Open-loop Poisson arrivals to big-model on every stack at once (the same arrival times);
    after ``fail_at`` s every big pod of every stack fails."""
    rng = random.Random(seed)
    answers: dict[str, list[Answer]] = {lane: [] for lane in stacks}
    problems: list[str] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:
        tasks: list[asyncio.Task[None]] = []

        async def one(lane: str, body: bytes, sent_at: float) -> None:
            answers[lane].append(await post(session, stacks[lane].base_url, body, parse_model=True, sent_at=sent_at))

        started = time.perf_counter()
        failed = False
        next_at = rng.expovariate(rate)
        while True:
            now = time.perf_counter() - started
            if not failed and now >= fail_at:
                for lane in rng.sample(list(stacks), len(stacks)):  # which stack fails first: by chance
                    problems += await set_faults(session, stacks[lane].pod_urls["big"], {"error_rate": 1.0})
                failed = True
                continue
            if next_at >= seconds:
                break
            if now < next_at:
                await asyncio.sleep(min(next_at, fail_at if not failed else next_at) - now)
                continue
            body = chat_body(f"q {rng.random():.9f}: tell me something", BIG, max_tokens, temperature=None)
            tasks += [asyncio.create_task(one(lane, body, next_at)) for lane in stacks]
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return answers, problems


def _served_by(answer: Answer) -> str:
    """Which path answered a 200: the model asked for, Envoy's retry on a pod of the fallback model
    (a 429 or 5xx before the first byte), or the fallback chain (the pool's breaker open)."""
    if "fallback_from=" in answer.decision:
        return "fallback model (breaker open)"
    if answer.model and answer.model != BIG:
        return "fallback model (retry after a 429/5xx)"
    return BIG


def failure_summary(answers: list[Answer], fail_at: float) -> dict[str, Any]:
    """Success rate and latency over the whole run, and after the failure began."""
    after = [a for a in answers if a.sent_at >= fail_at]
    latencies = [a.latency for a in answers]
    ok = [a.latency for a in answers if a.status == "200"]
    fallback = [a.sent_at - fail_at for a in after if "fallback_from=" in a.decision]
    refused = [a.sent_at - fail_at for a in after if a.error == "pool_unavailable"]
    return {
        "requests": len(answers),
        "success_rate": round(len(ok) / len(answers), 4) if answers else math.nan,
        "success_rate_after_failure": (round(sum(a.status == "200" for a in after) / len(after), 4)
                                       if after else math.nan),
        "p50_ms": ms(latencies, 50), "p99_ms": ms(latencies, 99), "p99_ok_ms": ms(ok, 99),
        "statuses": dict(Counter(a.status for a in answers)),
        "errors": dict(Counter(f"{a.status} {a.error or '-'}" for a in answers if a.status != "200")),
        "served_by": dict(Counter(_served_by(a) for a in answers if a.status == "200")),
        # Seconds after the failure began: the first request the pool's breaker sent down the chain,
        # the first the gateway refused (503 pool_unavailable: the breaker open, no fallback).
        "first_breaker_fallback_s": round(min(fallback), 2) if fallback else None,
        "first_pool_unavailable_s": round(min(refused), 2) if refused else None,
    }


def timeline(answers: list[Answer], seconds: float) -> list[float | None]:
    """Share of 200s among the requests sent in each second of the run."""
    sent: list[list[int]] = [[0, 0] for _ in range(math.ceil(seconds))]
    for a in answers:
        bucket = sent[min(int(a.sent_at), len(sent) - 1)]
        bucket[0] += 1
        bucket[1] += a.status == "200"
    return [round(ok / total, 3) if total else None for total, ok in sent]


# ---------------------------------------------------------------------------------------------
# 5. The semantic cache's own evaluation


def semantic() -> dict[str, Any]:
    """``bench.cache_semantic.evaluate`` with the product's defaults, on this project's own pairs
    (the learned check's training pairs: in-sample figures)."""
    from bench.cache_semantic import evaluate

    started = time.monotonic()
    found = evaluate()
    return {"settings": {"embedder": found["embedder"], "check": found["check"], "threshold": found["threshold"]},
            "wall_s": round(time.monotonic() - started, 1), "in_sample": True, "result": found}


# ---------------------------------------------------------------------------------------------
# The run


async def lookup_costs(count: int) -> dict[str, dict[str, float]]:
    """Section 4: what one ``ResponseCache.lookup`` costs this process, by where it is answered."""
    from extproc.cache.store import HotKeys, RedisBackend, ResponseCache

    out: dict[str, dict[str, float]] = {}
    with bench_redis("llmgw-bench-lookup-") as server:
        for lane, hot in (("hot_key", HotKeys()), ("redis_get", HotKeys(size=0)), ("filtered", HotKeys())):
            cache = ResponseCache(RedisBackend(server.url), hot=hot)
            follower = asyncio.create_task(cache.follow())
            try:
                while not cache.ready.is_set():
                    await asyncio.sleep(0.01)
                key = secrets.token_bytes(32)
                await cache.store(key, b'{"kind":"chat","choices":[]}', ttl_s=3600, stale_ttl_s=0)
                asked = secrets.token_bytes(32) if lane == "filtered" else key
                for _ in range(10):  # warm: the connection, and the key onto the allow-list
                    await cache.lookup(asked)
                times = []
                for _ in range(count):
                    started = time.perf_counter()
                    await cache.lookup(asked)
                    times.append(time.perf_counter() - started)
                times.sort()
                out[lane] = {"median_us": round(statistics.median(times) * 1e6, 1),
                             "p99_us": round(times[int(0.99 * len(times))] * 1e6, 1)}
            finally:
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)
                await cache.backend.close()
    return out


def _rounded(value: float) -> float:
    """3 decimals, or 4 significant digits for a tiny rate (an expected false-positive rate: 1e-10)."""
    return round(value, 3) if abs(value) >= 0.01 or value == 0 else float(f"{value:.4g}")


def _median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median of the rounds' numbers (dicts of numbers: per key); booleans: all of
    them; other values from the last round."""
    out: dict[str, Any] = {}
    for key, last in rounds[-1].items():
        values = [r.get(key) for r in rounds]
        if isinstance(last, bool) or last is None:
            out[key] = all(values) if isinstance(last, bool) else next((v for v in values if v is not None), None)
        elif isinstance(last, (int, float)):
            numbers = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
            out[key] = _rounded(statistics.median(numbers)) if numbers else math.nan
        elif isinstance(last, dict) and all(isinstance(v, (int, float)) for v in last.values()):
            keys = {k for v in values for k in (v or {})}  # counts: a key missing from a round counted 0
            out[key] = {k: _rounded(statistics.median([(v or {}).get(k, 0) for v in values])) for k in sorted(keys)}
        else:
            out[key] = last
    return out


@contextlib.contextmanager
def guard_lanes(args: argparse.Namespace, tmp: Path) -> Iterator[list[GuardLane]]:
    """The three cache stacks, each with its redis-server; stopped after."""
    defaults = ResponseCacheSpec()
    plan = [("guard_on", True, args.bloom_bits or defaults.bloom_bits),
            ("guard_off", False, args.bloom_bits or defaults.bloom_bits)]
    if args.small_bloom_bits:
        plan.append(("guard_small", True, args.small_bloom_bits))
    with contextlib.ExitStack() as stack:
        lanes = []
        for name, guard, bits in plan:
            server = stack.enter_context(bench_redis(f"llmgw-bench-cache-{name}-"))
            run_dir = tmp / name
            run_dir.mkdir()
            path = run_dir / "llmgw.yaml"
            path.write_text(yaml.safe_dump(cache_config(server.url, guard, bits, defaults.bloom_hashes)))
            options = StackOptions(config_path=path, run_dir=run_dir, port=0, workers=args.workers,
                                   envoy_concurrency=args.envoy_concurrency, log_level="WARNING", metrics_port=0,
                                   sim_args=("--time-scale", "0", "--log-level", "ERROR"),
                                   envoy_patch=direct_listener if name == "guard_on" else None)
            local = LocalStack(options)
            info = stack.enter_context(local)
            client = redis.Redis.from_url(server.url, socket_timeout=5)
            stack.callback(client.close)
            lanes.append(GuardLane(name, guard, bits, defaults.bloom_hashes, server, info, client, local))
        yield lanes


async def cache_sections(lanes: list[GuardLane], args: argparse.Namespace, progress: Progress, task: Any
                         ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Sections 1 and 2, ``args.rounds`` rounds of each, lane order rotating."""
    floods: dict[str, list[dict[str, Any]]] = {lane.name: [] for lane in lanes}
    hits: dict[str, list[dict[str, Any]]] = {lane: [] for lane in HIT_LANES}
    on = lanes[0]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:
        direct = await listener_url(session, on.info.admin_url, DIRECT_LISTENER)
        body = chat_body("what is the boiling point of water at sea level?")
        off = next(lane for lane in lanes if lane.name == "guard_off")
        warmed = await warm(session, on.info.base_url, body) and await warm(session, off.info.base_url, body)
        urls = {"envoy": direct, "hit": on.info.base_url, "hit_redis": off.info.base_url, "miss": on.info.base_url}
        await asyncio.sleep(SETTLE_S)  # so that the warm-up's lookups are not counted in a flood
        for round_ in range(args.rounds):
            order = lanes[round_ % len(lanes):] + lanes[:round_ % len(lanes)]
            for lane in order:
                floods[lane.name].append(await flood(session, lane, args.flood, args.flood_concurrency,
                                                     f"{lane.name}-{round_}"))
                progress.advance(task)
            turn = round_ % len(HIT_LANES)
            hit_order = HIT_LANES[turn:] + HIT_LANES[:turn]
            for lane_name, found in (await hit_round(session, urls, body, args.hits, hit_order,
                                                     f"hit-{round_}")).items():
                hits[lane_name].append(found)
            await asyncio.sleep(SETTLE_S)
            progress.advance(task)
    return floods, hits, {"warmed": warmed, "direct_listener": direct}


def run_failures(args: argparse.Namespace, tmp: Path, progress: Progress, task: Any) -> dict[str, Any]:
    """Section 3: per round, fresh chain and no-chain stacks side by side (breakers start closed)."""
    rounds: dict[str, list[dict[str, Any]]] = {lane: [] for lane in FAIL_LANES}
    timelines: dict[str, list[list[float | None]]] = {lane: [] for lane in FAIL_LANES}
    problems: list[str] = []
    exits: list[str] = []
    round_errors: list[str] = []
    for round_ in range(args.rounds):
        order = FAIL_LANES if round_ % 2 == 0 else FAIL_LANES[::-1]
        try:
            answers, found = failure_stacks(args, tmp, round_, order, exits)
        except (ChildFailed, OSError) as error:
            round_errors.append(f"round {round_}: {type(error).__name__}: {error}")
            progress.advance(task)
            continue
        problems += found
        for lane in FAIL_LANES:
            rounds[lane].append(failure_summary(answers[lane], args.fail_at))
            timelines[lane].append(timeline(answers[lane], args.fail_seconds))
        progress.advance(task)
    out: dict[str, Any] = {"setup": {
        "pools": f"big and small, {args.fail_pods} simulated pods each (default cost model)",
        "load": f"open loop, Poisson {args.fail_rate:g} requests/s to {BIG} per stack, max_tokens "
                f"{args.fail_max_tokens}, the same arrivals on both stacks, both at once",
        "fail_at_s": args.fail_at, "seconds": args.fail_seconds,
        "faults": {"error_rate": 1.0, "error_status": "500 or 503, even odds"},
        "breakers": BreakerSpec().model_dump(),
    }, "reference": REFERENCE, "fault_problems": problems, "round_errors": round_errors, "child_exits": exits}
    if not rounds[FAIL_LANES[0]]:
        return {"error": "no round ran", **out}
    return {"lanes": {lane: _median_of(found) for lane, found in rounds.items()}, **out, "per_round": rounds,
            "timeline_last_round": {lane: t[-1] for lane, t in timelines.items()}}


def failure_stacks(args: argparse.Namespace, tmp: Path, round_: int, order: tuple[str, ...],
                   exits: list[str]) -> tuple[dict[str, list[Answer]], list[str]]:
    """One round of section 3: start both stacks, run the load, stop them."""
    with contextlib.ExitStack() as stack:
        infos: dict[str, StackInfo] = {}
        groups = []
        for lane in order:
            run_dir = tmp / f"fail-{lane}-{round_}"
            run_dir.mkdir()
            path = run_dir / "llmgw.yaml"
            path.write_text(yaml.safe_dump(failure_config(lane == "chain", args.fail_pods)))
            local = LocalStack(StackOptions(config_path=path, run_dir=run_dir, port=0, workers=args.workers,
                                            envoy_concurrency=args.envoy_concurrency, log_level="WARNING",
                                            sim_args=("--log-level", "ERROR", "--seed", str(round_))))
            infos[lane] = stack.enter_context(local)
            groups.append(local.group)
        answers, found = asyncio.run(failure_round(infos, args.fail_seconds, args.fail_at, args.fail_rate,
                                                   args.fail_max_tokens, round_))
        exits.extend(e.describe() for g in groups for e in g.exits)
    return answers, found


def run_cache(args: argparse.Namespace, tmp: Path, progress: Progress, task: Any,
              checks: dict[str, Any]) -> dict[str, Any]:
    """Sections 1 and 2 on the three cache stacks."""
    with guard_lanes(args, tmp) as lanes:
        idle_rates(lanes, args.idle_seconds)
        floods, hits, notes = asyncio.run(cache_sections(lanes, args, progress, task))
        checks["child_exits_cache_stacks"] = [e.describe() for lane in lanes for e in lane.stack.group.exits]
        idle = {lane.name: {k.removeprefix("cmdstat_"): round(v, 2) for k, v in lane.idle_per_s.items()
                            if v and not k.startswith("usec:")} for lane in lanes}
        bits = {lane.name: lane.bloom_bits for lane in lanes}
        k = lanes[0].bloom_hashes
    return {"penetration": penetration_summary(floods, bits, k, args, idle),
            "hit_latency": hit_summary(hits, notes, args)}


def plot(result: dict[str, Any], path: Path) -> None:
    """Six panels: Redis per request and false positives; hit latency; the failing pool."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    pen = result["penetration"]["lanes"]
    names = list(pen)
    xs = list(range(len(names)))
    ax = axes[0][0]
    commands = sorted({c for n in names for c, v in pen[n]["by_command"].items() if v >= 0.01},
                      key=lambda c: -max(pen[n]["by_command"].get(c, 0) for n in names))
    bottom = [0.0] * len(names)
    for i, command in enumerate(commands):
        values = [pen[n]["by_command"].get(command, 0.0) for n in names]
        ax.bar(xs, values, width=0.6, bottom=bottom, label=command.upper(), color=f"C{i}",
               hatch="//" if command == "get" else None, edgecolor="white")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, n in zip(xs, names, strict=True):
        ax.annotate(f"{pen[n]['redis_us_per_request']:.0f} us", (x, bottom[x]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, names)
    ax.set_ylim(0, max(bottom) * 1.3)
    ax.set_ylabel("Redis commands per request (net of idle)")
    ax.set_title(f"flood of {result['penetration']['requests']} never-seen prompts (Redis time on top)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", ncol=len(commands))

    ax = axes[0][1]
    guarded = [n for n in names if pen[n].get("expected_fp_rate") is not None]
    gx = list(range(len(guarded)))
    ax.bar([x - 0.27 for x in gx], [pen[n]["fp_rate_redis"] * 100 for n in guarded], width=0.27,
           label="observed (Redis GETs)")
    ax.bar(gx, [(pen[n]["fp_rate_extproc"] or 0) * 100 for n in guarded], width=0.27, label="observed (extproc)")
    ax.bar([x + 0.27 for x in gx], [pen[n]["expected_fp_rate"] * 100 for n in guarded], width=0.27, label="expected")
    ax.set_xticks(gx, [f"{n}\nm={pen[n]['bloom_bits']} bits" for n in guarded], fontsize=8)
    ax.set_ylabel("false positives (% of lookups)")
    ax.set_title("Bloom filter false positives", fontsize=9)
    ax.legend(fontsize=8)

    ax = axes[0][2]
    hit = result["hit_latency"]["lanes"]
    hx = list(range(len(HIT_LANES)))
    ax.bar([x - 0.2 for x in hx], [hit[n]["p50_ms"] for n in HIT_LANES], width=0.4, label="p50")
    ax.bar([x + 0.2 for x in hx], [hit[n]["p99_ms"] for n in HIT_LANES], width=0.4, label="p99")
    labels = {"envoy": "Envoy alone\n(instant pod)", "hit": "cache hit\n(hot key)",
              "hit_redis": "cache hit\n(Redis GET)", "miss": "miss\n(gateway + pod)"}
    ax.set_xticks(hx, [labels[n] for n in HIT_LANES])
    ax.set_ylabel("ms")
    ax.set_title(f"concurrency 1; hit adds {result['hit_latency']['hit_added_p50_ms_over_envoy']:.2f} ms p50 "
                 "over Envoy alone", fontsize=9)
    ax.legend(fontsize=8)

    fail = result["pool_failure"]["lanes"]
    fx = list(range(len(FAIL_LANES)))
    ax = axes[1][0]
    ax.bar(fx, [fail[n]["success_rate"] * 100 for n in FAIL_LANES], width=0.5, color=["tab:green", "tab:red"])
    ax.axhline(REFERENCE["success_rate"] * 100, color="grey", linestyle="--", label="reference 92.3%")
    for x, n in zip(fx, FAIL_LANES, strict=True):
        ax.annotate(f"{fail[n]['success_rate'] * 100:.1f}%", (x, fail[n]["success_rate"] * 100), ha="center",
                    va="bottom", fontsize=9)
    ax.set_xticks(fx, ["fallback chain", "no chain"])
    ax.set_ylabel("HTTP 200 (% of the run)")
    ax.set_ylim(0, 105)
    ax.set_title("big pool fails mid-run: success", fontsize=9)
    ax.legend(fontsize=8)

    ax = axes[1][1]
    ax.bar([x - 0.2 for x in fx], [fail[n]["p50_ms"] for n in FAIL_LANES], width=0.4, label="p50")
    ax.bar([x + 0.2 for x in fx], [fail[n]["p99_ms"] for n in FAIL_LANES], width=0.4, label="p99")
    ax.axhline(REFERENCE["p99_ms"], color="grey", linestyle="--", label="reference p99 410 ms")
    ax.set_xticks(fx, ["fallback chain", "no chain"])
    ax.set_ylabel("ms (every request, failed or not)")
    ax.set_title("big pool fails mid-run: latency", fontsize=9)
    ax.legend(fontsize=8)

    ax = axes[1][2]
    setup = result["pool_failure"]["setup"]
    for lane, color in zip(FAIL_LANES, ("tab:green", "tab:red"), strict=True):
        points = result["pool_failure"]["timeline_last_round"][lane]
        ax.plot([i + 0.5 for i, p in enumerate(points) if p is not None], [p * 100 for p in points if p is not None],
                "o-", color=color, label=lane, markersize=3)
    ax.axvline(setup["fail_at_s"], color="grey", linestyle=":", label="big pods fail")
    ax.set_xlabel("second of the run (last round)")
    ax.set_ylabel("HTTP 200 (% of requests sent that second)")
    ax.set_ylim(-5, 105)
    ax.legend(fontsize=8)
    ax.set_title("success over time", fontsize=9)
    fig.suptitle(f"bench.cache: medians of {result['rounds']} rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class TreeCpu:
    """CPU time of this process and every descendant (stacks, pods, Redis, extproc's helpers, which
    their parents may never wait for), sampled from /proc twice a second by a thread: a process
    counts from zero when born after ``start``, and loses at most its last half second."""

    _TICKS = os.sysconf("SC_CLK_TCK")

    def __init__(self, interval_s: float = 0.5) -> None:
        self._interval = interval_s
        self._at_start: dict[tuple[int, int], int] = {}  # (pid, start time) -> ticks when the meter started
        self._last: dict[tuple[int, int], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench.cache cpu", daemon=True)

    def _sample(self) -> dict[tuple[int, int], int]:
        found = {}
        for pid in process_tree(os.getpid()):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            except OSError:  # gone meanwhile
                continue
            found[(pid, int(fields[19]))] = int(fields[11]) + int(fields[12])  # utime + stime; starttime
        return found

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._last.update(self._sample())

    def start(self) -> None:
        """Read every process now and sample until `stop`."""
        self._at_start = self._sample()
        self._last.update(self._at_start)
        self._thread.start()

    def stop(self) -> float:
        """Stop sampling: the CPU seconds used since `start`."""
        self._stop.set()
        self._thread.join()
        self._last.update(self._sample())
        return sum(ticks - self._at_start.get(key, 0) for key, ticks in self._last.items()) / self._TICKS


def main(argv: list[str] | None = None) -> None:
    """Run the four sections, print one JSON line, draw docs/cache.png."""
    parser = argparse.ArgumentParser(prog="python -m bench.cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flood", type=int, default=400, help="never-seen prompts per flood")
    parser.add_argument("--flood-concurrency", type=int, default=16)
    parser.add_argument("--bloom-bits", type=int, default=0, help="the guard's filter (0: the product's default)")
    parser.add_argument("--small-bloom-bits", type=int, default=4096,
                        help="the guard_small lane's filter, small enough to show false positives (0: no such lane)")
    parser.add_argument("--hits", type=int, default=300, help="requests per hit-latency lane and round (c=1)")
    parser.add_argument("--lookups", type=int, default=5000, help="ResponseCache.lookup calls per lookup_us lane")
    parser.add_argument("--fail-seconds", type=float, default=20.0)
    parser.add_argument("--fail-at", type=float, default=5.0, help="when the big pods start failing")
    parser.add_argument("--fail-rate", type=float, default=8.0, help="requests/s to big-model (open loop), per stack")
    parser.add_argument("--fail-max-tokens", type=int, default=16)
    parser.add_argument("--fail-pods", type=int, default=2, help="pods per pool in the failure stacks")
    parser.add_argument("--workers", type=int, default=2, help="extproc processes per stack")
    parser.add_argument("--envoy-concurrency", type=int, default=1)
    parser.add_argument("--idle-seconds", type=float, default=3.0, help="idle Redis traffic measured this long")
    parser.add_argument("--skip", action="append", default=[], choices=("cache", "failure", "semantic"),
                        help="leave a section out (repeatable)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    busy_before, own = machine_busy_seconds(), TreeCpu()
    own.start()
    result: dict[str, Any] = {"bench": "cache", **{k: v for k, v in vars(args).items() if k != "skip"},
                              "skipped": args.skip}
    checks: dict[str, Any] = {}
    with TemporaryDirectory(prefix="llmgw-bench-cache-") as tmp_name, Progress(transient=True) as progress:
        tmp = Path(tmp_name)
        if "cache" not in args.skip:
            stacks = 3 if args.small_bloom_bits else 2
            task = progress.add_task("cache stacks", total=args.rounds * stacks + args.rounds)
            try:
                result.update(run_cache(args, tmp, progress, task, checks))
            except (ChildFailed, redis.RedisError, aiohttp.ClientError, OSError) as error:
                result["penetration"] = result["hit_latency"] = {"error": f"{type(error).__name__}: {error}"}
        if "failure" not in args.skip:
            task = progress.add_task("failing pool", total=args.rounds)
            result["pool_failure"] = run_failures(args, tmp, progress, task)
            checks["child_exits_failure_stacks"] = result["pool_failure"].pop("child_exits")
    if "cache" not in args.skip:
        result["lookup_us"] = asyncio.run(lookup_costs(args.lookups))
    if "semantic" not in args.skip:
        result["semantic"] = semantic()
    # CPU the machine spent outside this bench and everything it started: work beside it (a test
    # suite, another benchmark) shows here, and its latencies are then not a quiet machine's.
    wall = time.monotonic() - started
    foreign = (machine_busy_seconds() - busy_before) - own.stop()
    checks["foreign_cpu_pct_of_a_core"] = round(foreign / wall * 100, 1)
    result["checks"] = checks
    result["setup"] = {"workers_per_stack": args.workers, "envoy_concurrency": args.envoy_concurrency,
                       "cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
                       "wall_s": round(time.monotonic() - started, 1)}
    emit("cache", result)  # first: a plot that fails loses no figure
    if all("lanes" in result.get(section, {}) for section in ("penetration", "hit_latency", "pool_failure")):
        DOCS.mkdir(exist_ok=True)
        plot(result, DOCS / "cache.png")


def penetration_summary(floods: dict[str, list[dict[str, Any]]], bits: dict[str, int], k: int,
                        args: argparse.Namespace, idle: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Section 1's medians and what they mean."""
    lanes = {name: {**_median_of(found), "bloom_bits": bits[name], "k": k,
                    "expected_fp_rate_per_round": [r["expected_fp_rate"] for r in found],
                    "fp_rate_extproc_per_round": [r["fp_rate_extproc"] for r in found]}
             for name, found in floods.items()}
    on, off = lanes["guard_on"], lanes["guard_off"]
    return {
        "requests": args.flood, "concurrency": args.flood_concurrency, "lanes": lanes,
        "gets_saved_per_request": round(off["get_per_request"] - on["get_per_request"], 4),
        "commands_saved_per_request": round(off["commands_per_request"] - on["commands_per_request"], 3),
        "keys_for_1pct_fp_default_filter": keys_for_fp_rate(0.01, bits["guard_on"], k),
        "idle_calls_per_s": idle,
    }


def hit_summary(hits: dict[str, list[dict[str, Any]]], notes: dict[str, Any], args: argparse.Namespace
                ) -> dict[str, Any]:
    """Section 2's medians and the differences that matter."""
    lanes = {name: _median_of(found) for name, found in hits.items()}
    return {
        "requests": args.hits, "lanes": lanes, **notes,
        "hit_added_p50_ms_over_envoy": round(lanes["hit"]["p50_ms"] - lanes["envoy"]["p50_ms"], 3),
        "hit_added_p99_ms_over_envoy": round(lanes["hit"]["p99_ms"] - lanes["envoy"]["p99_ms"], 3),
        "hit_redis_added_p50_ms_over_envoy": round(lanes["hit_redis"]["p50_ms"] - lanes["envoy"]["p50_ms"], 3),
        "miss_minus_hit_p50_ms": round(lanes["miss"]["p50_ms"] - lanes["hit"]["p50_ms"], 3),
        "per_round_p50_ms": {name: [r["p50_ms"] for r in found] for name, found in hits.items()},
    }


if __name__ == "__main__":
    main()
