"""Small helpers shared by tests: prompts and engine construction."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator

from engine import (
    CacheConfig,
    EngineConfig,
    KernelConfig,
    LLMEngine,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    distributed,
)
from engine.device import DeviceName, detect, device_count

WORDS = ("the quick brown fox jumps over lazy dog hello world engine serving many adapters on one model "
         "numbers letters tensor parallel int4 café naïve 你好 世界 🚀").split()


ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""The seven projections of a Qwen decoder layer (LoRA target_modules)."""


def prompts(n: int, seed: int = 0, min_words: int = 1, max_words: int = 30) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]


def kv_blocks(max_model_len: int, max_num_seqs: int, block_size: int = 16) -> int:
    """KV blocks for every sequence at full length: what the CPU sizes by default. Tests pass it on every
    device, so a GPU shared by parallel test workers is not claimed whole by the first engine."""
    return -(-max_model_len // block_size) * max_num_seqs


def tp_device(size: int) -> DeviceName:
    """The default device when it holds a TP group of this size, else the CPU (gloo ranks share it)."""
    kind = detect("auto")
    count = device_count(kind)
    return "auto" if count is None or count >= size else "cpu"


def make_engine(path: str, max_model_len: int = 256, num_blocks: int | None = None, max_num_seqs: int = 64,
                max_num_batched_tokens: int | None = None, prefix_caching: bool = True,
                kernels: KernelConfig | None = None, device: DeviceName = "auto",
                async_scheduling: bool | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(
        ModelConfig(path, dtype="float32", max_model_len=max_model_len),
        cache=CacheConfig(num_blocks=kv_blocks(max_model_len, max_num_seqs) if num_blocks is None else num_blocks,
                          enable_prefix_caching=prefix_caching),
        parallel=ParallelConfig(device=device),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        kernels=kernels or KernelConfig(), async_scheduling=async_scheduling))


def make_lora_engine(path: str, adapters: dict[str, str] | None = None, max_loras: int = 4, max_lora_rank: int = 64,
                     max_cpu_loras: int | None = None, max_model_len: int = 256, max_num_seqs: int = 64,
                     num_blocks: int | None = None, tp: int = 1, fully_sharded: bool = False,
                     prefix_caching: bool = True, max_num_batched_tokens: int | None = None,
                     kernels: KernelConfig | None = None, async_scheduling: bool | None = None,
                     lora_dtype: str = "auto", dtype: str = "float32", device: DeviceName | None = None) -> LLMEngine:
    from engine import LoRAConfig

    return LLMEngine(EngineConfig(
        ModelConfig(path, dtype=dtype, max_model_len=max_model_len),
        cache=CacheConfig(num_blocks=kv_blocks(max_model_len, max_num_seqs) if num_blocks is None else num_blocks,
                          enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        parallel=ParallelConfig(tensor_parallel_size=tp, device=device or tp_device(tp)),
        lora=LoRAConfig(enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                        fully_sharded_loras=fully_sharded, lora_modules=tuple((adapters or {}).items()),
                        lora_dtype=lora_dtype),  # type: ignore[arg-type]
        kernels=kernels or KernelConfig(), async_scheduling=async_scheduling))


def demo_shapes() -> dict[str, tuple[int, int]]:
    """The demo model's LoRA-capable modules -> (in, out)."""
    mods = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (256, 128), "self_attn.v_proj": (256, 128),
            "self_attn.o_proj": (256, 256), "mlp.gate_proj": (256, 768), "mlp.up_proj": (256, 768),
            "mlp.down_proj": (768, 256)}
    return {f"model.layers.{i}.{m}": s for i in range(4) for m, s in mods.items()}


@contextlib.contextmanager
def as_tp_rank(rank: int, size: int) -> Iterator[None]:
    """Layers built inside are built as tensor-parallel rank `rank` of `size`, with no process group
    (nothing built here may communicate). The hook lives here so that the product code has none."""
    saved = distributed._GROUP
    distributed._GROUP = distributed.TPGroup(rank, size)
    try:
        yield
    finally:
        distributed._GROUP = saved


def count_calls(module: object, names: list[str]) -> dict[str, int]:
    """Wrap each function `names` of `module` (looked up through the module at call time by its callers) with a
    counter; returns the live counts. For checks that a fast path ran rather than its fallback."""
    calls = dict.fromkeys(names, 0)

    def counter(name: str) -> Callable[..., object]:
        f = getattr(module, name)

        def counted(*args: object) -> object:
            calls[name] += 1
            return f(*args)
        return counted

    for name in names:
        setattr(module, name, counter(name))
    return calls
