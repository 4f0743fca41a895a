"""What the server may read of a running engine: the served model (fixed at start-up) and LoRA counters.

The server sees the engine only through AsyncEngine and these plain objects, never through the
LLMEngine, the scheduler or the adapter manager behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from engine.config import LoRAConfig
from kernels.registry import Choice

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.structured import GrammarCompiler


@dataclass(frozen=True)
class ServedModel:
    names: tuple[str, ...]
    """Every name the base model is served under; the first is the one adapters name as their parent."""
    path: str
    """The checkpoint folder (the model cards' root)."""
    max_model_len: int
    vocab_size: int
    tokenizer: PreTrainedTokenizerBase
    """The engine's tokenizer: the server copies it, one per thread that uses it."""
    lora: LoRAConfig
    lora_enabled: bool
    """Whether this engine has an adapter manager (--enable-lora)."""
    grammar: GrammarCompiler
    """Compiles and caches structured-output grammars (the server compiles off the event loop and the step
    thread); its counters feed /metrics."""
    kernels: tuple[Choice, ...]
    """What the start-up kernel checks chose per op (kernels/registry.py), for /metrics."""

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass(frozen=True)
class LoRAStats:
    """Counters of the adapter manager, read at scrape time."""

    num_loads: int
    num_unloads: int
    num_evictions: int
    num_loaded: int
    max_loras: int


def served_model(llm: LLMEngine) -> ServedModel:
    cfg = llm.config
    names = (llm.served_model_name, *cfg.model.extra_served_model_names)
    return ServedModel(names, cfg.model.path, llm.max_model_len, llm.vocab_size, llm.tokenizer,
                       cfg.lora, llm.lora is not None, llm.grammar.compiler, tuple(llm.runner.kernel_choices))
