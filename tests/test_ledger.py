"""The usage ledger: records, costs, totals, the file sink, the Redis buffer, `llmgw usage`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson
import pytest

from extproc.accounting import REJECTED, SERVED, RequestRecord, ResponseFacts, Usage, build_record, rejection
from extproc.launcher import free_port
from extproc.ledger import FileLedger, RedisLedger, UsageRecord, ledger_record, read_file, read_stream, totals
from extproc.pricing import Prices
from llmgw_testing.redis_server import RedisServer, redis_binary
from tests.helpers import make_decision

START = 1_700_000_000_000_000_000  # epoch ns: the request headers reached the gateway
MS = 1_000_000
PRICES = Prices(1, 2, 0.5)


@pytest.mark.parametrize(
    ("tokens", "cost"),
    [
        ((1_000_000, 0, 0), 0.15),  # a million fresh input tokens at $0.15
        ((0, 1_000_000, 0), 0.60),  # a million output tokens at $0.60
        ((1_000_000, 0, 1_000_000), 0.075),  # all of them cached: the cached price
        ((2000, 500, 1000), (1000 * 0.15 + 1000 * 0.075 + 500 * 0.60) / 1e6),
    ],
)
def test_cost(tokens: tuple[int, int, int], cost: float) -> None:
    assert Prices(input=0.15, output=0.60, cached=0.075).cost(*tokens) == pytest.approx(cost)


def _served(request_id: str = "r1", tenant: str = "team-a", prices: Prices = PRICES) -> RequestRecord:
    """A streamed request served in 120 ms, first byte at 50 ms, with the pod's usage object."""
    decision = make_decision(id=uuid.uuid4().hex[:16], request_id=request_id, tenant=tenant, served_model="m",
                             started_ns=START)  # a fresh gateway id: one per request
    response = ResponseFacts(status=200, end_ns=START + 120 * MS, upstream="10.0.0.2:8000",
                             first_byte_ns=START + 50 * MS,
                             usage=Usage(input_tokens=10, output_tokens=5, cached_tokens=4))
    return build_record(decision, response, prices)


def _rejected(request_id: str = "r-429", tenant: str = "team-a") -> RequestRecord:
    """A request the gateway refused with a 429 before it reached a pod."""
    decision = make_decision(id=uuid.uuid4().hex[:16], request_id=request_id, tenant=tenant, model="m",
                             served_model="", pool="", endpoint="", stream=False, started_ns=START)
    return rejection(decision, 429, "rate_limit_exceeded", START + 2 * MS)


def test_ledger_record_of_a_served_request() -> None:
    served = _served()
    record = ledger_record(served)
    assert (record.id, record.kind, record.error) == (served.decision.id, SERVED, None)
    assert (record.tenant, record.model, record.status) == ("team-a", "m", 200)
    assert record.endpoint == "10.0.0.2:8000"  # the pod Envoy reached, not the one first picked
    assert (record.input_tokens, record.output_tokens, record.cached_tokens) == (10, 5, 4)
    assert record.cost_usd == pytest.approx((6 * 1 + 4 * 0.5 + 5 * 2) / 1e6)
    assert record.ttft_ms == pytest.approx(50.0, abs=0.01) and record.latency_ms == pytest.approx(120.0)
    assert record.complete and record.stream and not record.usage_estimated


def test_ledger_record_of_a_rejection() -> None:
    record = ledger_record(_rejected())
    assert (record.kind, record.error, record.status) == (REJECTED, "rate_limit_exceeded", 429)
    assert (record.tenant, record.model, record.endpoint) == ("team-a", "m", "")  # the model as asked
    # A refusal costs nothing and counts no tokens.
    assert (record.input_tokens, record.output_tokens, record.cost_usd, record.latency_ms) == (0, 0, 0.0, 0.0)


async def test_file_ledger_round_trip_and_totals(tmp_path: Path) -> None:
    sink = FileLedger(tmp_path / "usage.jsonl")
    for i, tenant in enumerate(["a", "a", "b"]):
        await sink.append(ledger_record(_served(f"r{i}", tenant, Prices(1, 1))))
    await sink.close()
    records = list(read_file(tmp_path / "usage.jsonl"))
    assert [r.request_id for r in records] == ["r0", "r1", "r2"]
    sums = totals(records)
    assert sums[("a", "m")].requests == 2 and sums[("a", "m")].output_tokens == 10
    assert list(totals(records, tenant="b")) == [("b", "m")]
    assert totals(records, since_ms=records[-1].ts_ms + 1) == {}


async def test_redis_ledger_buffers_while_redis_is_away_and_bounds_the_buffer() -> None:
    ledger = RedisLedger.from_url(f"redis://127.0.0.1:{free_port()}/0", buffer_limit=3, flush_interval_s=0.01)
    records = [ledger_record(_served(f"r{i}", "t", Prices())) for i in range(5)]
    for record in records:
        await ledger.append(record)  # never raises for an outage
    assert ledger.buffered == 3 and ledger.dropped == 2  # the two oldest went, loudly
    await ledger.close()


async def test_with_replicas_a_record_counts_as_written_once_a_replica_has_it(tmp_path: Path) -> None:
    # One Redis and its replica; the replica paused (SIGSTOP) acknowledges nothing: the appends
    # stay buffered, are sent again with a growing pause, and leave the buffer once it resumes.
    binary = redis_binary()
    assert binary is not None
    primary = RedisServer(binary, tmp_path / "primary")
    replica = RedisServer(binary, tmp_path / "replica")
    for server in (primary, replica):
        server.workdir.mkdir()
    primary.start()
    replica.extra_args = ("--replicaof", "127.0.0.1", str(primary.port))
    replica.start()
    ledger = RedisLedger.from_url(primary.url, replicas=1, wait_ms=50, flush_interval_s=0.02)
    try:
        deadline = time.monotonic() + 10
        while await ledger._client.execute_command("WAIT", 1, 10) < 1:  # the replica has synced
            assert time.monotonic() < deadline
        before = [ledger_record(_served(f"a{i}", "t", Prices())) for i in range(3)]
        for record in before:
            await ledger.append(record)
        assert (ledger.buffered, ledger.unreplicated) == (0, 0)
        assert replica.proc is not None
        os.kill(replica.proc.pid, signal.SIGSTOP)
        try:
            paused = [ledger_record(_served(f"b{i}", "t", Prices())) for i in range(3)]
            for record in paused:
                await ledger.append(record)
            assert ledger.buffered == 3 and ledger.unreplicated >= 1
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        while ledger.buffered:
            assert time.monotonic() < deadline + 20, ledger.buffered
            await asyncio.sleep(0.02)
        stored = await asyncio.to_thread(lambda: [r.id for r in read_stream(replica.url)])  # read on the replica
        assert {r.id for r in before + paused} <= set(stored)
    finally:
        await ledger.close()
        replica.stop()
        primary.stop()


def test_replicas_need_a_connection_to_wait_on() -> None:
    with pytest.raises(ValueError, match="XADD and WAIT together"):
        RedisLedger(None, replicas=1)  # type: ignore[arg-type]


def test_llmgw_usage_formats(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    record = ledger_record(_served())
    rejected = ledger_record(_rejected())
    second = ledger_record(_served())  # another request, same figures
    path.write_bytes(record.to_json() + b"\n" + second.to_json() + b"\n" + rejected.to_json() + b"\n")

    def run(*args: str) -> str:
        result = subprocess.run([sys.executable, "-m", "extproc.cli", "usage", "--file", str(path), *args],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        return result.stdout

    rows = json.loads(run("--format", "json"))
    # Served requests and the gateway's refusals apart; a refusal costs nothing and counts no tokens.
    assert rows == [{"tenant": "team-a", "model": "m", "requests": 2, "rejected": 1, "unsettled": 0, "input_tokens": 20,
                     "output_tokens": 10, "cached_tokens": 8, "cost_usd": round(2 * record.cost_usd, 6)}]
    assert run("--format", "csv").splitlines()[0].startswith("tenant,model,requests")
    assert "team-a" in run("--tenant", "team-a", "--since", "1h")
    assert json.loads(run("--format", "json", "--tenant", "nobody")) == []


def test_a_record_written_twice_counts_once() -> None:
    # At least once: a record whose XADD reply was lost is sent again; its id (the gateway's id of
    # the request) makes the copy count once, while two requests sharing a client's x-request-id both count.
    first = ledger_record(_served("same-client-id", "t", Prices(1, 1)))
    again = UsageRecord.from_json(first.to_json())
    other = UsageRecord(**{**orjson.loads(first.to_json()), "id": "another-request"})
    assert first.id and totals([first, again, other])[("t", "m")].requests == 2


def test_an_unsettled_mark_counts_only_when_no_worker_settled_the_request() -> None:
    from extproc.ledger import unsettled_record
    from tests.helpers import make_decision

    served = ledger_record(_served())
    lost = unsettled_record(make_decision(id="lost-one", tenant=served.tenant, served_model=served.model))
    settled_elsewhere = unsettled_record(make_decision(id=served.id, tenant=served.tenant, served_model=served.model))
    (total,) = totals([served, lost, settled_elsewhere]).values()
    assert (total.requests, total.unsettled) == (1, 1)
