"""What each OS process of the concurrency tests runs (importable, for multiprocessing's spawn)."""

from __future__ import annotations

import asyncio
import multiprocessing
import random
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier

from extproc.quota.limits import Admission, Quota
from extproc.quota.memory import MemoryStore
from extproc.quota.redis_store import RedisStore
from extproc.quota.store import QuotaStore


@dataclass(frozen=True)
class Job:
    """One process's share of a concurrency test."""

    target: str  # a redis:// URL, or the path of a MemoryStore file
    tenant: str
    quota: Quota
    requests: int
    seed: int
    max_reserve: int = 0  # tokens reserved: random in [1, max_reserve], 0 for none
    hold_s: float = 0.0  # keep the lease this long, then release it
    lease_ttl_s: float = 60.0


def open_store(target: str, lease_ttl_s: float = 60.0) -> QuotaStore:
    """A Redis store for a URL (one server's, or a cluster's), a node-shared MemoryStore for a file path."""
    if target.startswith(("redis://", "redis+cluster://")):
        return RedisStore.from_url(target, timeout_s=5.0, lease_ttl_s=lease_ttl_s)
    return MemoryStore(target, lease_ttl_s=lease_ttl_s)


async def _run(job: Job, barrier: Barrier) -> list[int]:
    store = open_store(job.target, job.lease_ttl_s)
    rng = random.Random(job.seed)
    reserves = [rng.randint(1, job.max_reserve) if job.max_reserve else 0 for _ in range(job.requests)]
    # Every process starts admitting at the same moment.
    await asyncio.get_running_loop().run_in_executor(None, barrier.wait)

    async def one(index: int) -> int:
        admission = Admission(job.tenant, f"{job.seed}-{index}", reserves[index])
        decision = await store.admit(admission, job.quota)
        if decision.lease is None:
            return -1
        if job.hold_s:
            await asyncio.sleep(job.hold_s)
            await store.release(decision.lease)
        return reserves[index]

    try:
        return list(await asyncio.gather(*(one(index) for index in range(job.requests))))
    finally:
        await store.close()


def run_job(job: Job, barrier: Barrier) -> list[int]:
    """Admit ``job.requests`` concurrently; the reserve of each admitted request, -1 for refused."""
    return asyncio.run(_run(job, barrier))


def entry(job: Job, barrier: Barrier, results: Queue[tuple[int, list[int]]], index: int) -> None:
    """A spawned process's main: run the job, put (index, results) on the queue."""
    results.put((index, run_job(job, barrier)))


def run_processes(jobs: list[Job], timeout_s: float = 30.0) -> list[list[int]]:
    """Run each job in its own spawned OS process, all starting together; their results in order."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(len(jobs))
    results: Queue[tuple[int, list[int]]] = context.Queue()
    processes = [context.Process(target=entry, args=(job, barrier, results, index)) for index, job in enumerate(jobs)]
    for process in processes:
        process.start()
    try:
        out = dict(results.get(timeout=timeout_s) for _ in jobs)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return [out[index] for index in range(len(jobs))]
