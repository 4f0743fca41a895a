"""Triton W4A16 kernels reading the AutoRound / GPTQ layout as stored (qweight [K/8, N] int32, packed qzeros
[K/G, N/8], scales [K/G, N]); checked against kernels.reference by tests/kernels/test_int4.py.

    y = triton_mm(x, w, bias)   # w: a PreparedInt4 of backend "triton"; y = x @ W + bias

Tensor-core tiles (tl.dot) of the unpacked weights, launch shape per (M, K, N) from `triton_config`. K is
split across programs for small M (a decode GEMM has too few N tiles to fill the GPU). Split-K partials
are summed inside the kernel by the last program of each tile to finish, in split order, so the result
is the same bits on every run and no second launch is needed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.triton_env import FLOATS, interpreting, tl, triton

if TYPE_CHECKING:
    from kernels.int4 import PreparedInt4

__all__ = ["TritonInt4Config", "dequant_mm", "dequant_triton", "triton_config", "triton_mm"]

_MAX_TILES = 1 << 16
"""Split-K tile counters per device (each launch leaves its counters at zero). Every launch numbers its tiles
from 0, so two split-K launches must not run at once on one device: the engine uses one stream."""

if triton is not None:

    @triton.jit
    def _store_or_reduce(acc, out_ptr, ws_ptr, cnt_ptr, b_ptr, offs_m, offs_n, M, N, tile, pid_k,
                         HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
        """out[m, n] = sum over splits of acc (+ bias[n]). With SPLIT_K > 1 each program parks its fp32
        partial in ws[pid_k]; the last to finish its tile (counted in cnt[tile]) adds them in split order."""
        mask_n = offs_n < N
        mask = (offs_m[:, None] < M) & mask_n[None, :]
        if SPLIT_K > 1:
            tl.store(ws_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is written before the counter says so
            done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT_K - 1:
                acc = tl.zeros_like(acc)
                for s in range(SPLIT_K):  # fixed order: the same bits on every run
                    acc += tl.load(ws_ptr + s * M * N + offs_m[:, None] * N + offs_n[None, :], mask=mask,
                                   other=0.0, cache_modifier=".cg")  # L2: other programs wrote them
                if HAS_BIAS:
                    acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                         mask=mask)
                tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _w4a16_dot_kernel(
        x_ptr, qw_ptr, s_ptr, qz_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr,
        M, N, K_PER_SPLIT,
        stride_xm, stride_qk, stride_sg, stride_zg,
        GROUP_SIZE: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
        FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """y[m, n] = sum_k x[m, k] * s[k//G, n] * (u(k, n) - zq(k//G, n))  on tensor cores.

        Grid (M tiles, N tiles, splits of K). Each packed word is loaded once and unpacked to its 8 k rows
        in registers; one group per K tile, so the scale multiplies the tile's product of small integers.
        """
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        k_start = pid_k * K_PER_SPLIT
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + tl.arange(0, BLOCK_K))[None, :]
        qw_ptrs = qw_ptr + (k_start // 8 + tl.arange(0, BLOCK_K // 8))[:, None] * stride_qk + offs_n[None, :]
        shifts = (tl.arange(0, 8) * 4)[None, :, None]  # nibble j of a word holds k = 8 * row + j
        z_shift = (offs_n % 8) * 4

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
            g = k0 // GROUP_SIZE
            words = tl.load(qw_ptrs, mask=mask_n[None, :], other=0)
            u = tl.reshape((words[:, None, :] >> shifts) & 0xF, (BLOCK_K, BLOCK_N))  # & drops sign bits
            zw = tl.load(qz_ptr + g * stride_zg + offs_n // 8, mask=mask_n, other=0)
            zq = ((zw >> z_shift) & 0xF) + ZERO_OFFSET
            s = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            q = u - zq[None, :]  # integers in [-16, 15]
            if FP32_DOT:
                part = tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(x, q.to(x.dtype))  # fp32 accumulate
            acc += part * s[None, :]
            x_ptrs += BLOCK_K
            qw_ptrs += (BLOCK_K // 8) * stride_qk
        _store_or_reduce(acc, out_ptr, ws_ptr, cnt_ptr, b_ptr, offs_m, offs_n, M, N,
                         pid_m * tl.num_programs(1) + pid_n, pid_k, HAS_BIAS, SPLIT_K)


@dataclass(frozen=True)
class TritonInt4Config:
    """Launch shape of a Triton W4A16 kernel for one (M, K, N)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


SPLIT_K_TARGET_CTAS = 512
"""Decode (small M) splits K until about this many programs run: one program per N tile leaves most of
a large GPU idle when N / BLOCK_N is near the SM count, and the weight read is the whole cost."""


def _split(tiles: int, k: int, block_k: int, target: int) -> int:
    split = 1
    while (tiles * split * 2 <= target and k % (block_k * split * 2) == 0
           and k // (split * 2) >= 4 * block_k):
        split *= 2
    return split


@functools.lru_cache(maxsize=4096)  # called per layer per step
def triton_config(m: int, k: int, n: int, group_size: int) -> TritonInt4Config:
    """Launch shapes measured on an H200 at Qwen3-8B shapes for M in {16, 32, 64} (benchmarks/bench_int4.py
    --sweep; docs/PERFORMANCE.md): 4 warps, 3 stages, BLOCK_N 64 with K split until about 512 programs run
    at M <= 16 and 384 above; very wide layers (N >= 16384) up to 32 rows take BLOCK_N 128 and BLOCK_K 64."""
    block_k = max(b for b in (16, 32, 64, 128) if group_size % b == 0)
    if m > 64:
        return TritonInt4Config(64, 128, min(block_k, 64), 1, num_warps=4, num_stages=3)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, bk = (128, min(block_k, 64)) if n >= 16384 and m <= 32 else (64, block_k)
    target = SPLIT_K_TARGET_CTAS if m <= 16 else SPLIT_K_TARGET_CTAS * 3 // 4
    return TritonInt4Config(block_m, block_n, bk, _split(triton.cdiv(n, block_n), k, bk, target), 4, 3)


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    # Allocated on the first (eager) call, before any graph capture; kernels leave it all zero.
    return torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)


def triton_mm(x2: torch.Tensor, w: PreparedInt4, bias: torch.Tensor | None,
              config: TritonInt4Config | None = None) -> torch.Tensor:
    """y = x2 @ W + bias for the triton backend, x2 [M, K]; launch shape `config` (default: triton_config's)."""
    if triton is None:
        raise RuntimeError("int4 backend 'triton' needs the triton package")
    assert w.scales is not None and w.zeros is not None
    m, k = x2.shape
    n, g = w.layout.out_features, w.layout.group_size
    if x2.dtype not in FLOATS:
        raise TypeError(f"int4_mm: unsupported activation dtype {x2.dtype}")
    c = config or triton_config(m, k, n, g)
    if g % c.block_k or k % (c.block_k * c.split_k) or c.block_k % 8:
        raise ValueError(f"int4 triton config {c} does not fit K={k}, group {g}")
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    grid = (triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n), c.split_k)
    if c.split_k > 1 and grid[0] * grid[1] > _MAX_TILES:
        raise ValueError(f"int4 triton: {grid[0] * grid[1]} output tiles exceed the {_MAX_TILES} split-K counters")
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    ws = torch.empty((c.split_k, m, n), dtype=torch.float32, device=x2.device) if c.split_k > 1 else out
    b = bias.contiguous() if bias is not None else out  # dummy pointer when HAS_BIAS is False
    args = (x2, w.weight, w.scales, w.zeros, b, out, ws, _counters(x2.device), m, n, k // c.split_k,
            x2.stride(0), w.weight.stride(0), w.scales.stride(0), w.zeros.stride(0))
    common = dict(GROUP_SIZE=g, ZERO_OFFSET=w.layout.zero_offset, HAS_BIAS=bias is not None, SPLIT_K=c.split_k,
                  BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps,
                  num_stages=c.num_stages)
    fp32_dot = x2.dtype == torch.float32 or (x2.dtype == torch.bfloat16 and interpreting())
    _w4a16_dot_kernel[grid](*args, FP32_DOT=fp32_dot, **common)
    return out


# ----------------------------------------------------------------------------------------------------
# Fused dequantization (for large M: dequantize once into a transient dense weight, then a dense GEMM)

if triton is not None:

    @triton.jit
    def _dequant_gptq_kernel(qw_ptr, qz_ptr, sc_ptr, out_ptr, KW, N, GROUP_SIZE: tl.constexpr,
                             ZERO_OFFSET: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        """W[8r + j, n] = scales[(8r+j)//G, n] * (u_j(qweight[r, n]) - (z((8r+j)//G, n) + ZERO_OFFSET))."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < KW) & (cols[None, :] < N)
        words = tl.load(qw_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0)
        grp = (rows * 8) // GROUP_SIZE  # the 8 k of a word share a group (G is a multiple of 8)
        zw = tl.load(qz_ptr + grp[:, None] * (N // 8) + cols[None, :] // 8, mask=mask, other=0)
        z = ((zw >> ((cols[None, :] % 8) * 4)) & 0xF) + ZERO_OFFSET
        s = tl.load(sc_ptr + grp[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(8):
            u = (words >> (4 * j)) & 0xF
            w = (u - z).to(tl.float32) * s
            tl.store(out_ptr + (rows[:, None] * 8 + j) * N + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequant_triton(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                   zero_offset: int, dtype: torch.dtype) -> torch.Tensor:
    """kernels.reference.dequant_int4 in one Triton pass: W [K, N] in dtype."""
    if triton is None:
        raise RuntimeError("dequant_triton needs the triton package")
    kw, n = qweight.shape
    if group_size % 8 or qzeros.shape != (kw * 8 // group_size, n // 8) or scales.shape != (kw * 8 // group_size, n):
        raise ValueError(f"dequant_triton: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales "
                         f"{tuple(scales.shape)} do not fit group size {group_size}")
    out = torch.empty(kw * 8, n, dtype=dtype, device=qweight.device)
    block_r, block_n = 16, 128
    _dequant_gptq_kernel[(triton.cdiv(kw, block_r), triton.cdiv(n, block_n))](
        qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), out, kw, n, GROUP_SIZE=group_size,
        ZERO_OFFSET=zero_offset, BLOCK_R=block_r, BLOCK_N=block_n)
    return out


def dequant_mm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
               zero_offset: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W) (+ bias) for a 2-D x: W dequantized into a transient dense copy in x's dtype, then the dense
    GEMM. (W in pieces that stay in L2, each piece's GEMM after it, one after the other or overlapped on two streams,
    lost to this on every Qwen3-8B and 27B shape at 256 and 1024 rows on an H100: docs/PERFORMANCE.md, thirty-fourth
    session.)"""
    if x.dim() != 2 or x.shape[1] != qweight.shape[0] * 8:
        raise ValueError(f"dequant_mm: x {tuple(x.shape)} does not fit K = {qweight.shape[0] * 8}")
    w = dequant_triton(qweight, qzeros, scales, group_size, zero_offset, x.dtype)
    return torch.addmm(bias, x, w) if bias is not None else x @ w
