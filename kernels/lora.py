"""Batched multi-LoRA ops behind one interface; the backend is chosen per device by engine.device.

Semantics (per slice s of a fused layer, tokens grouped by their adapter slot):
    y[:, off_s:off_s+n_s] += (x @ A_s[slot].T)[:, :rank] @ B_s[slot][:, :rank].T
"""

from __future__ import annotations

import torch

from kernels import reference

LORA_BACKENDS = ("reference",)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
             ranks: list[list[int]], offsets: list[int], token_slots: torch.Tensor, add_inputs: bool = True,
             backend: str = "reference") -> torch.Tensor:
    """For each slice s: y[:, offsets[s]:+n_s] (+)= shrink(x, A_s) @ B_s^T. Returns y (updated in place).

    x [T, in]; lora_a[s] [S, r_max, in]; lora_b[s] [S, n_s, r_max]; ranks[s][slot] the adapter's true rank
    for that slice; token_slots [T] (-1 = no adapter).
    """
    if x.size(0) != y.size(0) or token_slots.numel() != x.size(0):
        raise ValueError(f"add_lora: x {tuple(x.shape)}, y {tuple(y.shape)}, slots {tuple(token_slots.shape)} disagree")
    if not (len(lora_a) == len(lora_b) == len(ranks) == len(offsets)):
        raise ValueError("add_lora: one A, B, ranks and offset per slice")
    if backend != "reference":
        raise ValueError(f"unknown LoRA backend {backend!r}; available: {', '.join(LORA_BACKENDS)}")
    for a, b, r, off in zip(lora_a, lora_b, ranks, offsets):
        if a.size(-1) != x.size(-1):
            raise ValueError(f"add_lora: A has {a.size(-1)} inputs, x has {x.size(-1)}")
        if a.size(1) != b.size(-1):
            raise ValueError(f"add_lora: A rank dim {a.size(1)} != B rank dim {b.size(-1)}")
        buf = reference.lora_shrink(x, a, token_slots, r)
        reference.lora_expand(y, buf, b, token_slots, r, off, add_inputs)
    return y


def shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, ranks: list[int],
           backend: str = "reference") -> torch.Tensor:
    """buf[t, :r] = x[t] @ a[slot[t], :r].T (float32 [T, a.size(1)]); slot -1 rows are zero."""
    if backend != "reference":
        raise ValueError(f"unknown LoRA backend {backend!r}; available: {', '.join(LORA_BACKENDS)}")
    if a.size(-1) != x.size(-1):
        raise ValueError(f"shrink: A has {a.size(-1)} inputs, x has {x.size(-1)}")
    return reference.lora_shrink(x, a, token_slots, ranks)


def expand(y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, ranks: list[int],
           offset: int, add_inputs: bool = True, backend: str = "reference") -> torch.Tensor:
    """y[t, offset:offset+n] (+)= buf[t, :r] @ b[slot[t], :, :r].T (r = the slot's true rank <= r_max).

    buf must be exactly [T, r_max] with r_max = b.size(-1): a wider buffer means a shrink result was
    gathered where it should not have been (seed bug 2), and is refused rather than silently cut.
    """
    if backend != "reference":
        raise ValueError(f"unknown LoRA backend {backend!r}; available: {', '.join(LORA_BACKENDS)}")
    if buf.size(-1) != b.size(-1) or buf.size(0) != y.size(0):
        raise ValueError(f"expand: shrink result {tuple(buf.shape)} does not match LoRA B {tuple(b.shape)} "
                         f"(rank dim {b.size(-1)}) for {y.size(0)} tokens")
    return reference.lora_expand(y, buf, b, token_slots, ranks, offset, add_inputs)
