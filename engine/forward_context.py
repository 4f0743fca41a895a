"""Per-step batch metadata that layers read during one forward pass (set by the model runner)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.lora.punica import LoRABatch


@dataclass
class AttentionMetadata:
    """The step's sequences laid end to end: sequence i owns query rows cu_q[i]:cu_q[i+1]."""

    slot_mapping: torch.Tensor
    """[T] flat KV-cache slot (block * block_size + offset) for each new token."""
    block_tables: torch.Tensor
    """[B, max_blocks] int32 physical blocks of each sequence (padding: 0)."""
    context_lens: torch.Tensor
    """[B] int32 tokens in the cache for each sequence after this step's writes."""
    cu_q: torch.Tensor
    """[B+1] int32 cumulative query lengths."""
    cu_q_list: list[int]
    context_lens_list: list[int]
    max_q_len: int


@dataclass
class ForwardContext:
    attn: AttentionMetadata | None
    lora: LoRABatch | None = None
    """The step's token -> adapter-slot mapping, or None when no token uses an adapter."""
    state_slots: list[int] | None = None
    """Per sequence in the step: its slot in the linear-attention state pool (hybrid models only)."""
    state_index: torch.Tensor | None = None
    """The same slots as a [B] long device tensor (what decode-only steps and graphs read)."""


_CTX: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _CTX
    prev, _CTX = _CTX, ctx
    try:
        yield
    finally:
        _CTX = prev


def get_context() -> ForwardContext:
    if _CTX is None:
        raise RuntimeError("no forward context: layers that read batch metadata run only inside a model-runner step")
    return _CTX
