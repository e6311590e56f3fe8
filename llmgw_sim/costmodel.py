"""GPU cost model of one simulated vLLM pod: how long one engine step takes.

The simulated pod is a 7-8B dense model (Llama-3-8B class, BF16) on one A100-80GB under vLLM.
A step's time is ``decode_base + decode_per_seq * batch_size + prefill_per_token * new_tokens``,
where ``new_tokens`` are the prompt tokens prefilled in that step that the prefix cache did not
already hold. Every default below names where it comes from (see also ``llmgw_sim/README.md``):

* ``decode_base_s = 12 ms``: a decode step must stream all weights once. Llama-3-8B in BF16 is
  ~16 GB; A100-80GB SXM HBM2e moves 2.04 TB/s (NVIDIA A100 datasheet), so the roofline floor is
  ~8 ms. A measured vLLM sweep of Llama-3.1-8B-Instruct (BF16, vLLM 0.23) on an A100-40GB
  (1.56 TB/s) decodes ~75 tokens/s at concurrency 1, i.e. ~13.3 ms per step at ~77 % of the
  bandwidth roof (johnmusgrave.com, "vLLM throughput-latency sweep on NVIDIA A100"). Scaled to the
  80 GB part and rounded: 12 ms.
* ``decode_per_seq_s = 0.4 ms``: the same sweep gets 6.6x the throughput at concurrency 8, so a
  step of 8 sequences takes 8 / 6.6 * 13.3 ms ~ 16 ms, i.e. (16 - 13.3) / 7 ~ 0.4 ms per extra
  sequence (KV reads of ~1k-token contexts).
* ``prefill_per_token_s = 0.1 ms`` (10k prompt tokens/s): prefill is compute bound at ~2 FLOPs
  per parameter per token (Kaplan et al. 2020), 16 GFLOP/token for 8B; the A100 peaks at
  312 dense BF16 TFLOPS, and ~50 % MFU gives ~10k tokens/s. It matches the 150-250 ms TTFT
  commonly reported for Llama-3-8B on one A100-80GB with ~1-2k-token prompts.
* ``kv_cache_tokens = 380_000``: Llama-3-8B keeps 2 (K,V) x 32 layers x 8 KV heads x 128 dims x
  2 bytes = 128 KiB per token. vLLM issue #12330 shows the profile on an A100-40GB (15 GiB
  weights, 9.4 GiB activation peak, 11.1 GiB -> 5691 blocks of 16 = 91k tokens). On 80 GB with
  ``gpu_memory_utilization=0.9``: 71.2 - 15 - 9.4 ~ 46.8 GiB -> ~383k tokens; rounded down.
* ``max_num_seqs = 256``, ``block_size = 16``, ``max_num_batched_tokens = 8192``: vLLM's
  defaults (``EngineArgs``; 8192 is the V1 API-server default on A100/H100-class GPUs).
* ``max_model_len = 8192``: Llama-3-8B's context window.

Simplifications: prefill is not chunked (a prompt over the token budget is admitted alone), and
KV blocks for a sequence's whole output are reserved at admission, so there is no preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_DECODE_BASE_S = 0.012
DEFAULT_DECODE_PER_SEQ_S = 0.0004
DEFAULT_PREFILL_PER_TOKEN_S = 0.0001
DEFAULT_KV_CACHE_TOKENS = 380_000
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True, slots=True)
class CostParams:
    """The simulated GPU: step-time coefficients and scheduler capacities (see module doc)."""

    decode_base_s: float = DEFAULT_DECODE_BASE_S
    decode_per_seq_s: float = DEFAULT_DECODE_PER_SEQ_S
    prefill_per_token_s: float = DEFAULT_PREFILL_PER_TOKEN_S
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        for name in ("decode_base_s", "decode_per_seq_s", "prefill_per_token_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError("kv_cache_tokens: must hold at least one block")

    @property
    def num_blocks(self) -> int:
        """KV-cache capacity in whole blocks."""
        return self.kv_cache_tokens // self.block_size

    def step_time(self, batch_size: int, prefill_tokens: int) -> float:
        """Seconds one engine step takes for ``batch_size`` sequences and ``prefill_tokens`` new
        prompt tokens; an empty step costs nothing."""
        if batch_size == 0:
            return 0.0
        return (
            self.decode_base_s
            + self.decode_per_seq_s * batch_size
            + self.prefill_per_token_s * prefill_tokens
        )

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)
