"""The usage ledger: records, costs, totals, the file sink, the Redis buffer, `llmgw usage`."""

from __future__ import annotations

import json
import uuid
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from extproc.launcher import free_port
from extproc.ledger import FileLedger, RedisLedger, UsageRecord, read_file, rejection_record, totals, usage_record
from extproc.observer import ResponseObservation
from extproc.pricing import Prices


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


def _observation(request_id: str = "r1") -> ResponseObservation:
    observation = ResponseObservation(started=100.0)
    span = uuid.uuid4().hex[:16]  # the gateway's span: one per request
    observation.on_response_headers({":status": "200", "x-request-id": request_id, "content-type": "application/json",
                                     "traceparent": f"00-{'1' * 32}-{span}-01"}, False)
    observation.attach(100.0, "/v1/chat/completions", "m", "pool", "10.0.0.1:8000", "team-a", Prices(1, 2, 0.5))
    observation.first_byte_at = 100.05
    observation.on_response_body(b'{"usage":{"prompt_tokens":10,"completion_tokens":5,'
                                 b'"prompt_tokens_details":{"cached_tokens":4}}}', True)
    return observation


def test_usage_record_from_an_observation() -> None:
    record = usage_record(_observation(), "team-a", Prices(1, 2, 0.5))
    assert (record.tenant, record.model, record.status) == ("team-a", "m", 200)
    assert (record.input_tokens, record.output_tokens, record.cached_tokens) == (10, 5, 4)
    assert record.cost_usd == pytest.approx((6 * 1 + 4 * 0.5 + 5 * 2) / 1e6)
    assert record.ttft_ms == pytest.approx(50.0, abs=0.01) and record.complete


async def test_file_ledger_round_trip_and_totals(tmp_path: Path) -> None:
    sink = FileLedger(tmp_path / "usage.jsonl")
    for i, tenant in enumerate(["a", "a", "b"]):
        await sink.append(usage_record(_observation(f"r{i}"), tenant, Prices(1, 1)))
    await sink.close()
    records = list(read_file(tmp_path / "usage.jsonl"))
    assert [r.request_id for r in records] == ["r0", "r1", "r2"]
    sums = totals(records)
    assert sums[("a", "m")].requests == 2 and sums[("a", "m")].output_tokens == 10
    assert list(totals(records, tenant="b")) == [("b", "m")]
    assert totals(records, since_ms=records[-1].ts_ms + 1) == {}


async def test_redis_ledger_buffers_while_redis_is_away_and_bounds_the_buffer() -> None:
    ledger = RedisLedger.from_url(f"redis://127.0.0.1:{free_port()}/0", buffer_limit=3, flush_interval_s=0.01)
    records = [usage_record(_observation(f"r{i}"), "t", Prices()) for i in range(5)]
    for record in records:
        await ledger.append(record)  # never raises for an outage
    assert ledger.buffered == 3 and ledger.dropped == 2  # the two oldest went, loudly
    await ledger.close()


def test_llmgw_usage_formats(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    record = usage_record(_observation(), "team-a", Prices(1, 2, 0.5))
    rejected = rejection_record("r-429", "team-a", "m", 429, "rate_limit_exceeded", stream=False)
    second = usage_record(_observation(), "team-a", Prices(1, 2, 0.5))  # another request, same figures
    path.write_bytes(record.to_json() + b"\n" + second.to_json() + b"\n" + rejected.to_json() + b"\n")

    def run(*args: str) -> str:
        result = subprocess.run([sys.executable, "-m", "extproc.cli", "usage", "--file", str(path), *args],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        return result.stdout

    rows = json.loads(run("--format", "json"))
    # Served requests and the gateway's refusals apart; a refusal costs nothing and counts no tokens.
    assert rows == [{"tenant": "team-a", "model": "m", "requests": 2, "rejected": 1, "input_tokens": 20,
                     "output_tokens": 10, "cached_tokens": 8, "cost_usd": round(2 * record.cost_usd, 6)}]
    assert run("--format", "csv").splitlines()[0].startswith("tenant,model,requests")
    assert "team-a" in run("--tenant", "team-a", "--since", "1h")
    assert json.loads(run("--format", "json", "--tenant", "nobody")) == []


def test_a_record_written_twice_counts_once() -> None:
    # At least once: a record whose XADD reply was lost is sent again; its id (the gateway's span
    # id) makes the copy count once, while two requests sharing a client's x-request-id both count.
    first = usage_record(_observation("same-client-id"), "t", Prices(1, 1))
    again = UsageRecord.from_json(first.to_json())
    other = UsageRecord(**{**orjson.loads(first.to_json()), "id": "another-span"})
    assert first.id and totals([first, again, other])[("t", "m")].requests == 2
