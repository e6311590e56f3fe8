"""GatewayMetrics: what one request's record and one sync write, read back from the registry."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.accounting import ResponseFacts, Usage, build_record, rejection
from extproc.config import parse_config
from extproc.coordinator.server import CoordinatorMetrics
from extproc.pricing import Prices
from extproc.quota import FallbackStats
from extproc.telemetry.metrics import GatewayMetrics
from tests.helpers import make_decision


def _value(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_a_streamed_response_records_tokens_duration_ttft_and_cost() -> None:
    metrics = GatewayMetrics()
    decision = make_decision(served_model="llama")
    started = decision.started_ns
    response = ResponseFacts(status=200, end_ns=started + 500_000_000, content_events=50,
                             first_event_ns=started + 40_000_000, streamed=True)
    record = build_record(decision, response, Prices(input=1.0, output=2.0))
    assert record.usage == Usage(12, 50) and record.usage_estimated  # no usage object: counted events
    metrics.record(record)
    labels = {"gen_ai_operation_name": "chat", "gen_ai_request_model": "llama", "llmgw_tenant": "team-a"}
    assert _value(metrics, "gen_ai_client_token_usage_sum", **labels, gen_ai_token_type="input") == 12
    assert _value(metrics, "gen_ai_client_token_usage_sum", **labels, gen_ai_token_type="output") == 50
    assert _value(metrics, "gen_ai_client_operation_duration_seconds_sum", **labels,
                  http_response_status_code="200") == 0.5
    assert abs(_value(metrics, "llmgw_time_to_first_token_seconds_sum", **labels) - 0.04) < 1e-9
    assert abs(_value(metrics, "llmgw_usage_cost_usd_total", gen_ai_request_model="llama", llmgw_tenant="team-a")
               - (12 * 1.0 + 50 * 2.0) / 1e6) < 1e-12
    assert _value(metrics, "llmgw_usage_estimated_total", gen_ai_request_model="llama") == 1


def test_sync_copies_store_counters_as_deltas() -> None:
    metrics = GatewayMetrics()
    stats = FallbackStats(outages=1, local_admissions=5, lost_settlements=2, in_outage=True)
    metrics.sync(stats, None)
    metrics.sync(stats, None)  # nothing new: nothing added
    assert _value(metrics, "llmgw_quota_local_admissions_total") == 5
    assert _value(metrics, "llmgw_quota_store_degraded") == 1
    stats.local_admissions, stats.in_outage = 7, False
    metrics.sync(stats, None)
    assert _value(metrics, "llmgw_quota_local_admissions_total") == 7
    assert _value(metrics, "llmgw_quota_store_outages_total") == 1
    assert _value(metrics, "llmgw_quota_store_degraded") == 0


def test_sync_copies_the_ledgers_counters() -> None:
    @dataclass
    class Ledger:
        buffered: int = 3
        dropped: int = 1
        unreplicated: int = 4

    metrics, ledger = GatewayMetrics(), Ledger()
    metrics.sync(None, ledger)
    metrics.sync(None, ledger)  # nothing new: nothing added
    ledger.unreplicated, ledger.buffered = 6, 0
    metrics.sync(None, ledger)
    assert _value(metrics, "llmgw_ledger_buffered_records") == 0
    assert _value(metrics, "llmgw_ledger_dropped_records_total") == 1
    assert _value(metrics, "llmgw_ledger_unreplicated_appends_total") == 6


def test_rejections_by_status_and_code() -> None:
    metrics = GatewayMetrics()
    decision = make_decision()
    for status, code in ((429, "rate_limit_exceeded"), (429, "rate_limit_exceeded"), (402, "insufficient_quota")):
        metrics.record(rejection(decision, status, code, decision.started_ns))
    assert _value(metrics, "llmgw_rejections_total", http_response_status_code="429",
                  error_code="rate_limit_exceeded") == 2
    assert _value(metrics, "gen_ai_client_operation_duration_seconds_count", gen_ai_operation_name="chat",
                  gen_ai_request_model="llama-3-8b-instruct", llmgw_tenant="team-a",
                  http_response_status_code="429") == 0  # refusals are not durations of served requests


def test_routing_decisions_and_semantic_routing_outcomes() -> None:
    from dataclasses import replace

    from extproc.routing.classifier import ClassifierStats

    metrics = GatewayMetrics()
    decision = replace(make_decision(), pool="code", rule="intents", intent="code", score=0.41)
    metrics.record(build_record(decision, ResponseFacts(status=200, end_ns=decision.started_ns + 1), Prices()))
    assert _value(metrics, "llmgw_routing_decisions_total", llmgw_pool="code", llmgw_rule="intents",
                  llmgw_intent="code") == 1
    stats = ClassifierStats()
    stats.outcomes.update(matched=3, busy=1)
    stats.embed_seconds = 0.5
    metrics.sync(None, None, stats, pods_known=2)
    stats.outcomes.update(matched=1)
    metrics.sync(None, None, stats, pods_known=1)
    assert _value(metrics, "llmgw_intent_classifications_total", outcome="matched") == 4
    assert _value(metrics, "llmgw_intent_classifications_total", outcome="busy") == 1
    assert _value(metrics, "llmgw_intent_embedding_seconds_total") == 0.5
    assert _value(metrics, "llmgw_picker_pods_known") == 1


def test_series_that_only_an_event_creates_are_exported_at_zero_from_the_start() -> None:
    # A dashboard panel over them reads 0 on a fresh gateway, not "no data".
    config = parse_config({"pools": [{"name": "big", "endpoints": ["10.0.0.1:8000"]},
                                     {"name": "small", "endpoints": ["10.0.0.2:8000", "10.0.0.3:8000"]}],
                           "models": [{"name": "big-model", "pool": "big", "fallback": ["small-model"]},
                                      {"name": "small-model", "pool": "small"}]}, env={})
    metrics = GatewayMetrics()
    metrics.declare(config)
    value = metrics.registry.get_sample_value
    assert value("llmgw_cache_lookups_total", {"outcome": "hit"}) == 0
    assert value("llmgw_cache_lookups_total", {"outcome": "miss"}) == 0
    assert value("llmgw_circuit_breaker_state", {"scope": "pool", "name": "small"}) == 0
    assert value("llmgw_circuit_breaker_state", {"scope": "pod", "name": "10.0.0.3:8000"}) == 0
    assert value("llmgw_fallbacks_total", {"from_model": "big-model", "to_model": "small-model"}) == 0
    assert value("llmgw_usage_estimated_total", {"gen_ai_request_model": "small-model"}) == 0
    metrics.breaker("pool", "small", "open")
    metrics.declare(config)  # a reload: an open breaker stays open
    assert value("llmgw_circuit_breaker_state", {"scope": "pool", "name": "small"}) == 2


def test_the_coordinators_batch_series_are_exported_at_zero_from_the_start() -> None:
    value = CoordinatorMetrics().registry.get_sample_value
    assert value("llmgw_batch_retries_total", {"outcome": "failed"}) == 0
    assert value("llmgw_batch_departures_total", {"reason": "window"}) == 0


def test_the_tenant_heat_map_counts_refusals_and_the_drill_down_names_the_pod() -> None:
    metrics = GatewayMetrics()
    decision = make_decision()
    metrics.record(rejection(decision, 429, "rate_limit_exceeded", decision.started_ns))
    served = build_record(decision, ResponseFacts(status=200, end_ns=decision.started_ns + 30_000_000,
                                                  upstream="10.0.0.9:8081"), None)  # the coordinator's
    metrics.record(served)
    retried = build_record(decision, ResponseFacts(status=502, end_ns=decision.started_ns + 90_000_000,
                                                   upstream="10.0.0.7:8000", attempts=2), None)
    metrics.record(retried)
    value = metrics.registry.get_sample_value
    tenant = decision.tenant
    assert value("llmgw_tenant_request_duration_seconds_count", {"llmgw_tenant": tenant, "outcome": "error"}) == 2
    assert value("llmgw_tenant_request_duration_seconds_bucket", {"llmgw_tenant": tenant, "outcome": "ok",
                                                                  "le": "0.04"}) == 1  # 30 ms
    pod = {"llmgw_tenant": tenant, "llmgw_pool": decision.pool}
    assert value("llmgw_pod_requests_total", {**pod, "llmgw_pod": decision.endpoint, "outcome": "ok"}) == 1
    assert value("llmgw_pod_requests_total", {**pod, "llmgw_pod": "10.0.0.7:8000", "outcome": "error"}) == 1
