"""Shape, dtype and device checks of the Triton LoRA launchers' inputs (kernels.lora_triton): a launch
with a wrong layout would read out of bounds or compute garbage, so each is refused with a message."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kernels.triton_env import FLOATS

if TYPE_CHECKING:
    from kernels.lora_triton import TokenGroups


def same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _check_info(info: TokenGroups, t: int, device: torch.device) -> None:
    if info.num_tokens != t:
        raise ValueError(f"LoRA batch info is for {info.num_tokens} tokens, the tensors have {t}")
    if not same_device(info.meta.device, device):
        raise ValueError(f"LoRA batch info on {info.meta.device}, tensors on {device}")


def check_ranks(ranks: torch.Tensor, n_slices: int, num_slots: int, device: torch.device) -> torch.Tensor:
    if ranks.dim() != 2 or ranks.shape != (n_slices, num_slots):
        raise ValueError(f"ranks must be [{n_slices} slices, {num_slots} slots], got {tuple(ranks.shape)}")
    if ranks.dtype != torch.int32 or not same_device(ranks.device, device):
        raise ValueError(f"ranks must be int32 on {device}, got {ranks.dtype} on {ranks.device}")
    return ranks


WEIGHTS = (*FLOATS, torch.float8_e4m3fn)
"""LoRA A / B storage dtypes (fp8 e4m3 with one float32 scale per rank row of A, per output row of B)."""


def _check_scales(what: str, weights: Sequence[torch.Tensor], scales: Sequence[torch.Tensor] | None,
                  rows: Sequence[int]) -> None:
    """fp8 weights need scales [S, rows] float32, others none. A's (shrink) share one stride pair; B's (expand)
    are contiguous in their rows, each with its own slot stride."""
    fp8 = weights[0].dtype == torch.float8_e4m3fn
    if scales is None:
        if fp8:
            raise ValueError(f"{what}: fp8 weights need their scales")
        return
    if not fp8:
        raise ValueError(f"{what}: scales are for fp8 weights, these are {weights[0].dtype}")
    if len(scales) != len(weights):
        raise ValueError(f"{what}: one scale tensor per slice")
    for sc, w, n in zip(scales, weights, rows):
        strided = sc.stride() == scales[0].stride() if what == "lora_shrink" else sc.stride(1) == 1
        if sc.shape != (w.size(0), n) or sc.dtype != torch.float32 or sc.device != w.device or not strided:
            raise ValueError(f"{what}: scales must be float32 [{w.size(0)}, {n}] on {w.device} "
                             f"({'one stride pair' if what == 'lora_shrink' else 'rows contiguous'}), got "
                             f"{tuple(sc.shape)} {sc.dtype} {sc.stride()}")


def check_shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], info: TokenGroups,
                 a_scales: Sequence[torch.Tensor] | None = None) -> None:
    if x.dim() != 2 or not lora_a:
        raise ValueError(f"lora_shrink: x must be [T, K] and lora_a non-empty, got x {tuple(x.shape)}")
    a0 = lora_a[0]
    for a in lora_a:
        if a.dim() != 3 or a.shape != a0.shape or a.stride() != a0.stride() or a.dtype != a0.dtype:
            raise ValueError(f"lora_shrink: every A must match [S, r_max, K] = {tuple(a0.shape)} (same strides, "
                             f"dtype); got {tuple(a.shape)} {a.stride()} {a.dtype}")
        if a.stride(-1) != 1 or a.device != x.device:
            raise ValueError("lora_shrink: A must be contiguous in K and on x's device")
    if x.size(1) != a0.size(2):
        raise ValueError(f"lora_shrink: A has {a0.size(2)} inputs, x has {x.size(1)}")
    if x.dtype not in FLOATS or a0.dtype not in WEIGHTS:
        raise TypeError(f"lora_shrink: unsupported dtypes x {x.dtype}, A {a0.dtype}")
    if info.num_slots != a0.size(0):
        raise ValueError(f"lora_shrink: info has {info.num_slots} slots, A has {a0.size(0)}")
    _check_scales("lora_shrink", lora_a, a_scales, [a.size(1) for a in lora_a])
    _check_info(info, x.size(0), x.device)


def check_expand(y: torch.Tensor, buf: torch.Tensor | None, lora_b: Sequence[torch.Tensor], info: TokenGroups,
                 offsets: Sequence[int], b_scales: Sequence[torch.Tensor] | None = None) -> None:
    """buf None: the fused kernel (no shrink buffer)."""
    if y.dim() != 2 or (buf is not None and buf.dim() != 3) or not lora_b:
        raise ValueError(f"lora_expand: y must be [T, N], buf [n_slices, T, r_max]; got {tuple(y.shape)}, "
                         f"{None if buf is None else tuple(buf.shape)}")
    b0 = lora_b[0]
    n_slices, num_slots, r_max = len(lora_b), b0.size(0), b0.size(-1)
    if len(offsets) != n_slices:
        raise ValueError("lora_expand: one offset per slice")
    if buf is not None and buf.shape != (n_slices, y.size(0), r_max):
        raise ValueError(f"lora_expand: shrink result {tuple(buf.shape)} does not match {n_slices} slices of "
                         f"LoRA B (rank dim {r_max}) for {y.size(0)} tokens")
    if buf is not None and (buf.dtype != torch.float32 or buf.device != y.device or buf.stride(-1) != 1):
        raise ValueError("lora_expand: buf must be float32 on y's device, contiguous in its last dim")
    for b, off in zip(lora_b, offsets):
        if b.dim() != 3 or b.size(0) != num_slots or b.size(-1) != r_max or b.dtype != b0.dtype:
            raise ValueError(f"lora_expand: every B must be [{num_slots}, n_s, {r_max}] of {b0.dtype}, "
                             f"got {tuple(b.shape)} {b.dtype}")
        if b.device != y.device:
            raise ValueError("lora_expand: B must be on y's device")
        if off < 0 or off + b.size(1) > y.size(1):
            raise ValueError(f"lora_expand: slice [{off}, {off + b.size(1)}) outside y of width {y.size(1)}")
    if y.dtype not in FLOATS or b0.dtype not in WEIGHTS:
        raise TypeError(f"lora_expand: unsupported dtypes y {y.dtype}, B {b0.dtype}")
    if info.num_slots != num_slots:
        raise ValueError(f"lora_expand: info has {info.num_slots} slots, B has {num_slots}")
    _check_scales("lora_expand", lora_b, b_scales, [b.size(1) for b in lora_b])
    b_rank_major(lora_b)
    _check_info(info, y.size(0), y.device)


def b_rank_major(lora_b: Sequence[torch.Tensor]) -> bool:
    """True when every B [S, n_s, r_max] is a view of rank-major storage [S, r_max, n_s] (n contiguous),
    False when every one is r-contiguous with one row stride; anything else is refused."""
    if all(b.stride(1) == 1 and b.stride(2) >= b.size(1) for b in lora_b):
        return True
    if all(b.stride(2) == 1 and b.stride(1) == lora_b[0].stride(1) for b in lora_b):
        return False
    raise ValueError("lora_expand: every B [S, n_s, r_max] must be contiguous in r with one row stride, or a "
                     "transposed view of [S, r_max, n_s] storage (n contiguous)")
