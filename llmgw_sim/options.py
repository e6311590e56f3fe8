"""Everything a simulated pod is configured with, as one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.resources import DEFAULT_TOKENIZER
from llmgw_sim.costmodel import DEFAULT_MAX_MODEL_LEN, CostParams
from llmgw_sim.embed import DEFAULT_EMBEDDING_DIM
from llmgw_sim.faults import FaultConfig
from llmgw_sim.generate import LengthModel
from llmgw_sim.scheduler import ENGINE_KINDS, EngineKind

DEFAULT_MODEL = "llama-3-8b-instruct"


@dataclass(frozen=True, slots=True)
class SimOptions:
    """Configuration of one simulated vLLM pod (the CLI flags map one to one)."""

    host: str = "127.0.0.1"
    port: int = 0
    model: str = DEFAULT_MODEL
    extra_models: tuple[str, ...] = ()
    tokenizer: str = DEFAULT_TOKENIZER
    engine: EngineKind = "continuous"
    cost: CostParams = field(default_factory=CostParams)
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    embedding_dim: int = DEFAULT_EMBEDDING_DIM
    lengths: LengthModel = field(default_factory=LengthModel)
    ignore_eos: bool = False
    time_scale: float = 1.0
    faults: FaultConfig = field(default_factory=FaultConfig)
    seed: int = 0
    record: int = 0
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path): vLLM --lora-modules name=path
    max_loras: int = 1  # distinct adapters in one batch (vLLM --max-loras, default 1)
    batch_grpc_port: int | None = None  # serve llmgw.v1.BatchGeneration here (0: a free port); None: off

    @property
    def served_models(self) -> tuple[str, ...]:
        """Every name the pod answers to (vLLM ``--served-model-name`` with several names);
        the first one labels the metrics."""
        return (self.model, *(m for m in self.extra_models if m != self.model))

    @property
    def adapters(self) -> dict[str, str]:
        """LoRA adapter name -> path; requests may name an adapter as their ``model``."""
        return dict(self.lora_modules)

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"engine: must be one of {ENGINE_KINDS}, got {self.engine!r}")
        if self.time_scale < 0:
            raise ValueError("time_scale: must be >= 0")
        if self.record < 0:
            raise ValueError("record: must be >= 0")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: not a TCP port: {self.port}")
        if self.batch_grpc_port is not None and not 0 <= self.batch_grpc_port <= 65535:
            raise ValueError(f"batch_grpc_port: not a TCP port: {self.batch_grpc_port}")
        if self.max_model_len < 1:
            raise ValueError("max_model_len: must be >= 1")
        if self.embedding_dim < 1:
            raise ValueError("embedding_dim: must be >= 1")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules: needs enable_lora")
        if self.max_loras < 1:
            raise ValueError("max_loras: must be >= 1")
        names = [name for name, _ in self.lora_modules]
        clash = next((n for n in names if names.count(n) > 1 or n in self.served_models), None)
        if clash is not None:
            raise ValueError(f"lora_modules: name {clash!r} is already served")
        if self.cost.kv_cache_tokens < self.max_model_len:
            # vLLM refuses to start when one max-length sequence cannot fit in the KV cache.
            raise ValueError(f"kv_cache_tokens ({self.cost.kv_cache_tokens}) must hold "
                             f"max_model_len ({self.max_model_len}) tokens")
