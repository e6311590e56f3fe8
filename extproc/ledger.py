"""The usage ledger: one record per finished request, appended where nothing gets lost.

With Redis the records go to a Redis Stream (``XADD``). While Redis is unreachable they wait, in
order, in a bounded in-process buffer and are flushed when it answers again; only a buffer
overflow drops records, and those are counted and logged. Delivery is at least once: an ``XADD``
whose reply timed out is sent again, so readers (``totals``, ``llmgw usage``) count a record
``id`` (the gateway's id of the request, unique per request whatever the client sends as
its request id) once. Without Redis, records are appended as
JSON lines to a file the node's workers share (``O_APPEND`` keeps each line whole).

Redis replicates asynchronously: when the stream's primary dies, the replica taking over may lack
the last appends it acknowledged. With ``ledger.replicas`` > 0 each append is followed, on the
same connection, by ``WAIT replicas wait_ms``: a record counts as written only once that many
replicas have it, and stays buffered (sent again, with a growing pause while replicas lag) until
then, so a failover loses none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import orjson
from redis import asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc.accounting import REJECTED, SERVED, UNSETTLED, Decision, RequestRecord

log = logging.getLogger("llmgw.ledger")
STREAM = "llmgw:usage"
BUFFER_LIMIT = 100_000
FLUSH_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One finished request, as the ledger keeps it: ``kind`` ``served`` (it reached a pod) or
    ``rejected`` (the gateway answered it: a tenant's 400, 402, 403, 404, 413, 429...; ``error``
    is the OpenAI error code). Unauthenticated requests are not recorded: no tenant to bill."""

    ts_ms: int
    request_id: str
    tenant: str
    model: str
    pool: str
    endpoint: str
    status: int
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    cost_usd: float
    latency_ms: float
    ttft_ms: float | None
    stream: bool
    complete: bool
    usage_estimated: bool = False  # counted by the gateway: the pod reported no usage
    id: str = ""  # the gateway's request id: unique, so a record sent twice counts once
    kind: str = SERVED  # or REJECTED, UNSETTLED
    error: str | None = None  # a rejection's error code (rate_limit_exceeded, model_not_found...)

    def to_json(self) -> bytes:
        """The record as one JSON object (orjson serializes the dataclass natively: no asdict copy)."""
        return orjson.dumps(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> UsageRecord:
        """Parse ``to_json``'s output."""
        return cls(**orjson.loads(data))


class LedgerSink(Protocol):
    """Where usage records go."""

    async def append(self, record: UsageRecord) -> None:
        """Keep one record (never raises for an outage: buffer instead)."""
        ...

    async def close(self) -> None:
        """Flush what can be flushed and release resources."""
        ...


class FileLedger:
    """JSON lines in one file shared by the node's workers."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    async def append(self, record: UsageRecord) -> None:
        """One ``write`` per record: appends from several processes never interleave."""
        os.write(self._fd, record.to_json() + b"\n")

    async def close(self) -> None:
        """Close the file."""
        os.close(self._fd)


class NotReplicated(Exception):
    """Fewer replicas than asked for acknowledged an append within ``wait_ms``."""


class Replicated(Protocol):
    """A connection that sends commands together (``extproc.quota.cluster.pipelined``)."""

    async def calls(self, commands: list[tuple[str | int | bytes, ...]], *, key: str | bytes) -> list[Any]: ...

    async def close(self) -> None: ...


class RedisLedger:
    """``XADD`` to a Redis Stream, with a bounded buffer while Redis is away (or, with
    ``replicas``, until replicas have each record)."""

    def __init__(self, client: aioredis.Redis, stream: str = STREAM, buffer_limit: int = BUFFER_LIMIT,
                 flush_interval_s: float = FLUSH_INTERVAL_S, replicas: int = 0, wait_ms: int = 100,
                 durable: Replicated | None = None) -> None:
        if replicas and durable is None:
            raise ValueError("replicas needs a connection to send XADD and WAIT together on")
        self._client = client
        self.stream = stream
        self._buffer: deque[bytes] = deque()
        self._limit = buffer_limit
        self._interval = flush_interval_s
        self._flusher: asyncio.Task[None] | None = None
        self.replicas, self.wait_ms = replicas, wait_ms
        self._durable = durable if replicas else None
        self.dropped = 0  # records lost to a full buffer (a metric; zero unless an outage outlasts it)
        self.unreplicated = 0  # appends that fewer than ``replicas`` replicas acknowledged in time (kept, sent again)

    @classmethod
    def from_url(cls, url: str, *, replicas: int = 0, wait_ms: int = 100, buffer_limit: int = BUFFER_LIMIT,
                 flush_interval_s: float = FLUSH_INTERVAL_S) -> RedisLedger:
        """A ledger on a new client with short timeouts (an append must never stall a request)."""
        from extproc.quota.cluster import client, pipelined

        durable = pipelined(url, timeout_s=wait_ms / 1000 + 0.5) if replicas else None
        return cls(client(url, socket_timeout=0.5, socket_connect_timeout=0.5), buffer_limit=buffer_limit,
                   flush_interval_s=flush_interval_s, replicas=replicas, wait_ms=wait_ms, durable=durable)

    @property
    def buffered(self) -> int:
        """Records waiting for Redis to come back."""
        return len(self._buffer)

    async def append(self, record: UsageRecord) -> None:
        """Append now, or buffer (keeping order) while Redis is unreachable."""
        data = record.to_json()
        if not self._buffer:
            try:
                await self._write([data])
                return
            except NotReplicated as error:
                self.unreplicated += 1
                if self.unreplicated == 1 or self.unreplicated % 1000 == 0:
                    log.warning("usage ledger: %s; keeping the record to send again", error)
            except (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, OSError) as error:
                log.error("usage ledger: Redis unreachable (%s); buffering records", error)
        self._keep(data)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_until_empty())

    def _keep(self, data: bytes) -> None:
        if len(self._buffer) >= self._limit:
            self._buffer.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.error("usage ledger buffer full: %d records dropped so far", self.dropped)
        self._buffer.append(data)

    async def _flush_until_empty(self) -> None:
        pause = self._interval
        while self._buffer:
            try:
                await self.flush()
            except (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, OSError):
                await asyncio.sleep(self._interval)
            except NotReplicated:  # each try writes the batch again: pause longer while replicas lag
                await asyncio.sleep(pause)
                pause = min(pause * 2, 30 * self._interval)
        log.warning("usage ledger: Redis is back; buffered records flushed")

    async def flush(self) -> None:
        """Send buffered records in order, in pipelined batches; raises while Redis is down (or
        ``NotReplicated`` while replicas lag)."""
        while self._buffer:
            batch = list(self._buffer)[:500]
            await self._write(batch)
            for _ in batch:
                self._buffer.popleft()

    async def _write(self, batch: list[bytes]) -> None:
        """``XADD`` each record; with ``replicas``, then ``WAIT`` for them on the same connection."""
        if self._durable is None:
            if len(batch) == 1:
                await self._client.xadd(self.stream, {"r": batch[0]})
                return
            async with self._client.pipeline(transaction=False) as pipe:
                for data in batch:
                    pipe.xadd(self.stream, {"r": data})
                await pipe.execute()
            return
        commands: list[tuple[str | int | bytes, ...]] = [("XADD", self.stream, "*", "r", data) for data in batch]
        replies = await self._durable.calls([*commands, ("WAIT", self.replicas, self.wait_ms)], key=self.stream)
        failed = next((r for r in replies if isinstance(r, Exception)), None)
        if failed is not None:
            raise ConnectionError(f"redis: {failed}")
        if int(replies[-1]) < self.replicas:
            raise NotReplicated(f"{replies[-1]} of {self.replicas} replicas acknowledged within {self.wait_ms} ms")

    async def close(self) -> None:
        """Try a last flush, then close the client."""
        if self._flusher is not None:
            self._flusher.cancel()
        with contextlib.suppress(RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, OSError,
                                 NotReplicated):
            await self.flush()
        if self._buffer:
            log.error("usage ledger: %d records could not be written before shutdown", len(self._buffer))
        if self._durable is not None:
            await self._durable.close()
        await self._client.aclose()


def read_file(path: str | Path) -> Iterator[UsageRecord]:
    """Every record of a file ledger, oldest first."""
    with open(path, "rb") as lines:
        for line in lines:
            if line.strip():
                yield UsageRecord.from_json(line)


def read_stream(url: str, stream: str = STREAM, since_ms: int = 0) -> Iterator[UsageRecord]:
    """Every record of a Redis Stream ledger from ``since_ms``, oldest first (a blocking client)."""
    from extproc.quota.cluster import sync_client

    client = sync_client(url)
    start = f"{since_ms}-0"
    while True:
        entries = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(stream, min=start, count=1000))
        for _entry_id, fields in entries:
            yield UsageRecord.from_json(fields[b"r"])
        if len(entries) < 1000:
            return
        last = entries[-1][0].decode()
        ms, _, seq = last.partition("-")
        start = f"{ms}-{int(seq) + 1}"


@dataclass
class Totals:
    """Sums over records."""

    requests: int = 0  # served: they reached a pod
    rejected: int = 0  # answered by the gateway with an error
    unsettled: int = 0  # forwarded, but no access-log entry ever settled them (usage unknown)
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cost_usd: float = 0.0


def totals(records: Iterable[UsageRecord], *, tenant: str | None = None, since_ms: int = 0
           ) -> dict[tuple[str, str], Totals]:
    """Per (tenant, model) sums of the records matching the filters. A request counts once: the
    same record written twice, or an ``unsettled`` mark of a request another worker settled, is
    skipped."""
    out: dict[tuple[str, str], Totals] = {}
    records = list(records)
    settled = {r.id for r in records if r.id and r.kind != UNSETTLED}
    seen: set[str] = set()
    for record in records:
        if record.kind == UNSETTLED and record.id in settled:
            continue
        if (tenant is not None and record.tenant != tenant) or record.ts_ms < since_ms:
            continue
        if record.id:
            if record.id in seen:  # the same record written twice (its first XADD's reply was lost)
                continue
            seen.add(record.id)
        total = out.setdefault((record.tenant, record.model), Totals())
        if record.kind == REJECTED:
            total.rejected += 1
            continue
        if record.kind == UNSETTLED:
            total.unsettled += 1
            continue
        total.requests += 1
        total.input_tokens += record.input_tokens
        total.output_tokens += record.output_tokens
        total.cached_tokens += record.cached_tokens
        total.cost_usd += record.cost_usd
    return out


def ledger_record(record: RequestRecord) -> UsageRecord:
    """The ledger's line for a finished request: served (it reached a pod) or rejected."""
    d, usage = record.decision, record.usage
    input_tokens, output_tokens, cached = (usage.input_tokens, usage.output_tokens, usage.cached_tokens) \
        if usage is not None else (0, 0, 0)
    served = record.kind == SERVED
    return UsageRecord(
        id=d.id, ts_ms=now_ms(), request_id=d.request_id, tenant=d.tenant,
        model=d.served_model or d.model, pool=d.pool,
        endpoint=(record.upstream or d.endpoint) if served else "", status=record.status,
        input_tokens=input_tokens, output_tokens=output_tokens, cached_tokens=cached, cost_usd=record.cost_usd,
        latency_ms=record.duration_ms if served else 0.0, ttft_ms=record.ttft_ms, stream=d.stream,
        complete=record.complete if served else True, usage_estimated=record.usage_estimated,
        kind=record.kind, error=record.error)


def unsettled_record(decision: Decision) -> UsageRecord:
    """The ledger's mark of a forwarded request whose access-log entry never came (the stream to
    extproc was down): it happened, its usage is unknown; its lease came back by TTL."""
    return UsageRecord(
        id=decision.id, ts_ms=now_ms(), request_id=decision.request_id, tenant=decision.tenant,
        model=decision.served_model, pool=decision.pool, endpoint=decision.endpoint, status=0,
        input_tokens=decision.input_tokens, output_tokens=0, cached_tokens=0, cost_usd=0.0, latency_ms=0.0,
        ttft_ms=None, stream=decision.stream, complete=False, usage_estimated=True, kind=UNSETTLED,
        error="no_access_log_entry")


def now_ms() -> int:
    """Wall-clock milliseconds (records are ordered and filtered by it)."""
    return int(time.time() * 1000)
