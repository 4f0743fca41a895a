"""A LoRA shrink joined to the small op before its layer (decode steps): the launch that computes a wrapped layer's
input also multiplies it by the token's A, so the layer runs three launches (prologue + shrink, base GEMM, expand)
instead of four. Two prologues: the RMSNorm with the residual add (before qkv / gate_up) and silu-and-mul (before
down).

    norm_shrink: h = x (+ r); y = rms_norm(h) * w; buf[kc, s, t, :r] = y[t, kc-th K chunk] @ A_s[slot[t], :r, chunk].T
    act_shrink:  y = silu(x[:, :d]) * x[:, d:];      buf[kc, 0, t, :r] = y[t, chunk] @ A[slot[t], :r, chunk].T
    fp8 A (e4m3 bytes, decoded in registers): each partial times its rank row's float32 scale, scale_s[slot[t], r].

Program (token, K chunk): it computes its chunk of y (the norm's whole row first, for the mean of squares), stores
it, and multiplies it by its slot's A rows below each slice's rank. buf is the split shrink's partial buffer
[split_k, n_slices, T, r_max]: kernels.lora_triton.expand_partials sums it in a fixed order and expands it. Rows
with slot -1 and columns past a rank are not written (the expand never reads them). y and h round as
kernels.fused_triton's separate kernels do (the norm's mean of squares may sum in another order: an ulp); the
products are y's rounded values times A in float32.

Each token reads its A rows itself (a slot's A once per token, from the cache after the first), so this can pay only
where a step has few tokens: kernels.lora_config.use_prologue takes it for steps of up to 32 tokens by default (on an
H100 it saved 2.2-3.3 % of a 32-adapter decode step and nothing with one adapter: docs/PERFORMANCE.md,
twenty-seventh and twenty-ninth sessions).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.fused import check_rms_norm
from kernels.lora_checks import check_ranks, check_shrink
from kernels.lora_config import prologue_config
from kernels.lora_tables import _raw
from kernels.lora_triton import TokenGroups, _require_triton
from kernels.triton_env import tl, triton

__all__ = ["act_shrink", "norm_shrink", "one_store"]

if triton is not None:
    from kernels.fused_triton import _inv_rms, _residual_add, _silu_mul
    from kernels.lora_kernels import _e4m3_as_f16

    @triton.jit
    def _slot_rows(a_ptr, slot, rank_ptr, stride_as, stride_ar, slice_stride, stride_rs, NUM_SLICES: tl.constexpr,
                   S_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
        """(row pointers, row mask) of a slot's A rows below each slice's rank: row j = s * BLOCK_R + r of one
        [S_PAD * BLOCK_R, BK] tile (the slices are column ranges of one store, slice_stride apart)."""
        j = tl.arange(0, S_PAD * BLOCK_R)
        s, r = j // BLOCK_R, j % BLOCK_R
        rank = tl.load(rank_ptr + s * stride_rs, mask=s < NUM_SLICES, other=0)
        return a_ptr + slot * stride_as + s.to(tl.int64) * slice_stride + r * stride_ar, r < rank

    @triton.jit
    def _row_scales(sc_ptr, slot, stride_ss, stride_sr, sc_slice, mask_r, S_PAD: tl.constexpr,
                    BLOCK_R: tl.constexpr):
        """fp8: each of _slot_rows' rows' float32 scale, times 256 (undoes _e4m3_as_f16's 2^-8)."""
        j = tl.arange(0, S_PAD * BLOCK_R)
        s, r = j // BLOCK_R, j % BLOCK_R
        return tl.load(sc_ptr + slot * stride_ss + s * sc_slice + r * stride_sr, mask=mask_r, other=0.0) * 256.0

    @triton.jit
    def _a_tile(rows, mask_r, offs_k, mask_k):
        """A's [S_PAD * BLOCK_R, BK] tile at K columns offs_k (rows, mask_r: _slot_rows'; all masked: no load)."""
        return tl.load(rows[:, None] + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0)

    @triton.jit
    def _tile_dot(acc, at, yk, FP8: tl.constexpr):
        """acc[j] += sum_k yk[k] * at[j, k] (fp8: A's bytes decoded, its scales left to the caller)."""
        if FP8:
            at = _e4m3_as_f16(at)
        return acc + tl.sum(at.to(tl.float32) * yk.to(tl.float32)[None, :], axis=1)

    @triton.jit
    def _store_partial(acc, buf_ptr, kc, t, stride_bk, stride_bs, stride_bt, R_MAX, NUM_SLICES: tl.constexpr,
                       S_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
        j = tl.arange(0, S_PAD * BLOCK_R)
        s, r = j // BLOCK_R, j % BLOCK_R
        tl.store(buf_ptr + kc * stride_bk + s * stride_bs + t * stride_bt + r, acc,
                 mask=(s < NUM_SLICES) & (r < R_MAX))

    @triton.jit
    def _norm_shrink_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, a_ptr, buf_ptr, rank_ptr, slot_ptr, sc_ptr,
                            D, KC, stride_x, stride_r, eps, R_MAX, stride_as, stride_ar, slice_stride,
                            stride_ss, stride_sr, sc_slice, stride_bk, stride_bs, stride_bt, stride_rs, stride_rt,
                            HAS_RES: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_D: tl.constexpr,
                            BK: tl.constexpr, NUM_SLICES: tl.constexpr, S_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                            FP8: tl.constexpr):
        # Loads in the order of their chains (a load waits on nothing issued after it): the slot, the row for the
        # mean of squares, the rank (on the slot), the first A tile (on the rank); each step then loads the next
        # tile before it computes, so no A load waits behind the norm's reduction or the y / h stores.
        t, kc = tl.program_id(0).to(tl.int64), tl.program_id(1)
        slot = tl.load(slot_ptr + t)
        offs = tl.arange(0, BLOCK_D)
        m = offs < D
        x_row = tl.load(x_ptr + t * stride_x + offs, mask=m, other=0.0)
        if HAS_RES:
            r_row = tl.load(r_ptr + t * stride_r + offs, mask=m, other=0.0)
        lora = slot >= 0
        slot64 = tl.maximum(slot, 0).to(tl.int64)
        rows, mask_r = _slot_rows(a_ptr, slot64, rank_ptr + slot64 * stride_rt, stride_as, stride_ar, slice_stride,
                                  stride_rs, NUM_SLICES, S_PAD, BLOCK_R)
        mask_r = tl.where(lora, mask_r, False)  # a token without an adapter loads no A
        if FP8:  # loaded ahead: the loop does not wait on it
            sc = _row_scales(sc_ptr, slot64, stride_ss, stride_sr, sc_slice, mask_r, S_PAD, BLOCK_R)
        k_lo = kc * KC
        k_hi = tl.minimum(k_lo + KC, D)
        offs_0 = k_lo + tl.arange(0, BK)
        at = _a_tile(rows, mask_r, offs_0, offs_0 < k_hi)
        if HAS_RES:  # as _residual_add: summed in float32, rounded to x's dtype
            x_row = (x_row.to(tl.float32) + r_row.to(tl.float32)).to(x_row.dtype)
        inv = _inv_rms(x_row, D, eps)
        acc = tl.zeros((S_PAD * BLOCK_R,), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            offs_k = k0 + tl.arange(0, BK)
            mk = offs_k < D
            at_next = _a_tile(rows, mask_r, offs_k + BK, offs_k + BK < k_hi)
            hk = _residual_add(x_ptr + t * stride_x + offs_k, r_ptr + t * stride_r + offs_k, mk, HAS_RES)
            if HAS_RES:
                tl.store(h_ptr + t * D + offs_k, hk, mask=mk)
            w = tl.load(w_ptr + offs_k, mask=mk, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                w += 1.0
            yk = (hk.to(tl.float32) * inv * w).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + t * D + offs_k, yk, mask=mk)
            if lora:
                acc = _tile_dot(acc, at, yk, FP8)
            at = at_next
        if lora:
            if FP8:
                acc = acc * sc
            _store_partial(acc, buf_ptr, kc, t, stride_bk, stride_bs, stride_bt, R_MAX, NUM_SLICES, S_PAD, BLOCK_R)

    @triton.jit
    def _act_shrink_kernel(x_ptr, y_ptr, a_ptr, buf_ptr, rank_ptr, slot_ptr, sc_ptr, D, KC, stride_x, R_MAX,
                           stride_as, stride_ar, stride_ss, stride_sr, stride_bk, stride_bt, stride_rt,
                           BK: tl.constexpr, BLOCK_R: tl.constexpr, FP8: tl.constexpr):
        t, kc = tl.program_id(0).to(tl.int64), tl.program_id(1)  # loads ordered as in _norm_shrink_kernel
        slot = tl.load(slot_ptr + t)
        lora = slot >= 0
        slot64 = tl.maximum(slot, 0).to(tl.int64)
        rows, mask_r = _slot_rows(a_ptr, slot64, rank_ptr + slot64 * stride_rt, stride_as, stride_ar, 0, 0, 1, 1,
                                  BLOCK_R)
        mask_r = tl.where(lora, mask_r, False)  # a token without an adapter loads no A
        if FP8:
            sc = _row_scales(sc_ptr, slot64, stride_ss, stride_sr, 0, mask_r, 1, BLOCK_R)
        k_lo = kc * KC
        k_hi = tl.minimum(k_lo + KC, D)
        offs_0 = k_lo + tl.arange(0, BK)
        at = _a_tile(rows, mask_r, offs_0, offs_0 < k_hi)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            offs_k = k0 + tl.arange(0, BK)
            mk = offs_k < D
            at_next = _a_tile(rows, mask_r, offs_k + BK, offs_k + BK < k_hi)
            yk = _silu_mul(x_ptr + t * stride_x + offs_k, D, mk, y_ptr.dtype.element_ty)
            tl.store(y_ptr + t * D + offs_k, yk, mask=mk)
            if lora:
                acc = _tile_dot(acc, at, yk, FP8)
            at = at_next
        if lora:
            if FP8:
                acc = acc * sc
            _store_partial(acc, buf_ptr, kc, t, stride_bk, 0, stride_bt, R_MAX, 1, 1, BLOCK_R)


def one_store(lora_a: Sequence[torch.Tensor]) -> int | None:
    """The element distance between consecutive slices' A when they are column ranges of one store (the engine's
    layout, which the prologue kernels read with one base pointer), else None."""
    a0 = lora_a[0]
    step = a0.size(-1)
    if any(a.data_ptr() != a0.data_ptr() + i * step * a0.element_size() for i, a in enumerate(lora_a)):
        return None
    return step


def _check(what: str, x: torch.Tensor, lora_a: Sequence[torch.Tensor], info: TokenGroups, ranks: torch.Tensor,
           a_scales: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, int, tuple[torch.Tensor, int, int, int]]:
    """lora_triton's shrink checks for x [T, K] (the op's output's shape) plus what these kernels need: A 16-bit as
    x, float32 or fp8 with its scales, r_max <= 64, the slices column ranges of one store, their scales too (a
    fixed distance apart). Returns (ranks, the slices' distance, the scales' (base, slot stride, rank stride,
    slices' distance); A itself and zeros without fp8)."""
    check_shrink(x, lora_a, info, a_scales)
    a0 = lora_a[0]
    step = one_store(lora_a)
    if a0.dtype not in (x.dtype, torch.float32, torch.float8_e4m3fn) or a0.size(1) > 64 or step is None:
        raise ValueError(f"{what}: A must be {x.dtype}, float32 or fp8 with r_max <= 64, its slices consecutive "
                         f"column ranges of one store; got {a0.dtype} r_max {a0.size(1)}")
    scales: tuple[torch.Tensor, int, int, int] = (a0, 0, 0, 0)
    if a_scales is not None:  # check_shrink: float32 [S, r_max] each, one stride pair
        sc0 = a_scales[0]
        apart = (a_scales[1].data_ptr() - sc0.data_ptr()) // 4 if len(a_scales) > 1 else 0
        if any(sc.data_ptr() != sc0.data_ptr() + 4 * i * apart for i, sc in enumerate(a_scales)):
            raise ValueError(f"{what}: fp8 A's scales must lie a fixed distance apart in one store")
        scales = (sc0, sc0.stride(0), sc0.stride(1), apart)
    return check_ranks(ranks, len(lora_a), info.num_slots, x.device), step, scales


def _buffer(split: int, n_slices: int, t: int, r_max: int, device: torch.device) -> torch.Tensor:
    return torch.empty(split, n_slices, t, r_max, dtype=torch.float32, device=device)


def norm_shrink(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool, residual: torch.Tensor | None,
                lora_a: Sequence[torch.Tensor], info: TokenGroups, ranks: torch.Tensor,
                a_scales: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, buf): kernels.fused.rms_norm's (y, h) and the shrink partials of y (see the module docstring).

    x / residual [T, D] (last dim contiguous); lora_a[s] [S, r_max, D], column ranges of one store; ranks [n_slices,
    S] int32 (the A side's); a_scales[s] [S, r_max] float32 for fp8 A, a fixed distance apart."""
    _require_triton()
    t, d = x.shape
    check_rms_norm(x, weight, residual)
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("norm_shrink: x and the residual must be contiguous in their last dim")
    r, step, (sc, stride_ss, stride_sr, sc_slice) = _check("norm_shrink", x, lora_a, info, ranks, a_scales)
    n_slices, (_, r_max, _) = len(lora_a), lora_a[0].shape
    cfg = prologue_config(d, r_max)
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    buf = _buffer(cfg["split_k"], n_slices, t, r_max, x.device)
    if t:
        a0 = _raw(lora_a[0])
        res = residual if residual is not None else x
        _norm_shrink_kernel[(t, cfg["split_k"])](
            x, res, weight, y, h, a0, buf, r, info.part(0), sc, d, cfg["k_per_split"], x.stride(0), res.stride(0),
            eps, r_max, a0.stride(0), a0.stride(1), step, stride_ss, stride_sr, sc_slice, buf.stride(0),
            buf.stride(1), buf.stride(2), r.stride(0), r.stride(1),
            HAS_RES=residual is not None, ZERO_CENTERED=zero_centered, BLOCK_D=triton.next_power_of_2(d),
            BK=cfg["block_k"], NUM_SLICES=n_slices, S_PAD=triton.next_power_of_2(n_slices), BLOCK_R=cfg["block_r"],
            FP8=a_scales is not None, num_warps=cfg["num_warps"],
        )  # fmt: skip
    return y, h, buf


def act_shrink(x: torch.Tensor, lora_a: torch.Tensor, info: TokenGroups, ranks: torch.Tensor,
               a_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, buf): kernels.fused.silu_and_mul(x) and the shrink partials of y with one slice's A [S, r_max, d] (see
    the module docstring). x [T, 2d] (last dim contiguous); ranks [1, S] int32; a_scale [S, r_max] float32 for fp8
    A."""
    _require_triton()
    t, d2 = x.shape
    if x.stride(1) != 1 or d2 % 2:
        raise ValueError(f"act_shrink: x must be [T, 2d] with its last dim contiguous, got {tuple(x.shape)}")
    d = d2 // 2
    r, _, (sc, stride_ss, stride_sr, _) = _check("act_shrink", x[:, :d], [lora_a], info, ranks,
                                                 None if a_scale is None else [a_scale])
    r_max = lora_a.size(1)
    cfg = prologue_config(d, r_max)
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)
    buf = _buffer(cfg["split_k"], 1, t, r_max, x.device)
    if t:
        a = _raw(lora_a)
        _act_shrink_kernel[(t, cfg["split_k"])](
            x, y, a, buf, r, info.part(0), sc, d, cfg["k_per_split"], x.stride(0), r_max, a.stride(0), a.stride(1),
            stride_ss, stride_sr, buf.stride(0), buf.stride(2), r.stride(1),
            BK=cfg["block_k"], BLOCK_R=cfg["block_r"], FP8=a_scale is not None, num_warps=cfg["num_warps"],
        )  # fmt: skip
    return y, buf
