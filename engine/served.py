"""What the server may read of a running engine: the served model (fixed at start-up) and LoRA counters.

The server sees the engine only through the EngineClient (engine/core_client.py) and these plain
objects, never through the LLMEngine, the scheduler or the adapter manager behind it (they live in the
engine-core process).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig, LoRAConfig
from engine.messages import Ready

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.structured import GrammarCompiler


class KernelChoice(NamedTuple):
    """What the core's start-up checks chose for one op: kernels.registry.Choice's fields (that module needs
    torch, which the API process does not load)."""

    op: str
    chosen: str
    rejected: tuple[tuple[str, str], ...]
    checked: bool


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
    kernels: tuple[KernelChoice, ...]
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
        tok = load_tokenizer(config.model.path, ready.tokenizer_class)
        grammar = GrammarCompiler(tok, ready.vocab_size, frozenset(ready.eos_ids))
    kernels = tuple(KernelChoice(op, chosen, tuple(tuple(r) for r in rejected), checked)
                    for op, chosen, rejected, checked in ready.kernels)
    return ServedModel(ready.names, config.model.path, ready.max_model_len, ready.vocab_size, tok, config.lora,
                       ready.lora_enabled, grammar, kernels)


def load_tokenizer(path: str, class_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer the engine core loaded (AutoTokenizer chose its class there: class_path, module.name) on
    the same files. Not AutoTokenizer again: it reads the model config through transformers' config classes,
    which import torch, and the API process never needs torch. Another class (or none named): AutoTokenizer."""
    module, _, name = class_path.rpartition(".")
    if module.startswith("transformers."):
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            cls = None
        if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase):
            return cls.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
