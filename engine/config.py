"""Frozen engine configuration, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from engine.device import DeviceName
from engine.errors import ConfigError

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
LoRAKernelName = Literal["auto", "triton", "reference"]
LoRADTypeName = Literal["auto", "bfloat16", "float16", "float32", "fp8"]
AttentionKernelName = Literal["auto", "triton", "reference"]
FusedKernelName = Literal["auto", "triton", "reference"]
GDNKernelName = Literal["auto", "fla", "triton", "reference"]
Int4KernelName = Literal["auto", "tuned", "reference", "triton", "triton_mma", "triton_gemv", "cuda_mma",
                         "native_cpu", "native_cuda", "native_xpu", "auto:native_cuda", "auto:native_xpu"]


@dataclass(frozen=True)
class ModelConfig:
    path: str
    """A Hugging Face style folder: config.json, tokenizer files, *.safetensors."""
    dtype: DTypeName = "auto"
    """Activation dtype. auto: float32 on the CPU (exact and fast enough), bfloat16 on GPUs."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None takes the model's max_position_embeddings."""
    served_model_name: str | None = None
    """Name clients use for the base model (reported in responses and metrics); defaults to the folder name."""
    extra_served_model_names: tuple[str, ...] = ()
    """Further names accepted for the base model (vLLM's `--served-model-name a b`: all are accepted)."""
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        names = [self.served_model_name, *self.extra_served_model_names]
        if self.extra_served_model_names and self.served_model_name is None:
            raise ConfigError("extra_served_model_names need a served_model_name first")
        if any(n is not None and not n for n in names) or len(set(names)) != len(names):
            raise ConfigError(f"served model names must be non-empty and distinct, got {names}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int | None = None
    """KV blocks per layer; None sizes the cache from memory (GPU) or from max_num_seqs x max_model_len (CPU)."""
    gpu_memory_utilization: float = 0.90
    """Fraction of device memory the engine may use in total (weights + activations + KV)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of a prompt prefix already computed under the same adapter identity."""
    hybrid_snapshot_interval: int = 512
    """Hybrid models: tokens between the linear-attention state snapshots that prefix caching needs (a
    multiple of block_size; prompt chunks end on these points; a hit reuses up to the last one)."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.hybrid_snapshot_interval < self.block_size or self.hybrid_snapshot_interval % self.block_size:
            raise ConfigError(f"hybrid_snapshot_interval must be a positive multiple of block_size "
                              f"({self.block_size}), got {self.hybrid_snapshot_interval}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.05 <= self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in [0.05, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks that each hold a shard of every layer (one device each)."""
    device: DeviceName = "auto"
    """auto picks xpu, then cuda, then cpu."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = False
    max_loras: int = 4
    """Device slots: distinct adapters that may run in one step."""
    max_lora_rank: int = 64
    """Largest adapter rank accepted; the per-slot buffers are padded to it."""
    max_cpu_loras: int | None = None
    """Adapters kept in host memory (LRU); None means max(max_loras, 16)."""
    fully_sharded_loras: bool = False
    """Shard LoRA A of column layers (and B of row layers) over TP ranks too."""
    lora_dtype: LoRADTypeName = "auto"
    """How adapter A and B are stored in the device slots: auto (the model dtype; float32 on the CPU, where the
    LoRA GEMMs are faster in it), a float dtype, or fp8 (e4m3
    with a float32 scale per rank row of A and per output row of B: half of bf16's bytes, dequantized by the
    LoRA kernels)."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """(name, path) pairs loaded at start."""
    lora_roots: tuple[str, ...] = ()
    """Folders runtime loads may read from; none means runtime loads are refused."""
    lora_autoload: bool = True
    """Load an adapter named after a folder under a lora root on its first request."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank not in (1, 8, 16, 32, 64, 128, 256, 320, 512):
            raise ConfigError(f"max_lora_rank must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512, "
                              f"got {self.max_lora_rank}")
        if self.lora_dtype not in get_args(LoRADTypeName):
            raise ConfigError(f"lora_dtype must be one of {', '.join(get_args(LoRADTypeName))}, "
                              f"got {self.lora_dtype!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def cpu_cache_size(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else max(self.max_loras, 16)


EAGER_STEP_TOKENS = 2048
"""The step budget where steps run eagerly (CPU, hybrid models, graphs off): SchedulerConfig.max_num_batched_tokens."""
MAX_MIXED_GRAPH_TOKENS = 4096
"""The largest mixed-step graph size (graph_runner.MIXED_SIZES[-1]; this module does not import torch)."""


def step_budget(configured: int | None, largest_mixed_graph: int | None, max_num_seqs: int) -> int:
    """SchedulerConfig.max_num_batched_tokens once the runner is known: as configured, else the largest
    mixed-step graph (at least max_num_seqs, so every decode row fits a step) or, without those graphs, 2048."""
    if configured is not None:
        return configured
    return EAGER_STEP_TOKENS if largest_mixed_graph is None else max(largest_mixed_graph, max_num_seqs)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """Sequences running at once."""
    max_num_batched_tokens: int | None = None
    """Tokens (prefill + decode) per step; longer prompts are prefilled in chunks. None: the largest mixed-step
    graph (EngineConfig.max_mixed_graph_tokens, 2048 by default; at least max_num_seqs) where those graphs run
    (GPUs, dense models), so that no step runs eagerly; 2048 elsewhere. On an H200 a 36-layer eager step costs
    the host 25-70 ms beyond its device time (docs/PERFORMANCE.md, eleventh and twelfth sessions)."""
    max_waiting_requests: int | None = None
    """Waiting-queue bound; the server answers 503 beyond it. None: unbounded."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class KernelConfig:
    """Which implementation each op uses; "auto" lets engine/device.py pick for the device (docs/kernels.md)."""

    lora: LoRAKernelName = "auto"
    """Batched LoRA: auto (Triton on GPUs, the torch reference on the CPU), triton (also on the CPU, under
    TRITON_INTERPRET=1) or reference. A Triton choice is checked against the reference at start-up and
    replaced by it, with a warning, if it fails (kernels/registry.py)."""
    attention: AttentionKernelName = "auto"
    """Paged attention and the KV write: auto (Triton on GPUs, the reference on the CPU)."""
    fused: FusedKernelName = "auto"
    """Norms, rotary, silu-and-mul: auto (Triton on GPUs where Triton runs, else the reference)."""
    gdn: GDNKernelName = "auto"
    """Gated DeltaNet (Qwen3.5 hybrids): auto (on GPUs fla-core when installed, else triton; the reference on the
    CPU), fla (fla-core's chunked kernels for prompts, kernels/gdn_triton.py for decode steps, gating, gated norm),
    triton (kernels/gdn_triton.py, prompts' recurrence on the reference: no fla-core needed) or reference."""
    int4: Int4KernelName = "auto"
    """int4 GEMM: auto (on GPUs `tuned`; the reference on the CPU), tuned (per layer shape and bucket of rows the
    fastest checked kernel, timed at start-up on this device or read from the cache, kernels.int4_tune),
    auto:native_X (the fixed per-row-count dispatch measured on an H200) or one backend for every row count."""

    def __post_init__(self) -> None:
        for name, kind in (("lora", LoRAKernelName), ("attention", AttentionKernelName), ("fused", FusedKernelName),
                           ("gdn", GDNKernelName), ("int4", Int4KernelName)):
            if getattr(self, name) not in get_args(kind):
                raise ConfigError(f"{name} kernel must be one of {', '.join(get_args(kind))}, "
                                  f"got {getattr(self, name)!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    seed: int = 0
    """Seed of the global RNG (unseeded sampling)."""
    max_logprobs: int = 20
    enforce_eager: bool = False
    """Disable graph capture."""
    mixed_graphs: bool = True
    """Also capture steps that hold a prefill chunk, attention included (engine/graph_runner.MixedGraphs; dense
    models on GPUs, up to max_mixed_graph_tokens); off: those steps run eagerly, decode-only steps still replay
    graphs."""
    max_mixed_graph_tokens: int = 2048
    """The largest mixed-step graph (graph_runner.MIXED_SIZES up to it: 16 ... 512, 768, 1024, 1536, 2048, 3072,
    4096); the default step budget follows it. Each size is one more capture and its activations in the graph pool:
    on an H200 (36-layer 8B-shaped model, 32 adapters) the 16 sizes up to 2048 took 3.9 s and 634 MiB, and against
    512 they brought the opening burst's last first token from 113 to 91 ms (64 prompts) and the server's TTFT p99
    from 82 to 72 ms (c = 32), throughput unchanged (docs/PERFORMANCE.md, twelfth session). Lower it to shorten the
    steps that a long prompt adds to running streams' inter-token latency."""
    async_scheduling: bool | None = None
    """Schedule and launch step N+1 before step N's sampled ids are read back, feeding them to step N+1 on the
    device (engine/llm_engine.py). None: on where the host can run ahead of the device (GPUs, tensor parallel
    size 1), off on the CPU; True also on the CPU (the same code path, nothing to overlap; tests use it)."""

    def __post_init__(self) -> None:
        if not 16 <= self.max_mixed_graph_tokens <= MAX_MIXED_GRAPH_TOKENS:
            raise ConfigError(f"max_mixed_graph_tokens must be in [16, {MAX_MIXED_GRAPH_TOKENS}], "
                              f"got {self.max_mixed_graph_tokens}")
