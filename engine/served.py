"""What the server may read of a running engine: the served model (fixed at start-up) and LoRA counters.

The server sees the engine only through the EngineClient (engine/core_client.py) and these plain
objects, never through the LLMEngine, the scheduler or the adapter manager behind it (they live in the
engine-core process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.config import EngineConfig, LoRAConfig
from engine.messages import Ready
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


def served_from_ready(config: EngineConfig, ready: Ready, llm: LLMEngine | None = None) -> ServedModel:
    """The API process's view from the core's Ready: its own tokenizer and grammar compiler (the server
    compiles to validate; the core compiles again from its cache), or the in-thread engine's."""
    from engine.structured import GrammarCompiler

    if llm is not None:
        tok, grammar = llm.tokenizer, llm.grammar.compiler
    else:
        tok = AutoTokenizer.from_pretrained(config.model.path)
        grammar = GrammarCompiler(tok, ready.vocab_size, frozenset(ready.eos_ids))
    kernels = tuple(Choice(op, chosen, tuple(rejected), checked) for op, chosen, rejected, checked in ready.kernels)
    return ServedModel(ready.names, config.model.path, ready.max_model_len, ready.vocab_size, tok, config.lora,
                       ready.lora_enabled, grammar, kernels)
