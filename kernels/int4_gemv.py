"""W4A16 for one row (decode at batch 1) on CUDA cores, reading the GPTQ layout as stored.

    y = gemv_mm(x, w, bias)   # w: a PreparedInt4 of backend "triton_gemv" (the "triton" tensors); y = x @ W + bias

    y[t, n] = sum_g s[g, n] * sum_{k in g} x[t, k] * (u(k, n) - zq(g, n))

Why no tensor cores: at a handful of rows an MMA pads the tokens to 16 and the int4 kernels end up bound by
issuing their own unpack and MMA instructions, not by memory (docs/PERFORMANCE.md, Nsight section). Here each
thread loads whole 32-bit words (8 k of one output feature, a warp reads 128 consecutive bytes of a row of
qweight), and a nibble becomes a float without an int->float conversion: (word >> 4j) & 0xF | 0x4B000000 is
the fp32 value 2^23 + u, and subtracting 2^23 + zq is exact. Per weight: a shift, one LOP3, one FADD, and one
FFMA; the scale multiplies each thread's partial sum once per group.
K is split across programs (decode grids are small); partials are summed in split order by the last program
of each N tile (kernels.int4_triton's reduction), so a result is the same bits on every run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.int4_triton import _MAX_TILES
from kernels.triton_env import FLOATS, tl, triton

if TYPE_CHECKING:
    from kernels.int4 import PreparedInt4

__all__ = ["GEMV_MAX_ROWS", "GemvConfig", "gemv_config", "gemv_mm"]

GEMV_MAX_ROWS = 1
"""One row: with more, Triton lays the [rows, k, n] products out so that every thread gathers all of x (offline
SASS, tools/int4_ir.py: 2-3x the instructions and spills); the MMA kernels take 2 rows and up."""
SPLIT_K_TARGET = 1024
"""Programs to aim for with the K split (a program streams a [8 * block_kw, block_n] slab at a time)."""

if triton is not None:
    from kernels.int4_triton import _counters, _store_or_reduce

    @triton.jit
    def _w4a16_gemv_kernel(
        x_ptr, qw_ptr, s_ptr, qz_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr,
        N, K_PER_SPLIT, stride_qk, stride_sg, stride_zg,
        GROUP_SIZE: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, PREFETCH: tl.constexpr,
    ):  # fmt: skip
        """acc[r, n] += s[g, n] * sum_j x[8 r + j] * (u_j(qweight[r, n]) - zq[g, n]) over steps; y[n] = sum_r acc.

        Grid (N tiles, K splits); one row of x; 8 * BLOCK_KW k per step, within one group. PREFETCH: load the next
        step's words, zero points and scales before this step's math (in registers: the loop has no shared stage).
        """
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        k_start = pid_k * K_PER_SPLIT
        rows = k_start // 8 + tl.arange(0, BLOCK_KW)
        qw_ptrs = qw_ptr + rows[:, None] * stride_qk + offs_n[None, :]
        x_ptrs = x_ptr + k_start + 8 * tl.arange(0, BLOCK_KW)
        z_shift = (offs_n % 8) * 4
        g = k_start // GROUP_SIZE
        words = tl.load(qw_ptrs, mask=mask_n[None, :], other=0)
        zw = tl.load(qz_ptr + g * stride_zg + offs_n // 8, mask=mask_n, other=0)
        s_raw = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)
        acc = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
        steps = K_PER_SPLIT // (8 * BLOCK_KW)
        for i in range(steps):
            if PREFETCH:
                cur_words, cur_zw, cur_s = words, zw, s_raw
                nxt = tl.minimum(i + 1, steps - 1)  # the last step reads its own again (no read past the split)
            else:
                nxt = i
            g = (k_start + nxt * 8 * BLOCK_KW) // GROUP_SIZE
            words = tl.load(qw_ptrs + nxt * BLOCK_KW * stride_qk, mask=mask_n[None, :], other=0)
            zw = tl.load(qz_ptr + g * stride_zg + offs_n // 8, mask=mask_n, other=0)
            s_raw = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)
            if not PREFETCH:
                cur_words, cur_zw, cur_s = words, zw, s_raw
            zf = (((cur_zw >> z_shift) & 0xF) + ZERO_OFFSET).to(tl.float32) + 8388608.0  # 2^23 + zq, exact
            part = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(8):
                w = (((cur_words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf[None, :]
                xj = tl.load(x_ptrs + (i * 8 * BLOCK_KW + j)).to(tl.float32)
                part += xj[:, None] * w
            acc += part * cur_s.to(tl.float32)[None, :]
        _store_or_reduce(tl.sum(acc, axis=0)[None, :], out_ptr, ws_ptr, cnt_ptr, b_ptr, tl.arange(0, 1), offs_n, 1, N,
                         pid_n, pid_k, HAS_BIAS, SPLIT_K)


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of the GEMV kernel: output features per program, qweight rows (8 k each) per step, K splits."""

    block_n: int
    block_kw: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 1
    """The loop has no shared-memory stage for Triton's pipeliner to deepen; PREFETCH is the hand-made one."""
    prefetch: bool = True

    def fits(self, m: int, k: int, n: int, group_size: int) -> bool:
        return (m <= GEMV_MAX_ROWS and group_size % (8 * self.block_kw) == 0
                and k % (8 * self.block_kw * self.split_k) == 0)


@functools.lru_cache(maxsize=4096)  # called per layer per step
def gemv_config(m: int, k: int, n: int, group_size: int) -> GemvConfig:
    """The untuned launch shape (the tuner, kernels.int4_tune, times neighbours): 128 output features and 16 qweight
    rows (128 k) per step, K split until about SPLIT_K_TARGET programs run with at least two steps each."""
    bkw = max(b for b in (16, 8, 4, 2, 1) if group_size % (8 * b) == 0)
    tiles = -(-n // 128)
    split = 1
    while tiles * split * 2 <= SPLIT_K_TARGET and k % (8 * bkw * split * 2) == 0 and k // (split * 2) >= 16 * bkw:
        split *= 2
    return GemvConfig(128, bkw, split)



def gemv_mm(x2: torch.Tensor, w: PreparedInt4, bias: torch.Tensor | None,
            config: GemvConfig | None = None) -> torch.Tensor:
    """y = x2 @ W + bias for the triton_gemv backend, x2 [M, K] with M <= GEMV_MAX_ROWS."""
    if triton is None:
        raise RuntimeError("int4 backend 'triton_gemv' needs the triton package")
    assert w.scales is not None and w.zeros is not None
    m, k = x2.shape
    n, g = w.layout.out_features, w.layout.group_size
    if x2.dtype not in FLOATS:
        raise TypeError(f"int4_mm: unsupported activation dtype {x2.dtype}")
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"int4 triton_gemv takes at most {GEMV_MAX_ROWS} rows, got {m}")
    c = config or gemv_config(m, k, n, g)
    if not c.fits(m, k, n, g):
        raise ValueError(f"int4 triton_gemv config {c} does not fit M={m}, K={k}, group {g}")
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    grid = (triton.cdiv(n, c.block_n), c.split_k)
    if c.split_k > 1 and grid[0] > _MAX_TILES:
        raise ValueError(f"int4 triton_gemv: {grid[0]} output tiles exceed the {_MAX_TILES} split-K counters")
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    ws = torch.empty((c.split_k, m, n), dtype=torch.float32, device=x2.device) if c.split_k > 1 else out
    b = bias.contiguous() if bias is not None else out  # dummy pointer when HAS_BIAS is False
    _w4a16_gemv_kernel[grid](
        x2, w.weight, w.scales, w.zeros, b, out, ws, _counters(x2.device), n, k // c.split_k, w.weight.stride(0),
        w.scales.stride(0), w.zeros.stride(0), GROUP_SIZE=g, ZERO_OFFSET=w.layout.zero_offset,
        HAS_BIAS=bias is not None, SPLIT_K=c.split_k, BLOCK_N=c.block_n, BLOCK_KW=c.block_kw,
        PREFETCH=c.prefetch, num_warps=c.num_warps, num_stages=c.num_stages)
    return out
