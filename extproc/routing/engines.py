"""Engine profiles: what each inference engine's pods say about their load, and under which names.

A pool names its engine (``pools[].engine``); its pods are scraped and probed through that
profile. Every name here was read in the engine's own source (``docs/engine-sources.md`` cites the
file and line of each; ``tests/test_engines.py`` pins them):

============  ===========================  ==========================  =============================
engine        waiting                      running                     KV cache in use (0..1)
============  ===========================  ==========================  =============================
vllm          vllm:num_requests_waiting    vllm:num_requests_running   vllm:kv_cache_usage_perc
sglang        sglang:num_queue_reqs        sglang:num_running_reqs     sglang:token_usage
llamacpp      llamacpp:requests_deferred   llamacpp:requests_processing (none: unknown)
tgi           tgi_queue_size               tgi_batch_current_size      tgi_batch_current_max_tokens /
                                                                       tgi_batch_max_total_tokens
============  ===========================  ==========================  =============================

Prefix-cache hits and queries are token counters (vLLM's and SGLang's ``*_total``; llama.cpp counts
the prompt tokens it did not reuse apart from those it did, so its queries are their sum; TGI has
none). Only vLLM reports LoRA adapters per pod. SGLang serves ``/metrics`` only with
``--enable-metrics`` and llama.cpp only with ``--metrics``: without it, their pods are unknown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from extproc.config import GatewayConfig, Pool, PoolSpec

EngineName = Literal["vllm", "sglang", "llamacpp", "tgi"]


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """One engine's metric names and endpoints, and what the batching coordinator may send it."""

    # Each metric is a tuple of names, newest first: the first one a pod exports is read (summed
    # over its label sets), so a renamed metric's older name still serves older releases.
    name: str
    waiting: tuple[str, ...]  # gauge: requests queued for a slot or a batch
    running: tuple[str, ...]  # gauge: requests being generated
    kv_usage: tuple[str, ...] = ()  # a 0..1 gauge (mean over the pod's engines); (): see kv_used/kv_total
    kv_used: str | None = None  # ... or a ratio of two gauges (used / total); neither: unknown
    kv_total: str | None = None
    prefix_hits: tuple[str, ...] = ()  # counters, in tokens
    prefix_queries: tuple[str, ...] = ()
    queries_exclude_hits: bool = False  # the queries counter leaves the hits out: add them
    lora_info: str | None = None  # vLLM's info gauge: adapters as labels
    metrics_flag: str = ""  # the server flag without which /metrics is missing
    health_path: str = "/health"
    models_path: str = "/v1/models"
    # The coordinator: does the engine run several calls at once (continuous batching, or slots)?
    continuous: bool = True
    max_prompts: int | None = None  # prompts per merged /v1/completions call (None: no limit)
    # Chat prompts rendered by the engine itself (llama.cpp's POST /apply-template -> {"prompt"}).
    template_path: str | None = None
    # Whether merged calls pay on this engine: where they do not, a batching pool's requests go
    # direct unless it says `batching.merge: always` (bench.batching measures it per engine).
    merging_pays: bool = True

    @property
    def wanted(self) -> frozenset[str]:
        """Every metric name this profile reads."""
        names = {*self.waiting, *self.running, *self.kv_usage, *self.prefix_hits, *self.prefix_queries}
        names.update(n for n in (self.kv_used, self.kv_total, self.lora_info) if n)
        return frozenset(names)


# vllm/v1/metrics/loggers.py (vLLM 0.33): prefix-cache counters are scraped with prometheus_client's
# "_total"; the "gpu_" names before them (deprecated 2025-05, removed 2025-11) serve older releases.
VLLM = EngineProfile(
    name="vllm",
    waiting=("vllm:num_requests_waiting",),
    running=("vllm:num_requests_running",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    prefix_hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    prefix_queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    lora_info="vllm:lora_requests_info",
)
# python/sglang/srt/observability/metrics_collector.py (SGLang 0.5.23)
SGLANG = EngineProfile(
    name="sglang",
    waiting=("sglang:num_queue_reqs",),
    running=("sglang:num_running_reqs",),
    kv_usage=("sglang:token_usage",),
    prefix_hits=("sglang:cached_tokens_total",),
    prefix_queries=("sglang:prompt_tokens_total",),
    metrics_flag="--enable-metrics",
)
# tools/server/server-task.cpp and server-context.cpp (llama.cpp 0c1e57098): no KV-usage metric
# since 2025-05; prompt_tokens_total excludes the tokens reused from the cache. Its slots already
# batch whatever arrives: merged calls measured 0.88x-1.13x the throughput of direct requests
# (bench/results/batching-llamacpp.json, SmolLM2 on CPU, 4 slots) and no better latency.
LLAMACPP = EngineProfile(
    name="llamacpp",
    waiting=("llamacpp:requests_deferred",),
    running=("llamacpp:requests_processing",),
    prefix_hits=("llamacpp:prompt_tokens_cached_total",),
    prefix_queries=("llamacpp:prompt_tokens_total",),
    queries_exclude_hits=True,
    metrics_flag="--metrics",
    template_path="/apply-template",
    merging_pays=False,
)
# backends/v3/src/queue.rs and backend.rs (TGI 3.3.6-dev0): a merged call takes at most
# --max-client-batch-size prompts (4 by default; 422 past it).
TGI = EngineProfile(
    name="tgi",
    waiting=("tgi_queue_size",),
    running=("tgi_batch_current_size",),
    kv_used="tgi_batch_current_max_tokens",
    kv_total="tgi_batch_max_total_tokens",
    max_prompts=4,
)
PROFILES: dict[str, EngineProfile] = {p.name: p for p in (VLLM, SGLANG, LLAMACPP, TGI)}


def profile_of(engine: str) -> EngineProfile:
    """The profile of a pool's ``engine`` (the config admits only these names)."""
    return PROFILES[engine]


def merges(pool: Pool | PoolSpec) -> bool:
    """Whether ``pool``'s batchable requests go to the batching coordinator: batching is on, and
    merged calls pay on its engine or the pool asks for them anyway (``batching.merge: always``)."""
    return pool.batching.enabled and (pool.batching.merge == "always" or profile_of(pool.engine).merging_pays)


def scrape_targets(config: GatewayConfig) -> dict[str, EngineProfile]:
    """Every pod, with the profile of its pool's engine (a pod in two pools: the first pool's)."""
    targets: dict[str, EngineProfile] = {}
    for pool in config.pools.values():
        for endpoint in pool.endpoints:
            targets.setdefault(endpoint, profile_of(pool.engine))
    return dict(sorted(targets.items()))
