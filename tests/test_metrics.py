"""GatewayMetrics: what one request and one sync write, read back from the registry."""

from __future__ import annotations

from extproc.observer import ResponseObservation, Usage
from extproc.pricing import Prices
from extproc.quota import FallbackStats
from extproc.telemetry.metrics import GatewayMetrics


def _value(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_a_streamed_response_records_tokens_duration_ttft_and_cost() -> None:
    metrics = GatewayMetrics()
    observation = ResponseObservation()
    observation.on_response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    observation.attach(observation.first_byte_at or 0.0, "/v1/chat/completions", "llama", "pool", "10.0.0.1:8000",
                       "team-a", Prices(input=1.0, output=2.0))
    observation.started -= 0.5  # as if the request began half a second ago
    observation.on_response_body(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', False)
    observation.on_response_body(b"data: [DONE]\n\n", True)
    metrics.record_response(observation, Usage(100, 50), estimated=True)
    labels = {"gen_ai_operation_name": "chat", "gen_ai_request_model": "llama", "llmgw_tenant": "team-a"}
    assert _value(metrics, "gen_ai_client_token_usage_sum", **labels, gen_ai_token_type="input") == 100
    assert _value(metrics, "gen_ai_client_token_usage_sum", **labels, gen_ai_token_type="output") == 50
    assert _value(metrics, "gen_ai_client_operation_duration_seconds_count", **labels,
                  http_response_status_code="200") == 1
    assert _value(metrics, "llmgw_time_to_first_token_seconds_count", **labels) == 1
    assert abs(_value(metrics, "llmgw_usage_cost_usd_total", gen_ai_request_model="llama", llmgw_tenant="team-a")
               - (100 * 1.0 + 50 * 2.0) / 1e6) < 1e-12
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


def test_rejections_by_status_and_code() -> None:
    metrics = GatewayMetrics()
    metrics.record_rejection(429, "rate_limit_exceeded")
    metrics.record_rejection(429, "rate_limit_exceeded")
    metrics.record_rejection(402, "insufficient_quota")
    assert _value(metrics, "llmgw_rejections_total", http_response_status_code="429",
                  error_code="rate_limit_exceeded") == 2
