"""Per-step token -> adapter-slot mapping and the call into the batched LoRA kernels.

A token whose request has no adapter maps to slot -1 and gets no LoRA work; a step in which no
token has an adapter builds no mapping at all, so the wrappers launch nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.lora import add_lora as _add_lora
from kernels.lora import expand as _expand
from kernels.lora import shrink as _shrink


@dataclass(frozen=True)
class LoRAMapping:
    token_slots: torch.Tensor
    """[T] long: adapter slot of every token in the step (-1: base model)."""
    backend: str = "reference"


def build_mapping(slots: list[int], device: torch.device, backend: str = "reference") -> LoRAMapping | None:
    """Mapping for a step whose tokens use these slots; None when no token uses an adapter."""
    if all(s < 0 for s in slots):
        return None
    return LoRAMapping(torch.tensor(slots, dtype=torch.long, device=device), backend)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
             ranks: list[list[int]], offsets: list[int], mapping: LoRAMapping, add_inputs: bool = True) -> torch.Tensor:
    """y[:, slice s] (+)= (x A_s[slot]^T)[:, :rank] B_s[slot][:, :rank]^T for each token's slot."""
    return _add_lora(y, x, lora_a, lora_b, ranks, offsets, mapping.token_slots, add_inputs, mapping.backend)


def shrink(x: torch.Tensor, a: torch.Tensor, ranks: list[int], mapping: LoRAMapping) -> torch.Tensor:
    """buf = (x A[slot]^T)[:, :rank] per token, float32 [T, a.size(1)]."""
    return _shrink(x, a, mapping.token_slots, ranks, mapping.backend)


def expand(y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, ranks: list[int], offset: int,
           mapping: LoRAMapping, add_inputs: bool = True) -> torch.Tensor:
    """y[:, offset:offset+n] (+)= buf[:, :rank] B[slot][:, :rank]^T per token."""
    return _expand(y, buf, b, mapping.token_slots, ranks, offset, add_inputs, mapping.backend)
