"""Device tables the Triton LoRA launchers pass their kernels (kernels.lora_triton, kernels.lora_cols): per-slice
pointers, strides and offsets in one int64 tensor, cached by content so that captured graphs keep reading them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.lora_checks import b_rank_major
from kernels.triton_env import triton

_table_cache: dict[tuple, torch.Tensor] = {}
"""Pointer tables, never evicted: captured graphs read them by address, so freeing one (an LRU over 1024
entries did, at 27B scale: 352 wrapped layers x 3 launch shapes) would leave a graph reading freed memory.
Their number is bounded by wrapped layers x launch shapes."""


def _ptr_table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """int64 [len(rows) * len(rows[0])] on device, cached by its contents (pointers, strides, offsets)."""
    key = (tuple(map(tuple, rows)), str(device))
    hit = _table_cache.get(key)
    if hit is None:
        hit = _table_cache[key] = torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1)
    return hit


def _raw(w: torch.Tensor) -> torch.Tensor:
    """What the kernels read: fp8 e4m3 as its bytes (decoded in the kernel), anything else as it is."""
    return w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w


def _b_table(lora_b: Sequence[torch.Tensor], offsets: Sequence[int], b_scales: Sequence[torch.Tensor] | None,
             cols_per_program: int, device: torch.device) -> tuple[torch.Tensor, int, bool, bool]:
    """(table, column groups in all, aligned, rank-major) of the slices' B for an expand-style grid: table row s =
    (ptr, slot stride, n_s, y offset, first column group, rank stride, fp8 scale ptr, its slot stride)."""
    raw = [_raw(b) for b in lora_b]
    rank_major = b_rank_major(raw)
    rows, first, aligned = [], 0, True
    scales = b_scales if b_scales is not None else lora_b
    for b, off, sc in zip(raw, offsets, scales):
        rows.append([b.data_ptr(), b.stride(0), b.size(1), int(off), first, b.stride(2), sc.data_ptr(), sc.stride(0)])
        first += triton.cdiv(b.size(1), cols_per_program)
        aligned = (aligned and b.data_ptr() % 16 == 0 and b.stride(0) % 8 == 0 and b.size(1) % 8 == 0
                   and off % 8 == 0 and b.stride(2 if rank_major else 1) % 8 == 0)
    return _ptr_table(rows, device), first, aligned, rank_major
