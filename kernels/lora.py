"""Batched multi-LoRA ops behind one interface; the backend is chosen per device by engine.device.

Semantics (per slice s of a fused layer, tokens grouped by their adapter slot):
    y[:, off_s:off_s+n_s] += (x @ A_s[slot].T)[:, :rank] @ B_s[slot][:, :rank].T

Backends: "reference" (kernels.reference, the CPU path and the oracle) and "triton" (kernels.lora_triton:
all slices of a layer in one shrink and one expand launch). `token_slots` is the [T] slot tensor or, for
"triton", preferably the step's LoRABatchInfo (kernels.lora_triton.prepare_lora_batch, built once per
step); a plain tensor there is grouped on the fly. `ranks` may be host lists or, for "triton", an int32
device tensor ([n_slices, S] for add_lora, [S] or [1, S] for shrink/expand).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import lora_triton, reference
from kernels.lora_triton import LoRABatchInfo

LORA_BACKENDS = ("reference", "triton")

Slots = torch.Tensor | LoRABatchInfo
Ranks1 = list[int] | torch.Tensor
Ranks2 = list[list[int]] | torch.Tensor


def _check_backend(backend: str) -> None:
    if backend not in LORA_BACKENDS:
        raise ValueError(f"unknown LoRA backend {backend!r}; available: {', '.join(LORA_BACKENDS)}")


def _num_tokens(token_slots: Slots) -> int:
    return token_slots.num_tokens if isinstance(token_slots, LoRABatchInfo) else token_slots.numel()


def _slot_tensor(token_slots: Slots) -> torch.Tensor:
    return token_slots.token_slots if isinstance(token_slots, LoRABatchInfo) else token_slots


def _info(token_slots: Slots, num_slots: int) -> LoRABatchInfo:
    if isinstance(token_slots, LoRABatchInfo):
        return token_slots
    return lora_triton.prepare_lora_batch(token_slots, None, num_slots)


def _host(ranks: Ranks1 | Ranks2) -> list:
    return ranks.tolist() if isinstance(ranks, torch.Tensor) else ranks


def _one_slice(ranks: Ranks1) -> Sequence[Sequence[int]] | torch.Tensor:
    if isinstance(ranks, torch.Tensor):
        return ranks.reshape(1, -1)
    return [ranks]


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
             ranks: Ranks2, offsets: list[int], token_slots: Slots, add_inputs: bool = True,
             backend: str = "reference") -> torch.Tensor:
    """For each slice s: y[:, offsets[s]:+n_s] (+)= shrink(x, A_s) @ B_s^T. Returns y (updated in place).

    x [T, in]; lora_a[s] [S, r_max, in]; lora_b[s] [S, n_s, r_max]; ranks[s][slot] the adapter's true rank
    for that slice; token_slots [T] (-1 = no adapter) or a LoRABatchInfo.
    """
    if x.size(0) != y.size(0) or _num_tokens(token_slots) != x.size(0):
        raise ValueError(f"add_lora: x {tuple(x.shape)}, y {tuple(y.shape)}, {_num_tokens(token_slots)} slots "
                         "disagree")
    if not (len(lora_a) == len(lora_b) == len(ranks) == len(offsets)):
        raise ValueError("add_lora: one A, B, ranks and offset per slice")
    _check_backend(backend)
    for a, b in zip(lora_a, lora_b):
        if a.size(-1) != x.size(-1):
            raise ValueError(f"add_lora: A has {a.size(-1)} inputs, x has {x.size(-1)}")
        if a.size(1) != b.size(-1):
            raise ValueError(f"add_lora: A rank dim {a.size(1)} != B rank dim {b.size(-1)}")
    if backend == "triton":
        info = _info(token_slots, lora_a[0].size(0))
        return lora_triton.add_lora(y, x, lora_a, lora_b, info, offsets, ranks, add_inputs)
    slots = _slot_tensor(token_slots)
    for a, b, r, off in zip(lora_a, lora_b, _host(ranks), offsets):
        buf = reference.lora_shrink(x, a, slots, r)
        reference.lora_expand(y, buf, b, slots, r, off, add_inputs)
    return y


def shrink(x: torch.Tensor, a: torch.Tensor, token_slots: Slots, ranks: Ranks1,
           backend: str = "reference") -> torch.Tensor:
    """buf[t, :r] = x[t] @ a[slot[t], :r].T (float32 [T, a.size(1)]); slot -1 rows are zero."""
    _check_backend(backend)
    if a.size(-1) != x.size(-1):
        raise ValueError(f"shrink: A has {a.size(-1)} inputs, x has {x.size(-1)}")
    if backend == "triton":
        return lora_triton.lora_shrink(x, [a], _info(token_slots, a.size(0)), _one_slice(ranks))[0]
    return reference.lora_shrink(x, a, _slot_tensor(token_slots), _host(ranks))


def expand(y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, token_slots: Slots, ranks: Ranks1,
           offset: int, add_inputs: bool = True, backend: str = "reference") -> torch.Tensor:
    """y[t, offset:offset+n] (+)= buf[t, :r] @ b[slot[t], :, :r].T (r = the slot's true rank <= r_max).

    buf must be exactly [T, r_max] with r_max = b.size(-1): a wider buffer means a shrink result was
    gathered where it should not have been (seed bug 2), and is refused rather than silently cut.
    """
    _check_backend(backend)
    if buf.size(-1) != b.size(-1) or buf.size(0) != y.size(0):
        raise ValueError(f"expand: shrink result {tuple(buf.shape)} does not match LoRA B {tuple(b.shape)} "
                         f"(rank dim {b.size(-1)}) for {y.size(0)} tokens")
    if backend == "triton":
        info = _info(token_slots, b.size(0))
        return lora_triton.lora_expand(y, buf.float().unsqueeze(0), [b], info, [offset], _one_slice(ranks),
                                       add_inputs)
    return reference.lora_expand(y, buf, b, _slot_tensor(token_slots), _host(ranks), offset, add_inputs)
