"""A 16-bit linear with few output features, for decode rows (Triton): one launch where cuBLAS splits K.

    y[m, n] = sum_k x[m, k] * w[n, k]  (+ bias[n])       reference: torch.nn.functional.linear

Qwen3.5's [b | a] projection (hidden -> 2 Hv: 5120 -> 96 on the 27B) reads 1 MB per GDN layer; cuBLAS runs it as
a split-K GEMM and its reduce, two launches, ~6 us together in a graph on an H100 whatever the rows (up to 64).
Here each program takes BLOCK_N features of BLOCK_M rows over the whole of K (a compile-time constant, so the
loop unrolls and its loads can all be in flight at once), sums in float32, and stores once: deterministic, no
workspace. A program's product is a [BLOCK_M, BLOCK_N, BLOCK_K] broadcast (no tensor cores: at these sizes
the bytes, not the multiply-adds, set the time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.triton_env import FLOATS, tl, triton, usable_on

__all__ = ["MAX_FEATURES", "MAX_ROWS", "skinny_config", "skinny_linear", "skinny_linear_triton", "takes"]

MAX_FEATURES = 256
"""Widest output it takes (a program per 2 features: 128 programs); the 27B's projection has 96. Wider outputs were
not timed against cuBLAS."""
MAX_ROWS = 16
"""Most rows it takes. On an H100 at 5120 -> 96 in a graph (benchmarks/bench_gdn_decode.py, `proj_*`): 3.3 / 4.6 us
against cuBLAS's 6.1 / 6.1 at 1 / 8 rows, but 7.0 / 12.4 against 6.4 / 6.4 at 32 / 64, where each program's rows
re-read its weights (docs/PERFORMANCE.md, thirty-second session)."""

if triton is not None:

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, stride_x, stride_w, stride_y, K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mm, mn = rm < M, rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            mk = rk < K
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :], mask=mm[:, None] & mk[None, :],
                        other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :], mask=mn[:, None] & mk[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=mn, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def skinny_config(m: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps): up to 4 rows and 2 features per program, so that a decode step's grid has
    one program per 2 features per 4 rows; K in unrolled slices of at most 2048 (three at the 27B's 5120)."""
    block_m = min(4, _pow2(m))
    block_k = min(2048, _pow2(k))
    return block_m, 2, block_k, 4


def takes(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """skinny_linear_triton runs this problem here: decode-sized rows, few features, its layouts, a Triton device."""
    return (x.dim() == 2 and 0 < x.size(0) <= MAX_ROWS and w.dim() == 2 and w.size(0) <= MAX_FEATURES
            and x.size(1) == w.size(1) and x.dtype in FLOATS and w.dtype == x.dtype and x.stride(1) == 1
            and w.is_contiguous() and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
            and usable_on(x.device.type))


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, use_triton: bool) -> torch.Tensor:
    """F.linear(x, w, bias), by skinny_linear_triton where use_triton and it takes the problem (takes)."""
    if use_triton and takes(x, w, bias):
        return skinny_linear_triton(x, w, bias)
    return F.linear(x, w, bias)


def skinny_linear_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous in K), w [N, K] contiguous, bias [N] -> y [M, N] in x's dtype; M <= MAX_ROWS,
    N <= MAX_FEATURES. `config` (BLOCK_M, BLOCK_N, BLOCK_K, warps) overrides skinny_config (benchmarks)."""
    if x.dim() != 2 or w.dim() != 2 or x.size(1) != w.size(1):
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} and w {tuple(w.shape)} do not share K")
    if x.dtype not in FLOATS or w.dtype != x.dtype or (bias is not None and bias.shape != (w.size(0),)):
        raise ValueError(f"skinny_linear: x {x.dtype}, w {w.dtype}, bias {None if bias is None else bias.shape}")
    if x.stride(1) != 1 or not w.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        raise ValueError("skinny_linear: x's rows, w and the bias must be contiguous")
    m, k = x.shape
    n = w.size(0)
    if m > MAX_ROWS or n > MAX_FEATURES:
        raise ValueError(f"skinny_linear: {m} rows x {n} features exceed {MAX_ROWS} x {MAX_FEATURES}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk, warps = config or skinny_config(m, k)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _skinny_kernel[grid](x, w, bias if bias is not None else w, y, m, n, x.stride(0), w.stride(0), y.stride(0), K=k,
                         HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return y
