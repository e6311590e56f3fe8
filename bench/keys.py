"""What API keys in Redis cost: lookups against the in-process snapshot, and reloading it from Redis.

A real redis-server holding a table of ``--keys`` keys (100,000 by default). Lookups are what the
request path does, SHA-256 of the presented key included: ``KeySnapshot.tenant_name`` for known
keys and unknown (random) keys, and the same with the bare ``dict.get`` of its table (``_dict_only``)
as the floor, so that anything put in front of the dict again shows its cost. ``apply_ms`` is what
each gateway process does when one key changed (poll, read the change log, copy and patch the
snapshot); ``reload_ms`` is a full reload (at start, or when the log no longer reaches back:
HSCAN in batches + building the snapshot), and ``reload_max_loop_block_ms`` the longest the event
loop went without running another task during one. Figures are medians over ``--rounds``.
Prints one JSON line; writes bench/results/keys.json.

    python -m bench.keys [--keys 100000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import tracemalloc
from typing import Any

from redis import asyncio as aioredis

from bench.common import bench_redis, emit, median
from extproc.config import hash_key
from extproc.keys import KeySnapshot, RedisKeyTable

TENANTS = 100


async def fill(url: str, table: RedisKeyTable, keys: list[str]) -> None:
    """Write the table straight with pipelined HSETs (``add`` one by one would take minutes), then a version."""
    client = aioredis.Redis.from_url(url)
    try:
        for start in range(0, len(keys), 10_000):
            chunk = keys[start:start + 10_000]
            await client.hset(table.table, mapping={hash_key(k).hex(): f"tenant-{i % TENANTS}"
                                                    for i, k in enumerate(chunk, start)})
        await client.set(table.version_key, 1)
    finally:
        await client.aclose()


def lookups_per_s(keys: list[str], lookup: Any) -> float:
    """Lookups per second of ``lookup(hash_key(key))`` over ``keys``."""
    started = time.perf_counter()
    for key in keys:
        lookup(hash_key(key))
    return len(keys) / (time.perf_counter() - started)


async def timed_reload(table: RedisKeyTable) -> tuple[float, float, KeySnapshot]:
    """(seconds, longest event-loop block in seconds, snapshot) of one reload."""
    longest = 0.0
    done = False

    async def ticker() -> None:
        nonlocal longest
        while not done:
            before = time.perf_counter()
            await asyncio.sleep(0)
            longest = max(longest, time.perf_counter() - before)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    started = time.perf_counter()
    snapshot = await table.snapshot()
    took = time.perf_counter() - started
    done = True
    await tick
    return took, longest, snapshot


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    known = [f"sk-llmgw-bench-{i:08d}" for i in range(args.keys)]
    unknown = [f"sk-llmgw-{os.urandom(18).hex()}" for _ in range(args.keys)]
    table = RedisKeyTable.from_url(url, timeout_s=5.0)
    try:
        await fill(url, table, known)
        reloads, blocks, applies = [], [], []
        snapshot = KeySnapshot.empty()
        for _ in range(args.rounds):
            took, block, snapshot = await timed_reload(table)
            reloads.append(took * 1000)
            blocks.append(block * 1000)
        for i in range(args.rounds):
            await table.revoke(known[-1 - i])
            started = time.perf_counter()
            snapshot = await table.refresh(snapshot)
            applies.append((time.perf_counter() - started) * 1000)
        known = known[:-args.rounds]
        tracemalloc.start()
        held = await table.snapshot()
        snapshot_bytes = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del held
    finally:
        await table.aclose()
    assert len(snapshot) == len(known) and all(snapshot.tenant_name(hash_key(k)) for k in known[:1000])
    assert not any(snapshot.tenant_name(hash_key(k)) for k in unknown)
    by_digest = snapshot.by_digest
    figures: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, keys, lookup in (("known", known, snapshot.tenant_name), ("unknown", unknown, snapshot.tenant_name),
                                   ("known_dict_only", known, by_digest.get),
                                   ("unknown_dict_only", unknown, by_digest.get)):
            figures.setdefault(name, []).append(lookups_per_s(keys, lookup))
    return {
        "bench": "keys", "keys": args.keys, "rounds": args.rounds,
        **{f"lookups_per_s_{name}": round(median(values)) for name, values in figures.items()},
        "apply_ms": median(applies), "reload_ms": median(reloads), "reload_max_loop_block_ms": median(blocks),
        "snapshot_mib": round(snapshot_bytes / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.keys", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with bench_redis("llmgw-bench-keys-") as server:
        result = asyncio.run(measure(args, server.url))
    emit("keys", result)


if __name__ == "__main__":
    main()
