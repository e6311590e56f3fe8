"""One record per request: the decision survives Envoy's metadata, and the record is built once
from the decision and what Envoy saw of the response."""

from __future__ import annotations

import pytest
from google.protobuf.struct_pb2 import Struct

from extproc.accesslog import plain
from extproc.accounting import (
    USAGE_ESTIMATED,
    USAGE_NONE,
    USAGE_REPORTED,
    Decision,
    PhaseTiming,
    ResponseFacts,
    Usage,
    build_record,
    micro_dollars,
)
from extproc.pricing import Prices
from extproc.quota.limits import Lease
from tests.helpers import make_decision

LEASE = Lease(tenant="team-a", qos="standard", lease_id="0000000000000001", reserved_tokens=300,
              admitted_ms=1_700_000_000_000, expires_ms=1_700_000_060_000, store="redis", reserved_cost=1234)


def through_envoy(decision: Decision) -> Decision:
    """The decision as the access-log entry brings it back: a protobuf Struct (numbers as doubles)."""
    struct = Struct()
    struct.update({"llmgw": decision.metadata()})
    return Decision.from_metadata(plain(struct["llmgw"]))


@pytest.mark.parametrize("decision", [
    pytest.param(make_decision(), id="plain"),
    pytest.param(make_decision(lease=LEASE, n=3, max_tokens=None, parent_span_id="b7ad6b7169203331"), id="leased"),
    pytest.param(make_decision(phases=(PhaseTiming("auth", 1_700_000_000_000_010_000, 20_000),
                                       PhaseTiming("quota", 1_700_000_000_000_100_000, 300_000))), id="phases"),
])
def test_decision_survives_envoy_metadata(decision: Decision) -> None:
    assert through_envoy(decision) == decision


@pytest.mark.parametrize("data", [{}, {"id": "x"}, {"id": "x", "started_ns": "soon"},
                                  {"id": "x", "started_ns": "1", "lease": "yes"}],
                         ids=["empty", "no-start", "bad-start", "bad-lease"])
def test_a_foreign_namespace_is_not_a_decision(data: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="not a gateway decision"):
        Decision.from_metadata(data)


START = 1_700_000_000_000_000_000
PRICES = Prices(input=1.0, output=2.0, cached=0.5)


@pytest.mark.parametrize(
    ("response", "usage", "source", "ttft_ms"),
    [
        # The pod's usage object wins over the events counted.
        (ResponseFacts(200, START + 10**9, usage=Usage(20, 40, 8), content_events=39,
                       first_event_ns=START + 50_000_000, streamed=True), Usage(20, 40, 8), USAGE_REPORTED, 50.0),
        # No usage object: one token per content event, the gateway's input estimate.
        (ResponseFacts(200, START + 10**9, content_events=39, first_event_ns=START + 50_000_000, streamed=True,
                       flags="DC"), Usage(12, 39), USAGE_ESTIMATED, 50.0),
        # Nothing generated, nothing reported (a pod that failed): the reservation stands.
        (ResponseFacts(503, START + 10**8, flags="UF"), None, USAGE_NONE, None),
        # A JSON answer: TTFT is the pod's first byte.
        (ResponseFacts(200, START + 10**9, usage=Usage(20, 5), first_byte_ns=START + 900_000_000), Usage(20, 5),
         USAGE_REPORTED, 900.0),
    ],
    ids=["reported", "estimated-after-hang-up", "none", "json"],
)
def test_record(response: ResponseFacts, usage: Usage | None, source: str, ttft_ms: float | None) -> None:
    record = build_record(make_decision(), response, PRICES)
    assert (record.usage, record.usage_source, record.ttft_ms) == (usage, source, ttft_ms)
    expected_cost = PRICES.cost(usage.input_tokens, usage.output_tokens, usage.cached_tokens) if usage else 0.0
    assert record.cost_usd == pytest.approx(expected_cost)
    assert record.charge() == ((usage.total, micro_dollars(expected_cost)) if usage else (None, None))
    assert record.duration_ms == (response.end_ns - START) / 1e6
    assert record.complete is (response.flags == "")


def test_log_fields_use_genai_names() -> None:
    record = build_record(make_decision(), ResponseFacts(200, START + 10**9, usage=Usage(3, 4)), PRICES)
    fields = record.log_fields()
    assert fields["gen_ai.request.model"] == "gpt-4o-mini" and fields["gen_ai.response.model"] == "llama-3-8b-instruct"
    assert (fields["gen_ai.usage.input_tokens"], fields["gen_ai.usage.output_tokens"]) == (3, 4)
    assert fields["gen_ai.operation.name"] == "chat" and fields["llmgw.usage.estimated"] is False
