"""Settlement from Envoy's access log: any worker settles any request, exactly once.

Two gateways stand for two extproc workers sharing one quota store (as they share Redis or the
node's SQLite file): one decides, the other receives the access-log entry carrying the decision.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator

import orjson
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.struct_pb2 import Struct

from extproc.accesslog import AccessLogReceiver
from extproc.config import hash_key, parse_config
from extproc.envoybuild.names import ATTEMPT_LOG
from extproc.gateway import Gateway
from extproc.ledger import UsageRecord
from extproc.quota import MemoryStore
from extproc.routing.picker import Picker
from extproc.server import ExternalProcessor
from extproc.sinks import Settlement
from tests.helpers import CONFIG, post_headers, request_body, request_headers

KEY = "sk-solo"
DOCUMENT = {**CONFIG, "models": [{**CONFIG["models"][0], "price": {"input": 1.0, "output": 2.0}}],
            "tenants": [{"name": "solo", "keys": [{"sha256": hash_key(KEY).hex()}], "limits": {"concurrency": 1}}]}
CHAT = b'{"model": "llama-3-8b-instruct", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 50}'


class ListLedger:
    """A ledger sink that keeps what it is given."""

    def __init__(self) -> None:
        self.records: list[UsageRecord] = []

    async def append(self, record: UsageRecord) -> None:
        self.records.append(record)

    async def close(self) -> None:
        return None


class Worker:
    """One extproc process's objects, sharing ``store`` with the others."""

    def __init__(self, store: MemoryStore) -> None:
        config = parse_config(DOCUMENT, env={"POOL_KEY": "p"})
        self.gateway = Gateway(config, Picker(random.Random(0)))
        self.ledger = ListLedger()
        self.settlement = Settlement(self.gateway.feedback, lambda: self.gateway.config, store, self.ledger)  # type: ignore[arg-type]
        self.extproc = ExternalProcessor(self.gateway, store, self.settlement)
        self.receiver = AccessLogReceiver(self.settlement)


class _Context:
    async def abort(self, code: object, details: str) -> None:
        raise AssertionError(details)


async def decide(worker: Worker) -> list[pb.ProcessingResponse]:
    async def stream() -> AsyncIterator[pb.ProcessingRequest]:
        yield request_headers(post_headers(authorization=f"Bearer {KEY}"))
        yield request_body(CHAT)
        raise AssertionError("the servicer must close the stream once the request is decided")

    return [r async for r in worker.extproc.Process(stream(), _Context())]  # type: ignore[arg-type]


def entry(decided: pb.ProcessingResponse, usage: tuple[int, int] | None = (7, 30), events: int = 30,
          periodic: bool = False) -> al.HTTPAccessLogEntry:
    """Envoy's access-log entry for the request: its metadata, and what the Lua filter found."""
    log_entry = al.HTTPAccessLogEntry()
    common = log_entry.common_properties
    common.start_time.FromNanoseconds(1_700_000_000_000_000_000)
    common.time_to_last_downstream_tx_byte.FromNanoseconds(2_000_000_000)
    common.upstream_remote_address.socket_address.address = "10.0.0.1"
    common.upstream_remote_address.socket_address.port_value = 8000
    common.upstream_request_attempt_count = 1
    common.access_log_type = al.AccessLogType.Value("DownstreamPeriodic" if periodic else "DownstreamEnd")
    common.metadata.filter_metadata["llmgw"].CopyFrom(decided.dynamic_metadata["llmgw"])
    response = Struct()
    response.update({"on": True, "sse": True, "events": events, **(
        {"in": usage[0], "out": usage[1]} if usage else {})})
    common.metadata.filter_metadata["llmgw.response"].CopyFrom(response)
    log_entry.response.response_code.value = 200
    return log_entry


async def admitted(worker: Worker) -> pb.ProcessingResponse | None:
    """A new request's decision if the solo tenant's one slot was free (it now holds it), else None."""
    replies = await decide(worker)
    return replies[-1] if replies[-1].WhichOneof("response") == "request_body" else None


async def test_the_stream_closes_once_decided_and_the_decision_rides_as_metadata() -> None:
    worker = Worker(MemoryStore())
    replies = await decide(worker)
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    carried = replies[-1].dynamic_metadata["llmgw"]
    assert orjson.loads(carried["decision"])["lease"]["id"] == carried["id"]


async def test_an_entry_reaching_another_worker_settles_the_request_once() -> None:
    store = MemoryStore()
    a, b, c = Worker(store), Worker(store), Worker(store)
    decided = (await decide(a))[-1]
    assert await admitted(a) is None  # the one slot is held
    log_entry = entry(decided)
    b.receiver.receive(log_entry)  # the entry reached worker b
    await b.settlement.drain()
    second = await admitted(a)
    assert second is not None  # released: the next request is admitted (and holds the slot)
    # Replay the first entry: on the same worker, and on another.
    b.receiver.receive(log_entry)
    c.receiver.receive(log_entry)
    await b.settlement.drain()
    await c.settlement.drain()
    assert b.settlement.settled == 1 and b.settlement.duplicates == 1
    assert await admitted(a) is None  # the replayed release did not free the second request's slot
    b.receiver.receive(entry(second))
    await b.settlement.drain()
    (record, *_) = b.ledger.records
    assert (record.tenant, record.input_tokens, record.output_tokens) == ("solo", 7, 30)
    assert record.cost_usd == pytest.approx((7 * 1.0 + 30 * 2.0) / 1e6) and not record.usage_estimated
    assert {r.id for r in b.ledger.records + c.ledger.records} == {record.id, b.ledger.records[1].id}


async def test_a_stream_without_usage_is_estimated_from_its_content_events() -> None:
    worker = Worker(MemoryStore())
    worker.receiver.receive(entry((await decide(worker))[-1], usage=None, events=41))
    await worker.settlement.drain()
    (record,) = worker.ledger.records
    assert record.usage_estimated and record.output_tokens == 41 and record.input_tokens > 0


async def test_a_periodic_entry_renews_the_lease_and_settles_nothing() -> None:
    store = MemoryStore(lease_ttl_s=60)
    worker = Worker(store)
    decided = (await decide(worker))[-1]
    worker.receiver.receive(entry(decided, periodic=True))
    await worker.settlement.drain()
    assert worker.settlement.settled == 0 and worker.ledger.records == []
    assert await admitted(worker) is None  # still running: still holding its slot


async def test_a_refused_attempt_on_the_router_log_pauses_its_pod_for_the_time_it_asked() -> None:
    # Envoy retried the request elsewhere and its own entry names the other pod; the router's log of
    # the refused attempt (its own stream, log name llmgw-attempt) carries the pod's retry-after.
    worker = Worker(MemoryStore(lease_ttl_s=60))
    pods = worker.gateway.config.pools["general"].endpoints
    refused = al.HTTPAccessLogEntry()
    refused.common_properties.upstream_remote_address.socket_address.address = pods[0].rsplit(":", 1)[0]
    refused.common_properties.upstream_remote_address.socket_address.port_value = int(pods[0].rsplit(":", 1)[1])
    refused.response.response_code.value = 503
    refused.response.response_headers["retry-after"] = "30"

    async def messages() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
        first = als_pb2.StreamAccessLogsMessage()
        first.identifier.log_name = ATTEMPT_LOG
        first.http_logs.log_entry.append(refused)
        yield first

    await worker.receiver.StreamAccessLogs(messages(), _Context())  # type: ignore[arg-type]
    health = worker.gateway.router.health
    assert not health.is_usable(pods[0], now=time.monotonic() + 29)
    assert health.is_usable(pods[0], now=time.monotonic() + 31)
