"""The LoRA epilogue of the int4 mma kernels (kernels.int4_mma's Triton kernel, and kernels.int4_cuda's CUDA C one up
to 64 rows): a LoRA expand added to the base GEMM's output before its store, so that a wrapped layer launches no
expand of its own (opt-in: kernels.lora_triton.use_epilogue; kernels.int4.takes_lora says which launches can).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.triton_env import tl, triton

__all__ = ["LoRAEpilogue"]


@dataclass(frozen=True)
class LoRAEpilogue:
    """A LoRA expand fused into the mma kernel's store (no expand launch of its own):

        y[t, n] += sum_{r < rank[s(n), slot[t]]} (sum_ks h[ks, s(n), t, r]) * B[slot[t], r, n]   for slot[t] >= 0

    h: the shrink's per-split partials [split, n_slices, T, r_max] float32 (kernels.lora_triton.shrink_partials);
    b: the layer's B store [S, r_max, N] rank-major, all slices' columns side by side (the scale folded in), in a
    16-bit or float32 dtype; ranks [n_slices, S] int32 (any strides); slots [T] int32 (-1: no adapter); starts:
    each slice's first column, ascending from 0 (at most 3 slices), each a multiple of the launch's block_n so
    that a tile's columns lie in one slice."""

    h: torch.Tensor
    b: torch.Tensor
    ranks: torch.Tensor
    slots: torch.Tensor
    starts: tuple[int, ...]

    def fits(self, block_n: int) -> bool:
        return 1 <= len(self.starts) <= 3 and self.starts[0] == 0 and all(s % block_n == 0 for s in self.starts)

    def check(self, m: int, n: int) -> None:
        _, n_slices, t, r_max = self.h.shape
        if (t != m or self.h.dtype != torch.float32 or self.h.stride(-1) != 1 or n_slices != len(self.starts)
                or self.b.dim() != 3 or self.b.shape[1:] != (r_max, n) or self.b.stride(-1) != 1
                or self.ranks.shape != (n_slices, self.b.size(0)) or self.ranks.dtype != torch.int32
                or self.slots.shape != (m,) or self.slots.dtype != torch.int32 or self.slots.stride(0) != 1):
            raise ValueError(f"LoRA epilogue: h {tuple(self.h.shape)}, B {tuple(self.b.shape)}, ranks "
                             f"{tuple(self.ranks.shape)}, slots {tuple(self.slots.shape)} do not fit M={m}, N={n}")


if triton is not None:

    @triton.jit
    def _add_lora(acc, n0, offs_n, offs_t, M, N, lo_ptr, lb_ptr, lr_ptr, ls_ptr, s1, s2, r_max,
                  stride_hk, stride_hs, stride_ht, stride_lbs, stride_lbr, stride_lrs, stride_lrt,
                  SPLIT_H: tl.constexpr, BLOCK_R: tl.constexpr):
        """acc[n, t] += sum_{r < rank} (sum_ks h[ks, s, t, r]) * B[slot[t], r, n] (LoRAEpilogue); the tile's
        columns lie in one slice s (n0: its first column); rank and B rows past it are never read."""
        sl = (n0 >= s1).to(tl.int32) + (n0 >= s2).to(tl.int32)
        mask_t = offs_t < M
        slot = tl.load(ls_ptr + offs_t, mask=mask_t, other=-1)
        valid = slot >= 0
        slot_c = tl.where(valid, slot, 0).to(tl.int64)
        rank = tl.load(lr_ptr + sl * stride_lrs + slot_c * stride_lrt, mask=valid, other=0)  # [BT]
        offs_r = tl.arange(0, BLOCK_R)
        mask_h = valid[:, None] & (offs_r[None, :] < rank[:, None])
        hp = lo_ptr + sl * stride_hs + offs_t[:, None].to(tl.int64) * stride_ht + offs_r[None, :]
        h = tl.load(hp, mask=mask_h, other=0.0)  # [BT, BR]: the shrink's K splits, summed in a fixed order
        for ks in tl.static_range(1, SPLIT_H):
            h += tl.load(hp + ks * stride_hk, mask=mask_h, other=0.0)
        mask_n = offs_n < N
        bp = lb_ptr + slot_c[None, :] * stride_lbs + offs_n[:, None]  # [BN, BT]: each token its slot's B
        r_hi = tl.minimum(tl.max(rank, axis=0), r_max)  # the tile's largest rank: no work past it (0: base rows only)
        for r in range(0, r_hi):
            col = tl.sum(tl.where(offs_r[None, :] == r, h, 0.0), axis=1)  # h[:, r]
            bv = tl.load(bp + r * stride_lbr, mask=mask_n[:, None] & (r < rank)[None, :], other=0.0)
            acc += bv.to(tl.float32) * col[None, :]
        return acc

else:  # pragma: no cover - without triton the mma kernel is not defined either
    _add_lora = None
