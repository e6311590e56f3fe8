"""Engine profiles: each engine's metric names as its own source spells them (cited in
docs/engine-sources.md), and a pod read through the right profile, or through none."""

from __future__ import annotations

import math
import typing

import pytest

from extproc.config import parse_config
from extproc.config.schema import PoolSpec
from extproc.routing.engines import LLAMACPP, PROFILES, SGLANG, TGI, VLLM, scrape_targets
from extproc.routing.podstate import parse_metrics

# (engine, waiting, running): vllm/v1/metrics/loggers.py:528-538 (0.33); sglang metrics_collector.py:365-371
# (0.5.23); llama.cpp tools/server/server-task.cpp:1578-1582 (0c1e57098); TGI backends/v3/src/queue.rs:143
# and backend.rs:170 (db931fcf)
NAMES = [
    ("vllm", "vllm:num_requests_waiting", "vllm:num_requests_running"),
    ("sglang", "sglang:num_queue_reqs", "sglang:num_running_reqs"),
    ("llamacpp", "llamacpp:requests_deferred", "llamacpp:requests_processing"),
    ("tgi", "tgi_queue_size", "tgi_batch_current_size"),
]


def test_every_engine_the_config_admits_has_a_profile() -> None:
    admitted = typing.get_args(PoolSpec.model_fields["engine"].annotation)
    assert set(admitted) == set(PROFILES)


@pytest.mark.parametrize(("engine", "waiting", "running"), NAMES, ids=[n[0] for n in NAMES])
def test_the_load_metrics_are_the_engines_own_names(engine: str, waiting: str, running: str) -> None:
    profile = PROFILES[engine]
    assert profile.waiting[0] == waiting and profile.running[0] == running


# What llama-server (0c1e57098, --metrics) answers on /metrics, trimmed to the lines read.
LLAMACPP_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 300
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache.
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 100
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
"""


def test_a_llamacpp_pod_is_read_through_its_profile_and_not_through_vllms() -> None:
    state = parse_metrics("10.0.0.1:8080", LLAMACPP_METRICS, 1.0, profile=LLAMACPP)
    assert state is not None and (state.waiting, state.running) == (2.0, 4.0)
    assert (state.prefix_hits, state.prefix_queries) == (100.0, 400.0)  # queries: processed + reused
    assert math.isnan(state.kv_usage)  # llama.cpp removed its KV metrics: unknown, not empty
    assert parse_metrics("10.0.0.1:8080", LLAMACPP_METRICS, 1.0, profile=VLLM) is None  # unknown, never idle


def test_sglang_and_tgi_kv_usage() -> None:
    sglang = parse_metrics("a:1", 'sglang:num_running_reqs{tp_rank="0"} 3\nsglang:token_usage{tp_rank="0"} 0.42\n',
                           1.0, profile=SGLANG)
    assert sglang is not None and sglang.kv_usage == pytest.approx(0.42) and sglang.running == 3
    tgi = parse_metrics("a:1", "tgi_queue_size 1\ntgi_batch_current_max_tokens 2048\ntgi_batch_max_total_tokens 8192\n",
                        1.0, profile=TGI)
    assert tgi is not None and tgi.kv_usage == pytest.approx(0.25) and tgi.waiting == 1


def test_each_pod_is_scraped_with_its_pools_engine() -> None:
    config = parse_config({
        "pools": [{"name": "gpu", "endpoints": ["10.0.0.1:8000"]},
                  {"name": "cpu", "endpoints": ["10.0.1.1:8080"], "engine": "llamacpp"}],
        "models": [{"name": "big", "pool": "gpu"}, {"name": "small", "pool": "cpu"}]}, env={})
    assert scrape_targets(config) == {"10.0.0.1:8000": VLLM, "10.0.1.1:8080": LLAMACPP}
