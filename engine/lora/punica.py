"""Per-step token -> adapter-slot mapping and the calls into the batched LoRA kernels.

A token whose request has no adapter maps to slot -1 and gets no LoRA work; a step in which no
token has an adapter builds no mapping at all, so the wrappers launch nothing. For the Triton
backend the mapping also carries the step's grouping of tokens by slot (built once per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import lora as ops
from kernels.lora_triton import LoRABatchInfo, prepare_lora_batch


@dataclass(frozen=True)
class LoRAMapping:
    slots: torch.Tensor | LoRABatchInfo
    """Reference backend: [T] long adapter slot of every token (-1: base model). Triton backend: the
    tokens grouped by slot on the device (which also holds each token's slot)."""

    @property
    def backend(self) -> str:
        return "triton" if isinstance(self.slots, LoRABatchInfo) else "reference"


def build_mapping(slots: list[int], device: torch.device, backend: str = "reference",
                  num_slots: int = 0) -> LoRAMapping | None:
    """Mapping for a step whose tokens use these slots; None when no token uses an adapter."""
    if all(s < 0 for s in slots):
        return None
    if backend == "triton":
        return LoRAMapping(prepare_lora_batch(slots, None, num_slots, device=device))
    return LoRAMapping(torch.tensor(slots, dtype=torch.long, device=device))


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
             ranks: list[list[int]] | torch.Tensor, offsets: list[int], mapping: LoRAMapping,
             add_inputs: bool = True) -> torch.Tensor:
    """y[:, slice s] (+)= (x A_s[slot]^T)[:, :rank] B_s[slot][:, :rank]^T for each token's slot."""
    return ops.add_lora(y, x, lora_a, lora_b, ranks, offsets, mapping.slots, add_inputs, mapping.backend)


def shrink(x: torch.Tensor, a: torch.Tensor, ranks: list[int] | torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """buf = (x A[slot]^T)[:, :rank] per token, float32 [T, a.size(1)]."""
    return ops.shrink(x, a, mapping.slots, ranks, mapping.backend)


def expand(y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, ranks: list[int] | torch.Tensor, offset: int,
           mapping: LoRAMapping, add_inputs: bool = True) -> torch.Tensor:
    """y[:, offset:offset+n] (+)= buf[:, :rank] B[slot][:, :rank]^T per token."""
    return ops.expand(y, buf, b, mapping.slots, ranks, offset, add_inputs, mapping.backend)
