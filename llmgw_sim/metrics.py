"""``/metrics`` with vLLM's Prometheus names, labels and buckets (vllm/v1/metrics/loggers.py).

One ``CollectorRegistry`` per app, no global registry. Every series carries vLLM's
``model_name`` and ``engine`` labels (engine "0": one engine core per pod). Exported:

* gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` and its deprecated alias ``vllm:gpu_cache_usage_perc``;
* counters (in tokens) ``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits`` and the
  deprecated ``vllm:gpu_prefix_cache_queries`` / ``_hits``; ``vllm:prompt_tokens``,
  ``vllm:generation_tokens``, ``vllm:request_success`` (by ``finished_reason``);
  prometheus_client appends ``_total`` to counters, as vLLM's output shows;
* histograms ``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds``,
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens``, ``vllm:iteration_tokens_total``;
* with LoRA enabled only, the gauge ``vllm:lora_requests_info`` with vLLM's labels
  ``max_lora``, ``waiting_lora_adapters`` and ``running_lora_adapters`` (comma-separated names)
  and no others, set to the time of the update. As in vLLM, a series with earlier labels keeps
  its earlier time: a reader takes the sample with the latest value.

As in vLLM, counts are per engine sequence: a request with ``n`` choices counts ``n`` times.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llmgw_sim.scheduler import Scheduler, StepResult

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
_LABELS = ("model_name", "engine")
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISHED_REASONS = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class SimMetrics:
    """The pod's Prometheus metrics, bound to one served model name."""

    def __init__(self, model_name: str, max_model_len: int, max_loras: int | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = (model_name, "0")
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _LABELS, registry=reg).labels(*labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=reg).labels(*labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, _LABELS, buckets=buckets, registry=reg).labels(*labels)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.gpu_cache_usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.gpu_prefix_queries = counter(
            "vllm:gpu_prefix_cache_queries",
            "GPU prefix cache queries, in terms of number of queried tokens. DEPRECATED.")
        self.gpu_prefix_hits = counter(
            "vllm:gpu_prefix_cache_hits",
            "GPU prefix cache hits, in terms of number of cached tokens. DEPRECATED.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*_LABELS, "finished_reason"), registry=reg)
        self.request_success = {r: success.labels(*labels, r) for r in FINISHED_REASONS}
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", _ITERATION_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", _TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", _LATENCY_BUCKETS)
        self.max_loras = max_loras
        self.lora_info = None if max_loras is None else Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ("max_lora", "waiting_lora_adapters", "running_lora_adapters"), registry=reg)

    def refresh_gauges(self, scheduler: Scheduler) -> None:
        """Scheduler gauges, read at scrape time (always current, and free between scrapes)."""
        self.running.set(scheduler.num_running)
        self.waiting.set(scheduler.num_waiting)
        usage = scheduler.pool.usage
        self.kv_cache_usage.set(usage)
        self.gpu_cache_usage.set(usage)
        if self.lora_info is not None:
            self.lora_info.labels(str(self.max_loras), ",".join(sorted(scheduler.waiting_loras)),
                                  ",".join(sorted(scheduler.running_loras))).set_to_current_time()

    def record_step(self, result: StepResult, _scheduler: Scheduler) -> None:
        """Token and prefix-cache counters after one engine step."""
        if result.prefix_queries:
            self.prefix_queries.inc(result.prefix_queries)
            self.gpu_prefix_queries.inc(result.prefix_queries)
        if result.prefix_hits:
            self.prefix_hits.inc(result.prefix_hits)
            self.gpu_prefix_hits.inc(result.prefix_hits)
        if result.prompt_tokens:
            self.prompt_tokens.inc(result.prompt_tokens)
        generated = len(result.emitted)
        self.generation_tokens.inc(generated)
        self.iteration_tokens.observe(result.prompt_tokens + generated)

    def record_finished(self, *, finish_reason: str, prompt_tokens: int, generation_tokens: int,
                        ttft_s: float | None, e2e_s: float) -> None:
        """Per-sequence request histograms, once it finished or was aborted."""
        self.request_success[finish_reason].inc()
        self.e2e.observe(e2e_s)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if generation_tokens > 1:
                self.tpot.observe((e2e_s - ttft_s) / (generation_tokens - 1))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
