"""W4A16 for one to four rows (batch-1 decode) on the mma kernel's repacked weights, without a matrix unit.

    y = gemv_mm(x, w, meta, group_size, bias, config)   # y = x @ W + bias; w, meta as kernels.int4_mma keeps them
    y[t, n] = sum_g s[g, n] * sum_{k in g} (u(k, n) - zq[g, n]) * x[t, k]

Why (docs/PERFORMANCE.md "int4 GEMM"): at one row the MMA kernel still computes a 16-token tile, and its unpack
rearranges every nibble into the fragment order. A dot product does not care about the order of k, so this kernel
reads the same words with one 16-byte load per thread (4 words: output n's 32 inputs of one 32-k block) and
gathers x in the words' order instead. A nibble u becomes a float without an int->float conversion: shifted to
mantissa bits 19..22 under the exponent of 1.0 it is the fp32 1 + u/16, so that (16-bit activations)

    sum_k (u - zq) x = 16 * sum_k (1 + u/16) x - (16 + zq) * sum_k x

costs a shift, one bitwise op (and | or) and one FMA per weight, the zero point once per group. The products of
1 + u/16 (5 significant bits) and a 16-bit x (at most 11) are exact in fp32. fp32 activations use the exact
integer form (bits of 2^23 + u minus 2^23 + zq), one more op per weight. The tile counters and split-K finish
are the mma kernel's (deterministic partial sums, the same bits on every run).
"""

from __future__ import annotations

import torch

from kernels.int4_mma import _MAX_TILES, MMA_K, MMA_N, SPLIT_K_TARGET, MmaConfig, _counters
from kernels.triton_env import FLOATS, tl, triton

__all__ = ["GEMV_ROWS", "gemv_mm", "gemv_variants"]

GEMV_ROWS = (1,)
"""Token tiles this kernel takes (MmaConfig.block_t below the MMA's 16): one row per program; more rows are
more programs, each reading the weights again."""

if triton is not None:
    from kernels.int4_mma import _finish

    @triton.jit
    def _w4a16_gemv_kernel(
        x_ptr, w_ptr, m_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr,
        M, N, stride_xm, stride_wb, stride_mg, WORDS_PER_SPLIT, K_PER_SPLIT,
        GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EXACT: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """acc[n] += s[g, n] * sum over one K tile (inside group g) of (u(k, n) - zq[g, n]) * x[t, k].

        Grid (N tiles, rows t, K splits). Word (nb, kb, r8, 4 g8 + c) of output n = 16 nb + 8 r8 + g8 holds
        nibble j = p0 + 2 p1 + 4 h of k = 32 kb + 16 p1 + 8 p0 + 2 c + h (kernels.int4_mma's order).
        """
        pid_n, pid_t, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # pid_t: the row
        KB: tl.constexpr = BK // 32
        offs_n = pid_n * BN + tl.arange(0, BN)
        mask_n = offs_n < N
        kb = tl.arange(0, KB)
        c = tl.arange(0, 4)
        n_word = (offs_n // 16) * stride_wb + ((offs_n // 8) % 2) * 32 + (offs_n % 8) * 4
        wp = (w_ptr + pid_k * WORDS_PER_SPLIT + n_word[:, None, None] + (kb * 64)[None, :, None]
              + c[None, None, :])  # [BN, KB, 4]: 4 consecutive words per (n, kb)
        mask_w = mask_n[:, None, None]
        k_start = pid_k * K_PER_SPLIT
        # x at k = 32 kb + 2 c (+ the nibble's offset), [1, KB, 4] as the words' tile
        xp = x_ptr + pid_t * stride_xm + k_start + (kb * 32)[None, :, None] + (c * 2)[None, None, :]
        acc = tl.zeros((BN,), dtype=tl.float32)
        k_end = k_start + K_PER_SPLIT
        words = tl.load(wp, mask=mask_w, other=0)
        for k0 in range(k_start, k_end, BK):
            # the next tile's words are read while this one is computed (two tiles in flight per program); the
            # last step reads its own again (cached) rather than past its split
            ahead = (k0 + BK < k_end).to(tl.int32) * (KB * 64)
            words_next = tl.load(wp + ahead, mask=mask_w, other=0)
            meta = tl.load(m_ptr + (k0 // GROUP) * stride_mg + offs_n, mask=mask_n, other=0)
            part = tl.zeros((BN, KB, 4), dtype=tl.float32)
            xs = tl.zeros((1, KB, 4), dtype=tl.float32)
            for j in tl.static_range(8):
                off = 16 * ((j // 2) % 2) + 8 * (j % 2) + j // 4  # a constant: j is one
                xj = tl.load(xp + off).to(tl.float32)
                if EXACT:  # 2^23 + u exactly; the 2^23 is taken off with the zero point below
                    f = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                else:  # nibble j to mantissa bits 19..22 under the exponent of 1.0: 1 + u/16
                    if 4 * j <= 19:
                        bits = words << (19 - 4 * j)
                    else:
                        bits = words >> (4 * j - 19)  # sign bits land above bit 22: masked off
                    f = ((bits & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)
                part += f * xj
                xs += xj
            dot = tl.sum(tl.sum(part, axis=2), axis=1)  # [BN]
            xsum = tl.sum(xs)
            s = (meta & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            zq = ((meta >> 16) & 0xFF).to(tl.float32)
            if EXACT:
                acc += s * (dot - zq * xsum)
            else:
                acc += s * (16.0 * dot - (16.0 + zq) * xsum)
            words = words_next
            wp += KB * 64
            xp += BK
        _finish(acc[:, None], out_ptr, ws_ptr, cnt_ptr, b_ptr, offs_n, pid_t + tl.arange(0, 1), M, N,
                pid_t * tl.num_programs(0) + pid_n, pid_k, HAS_BIAS, SPLIT_K)


def _split(tiles: int, k: int, bk: int) -> int:
    split = 1  # K split until about SPLIT_K_TARGET programs run, each at least two K tiles long
    while tiles * split * 2 <= SPLIT_K_TARGET and k % (bk * split * 2) == 0 and k // (split * 2) >= 2 * bk:
        split *= 2
    return split


def gemv_variants(m: int, k: int, n: int, group_size: int) -> list[MmaConfig]:
    """Launch shapes the tuner times for m rows (kernels.int4_tune): 64, 128 or 256 outputs per program, 128 k
    (or the group) per step, the K split of the rule and twice it; num_stages plays no part (the kernel reads one
    step ahead by itself)."""
    bk = min(128, group_size)
    out = []
    for bn in (64, 128, 256):
        split = _split(-(-n // bn) * m, k, bk)
        out.append(MmaConfig(bn, 1, bk, split, 4, 1))
        if bn == 128:
            out.append(MmaConfig(bn, 1, bk, split * 2, 4, 1))
    return [c for c in out if c.fits(m, k, n, group_size)]


def gemv_mm(x2: torch.Tensor, packed: torch.Tensor, meta: torch.Tensor, group_size: int, bias: torch.Tensor | None,
            config: MmaConfig) -> torch.Tensor:
    """y = x2 @ W + bias, x2 [M, K]; packed / meta from kernels.int4_mma; config.block_t in GEMV_ROWS."""
    if triton is None:
        raise RuntimeError("int4 backend 'triton_mma' needs the triton package")
    m, k = x2.shape
    n = packed.shape[0] * MMA_N
    c = config
    if x2.dtype not in FLOATS:
        raise TypeError(f"int4_mm: unsupported activation dtype {x2.dtype}")
    if packed.shape[1] * MMA_K != k or meta.shape != (k // group_size, n) or meta.dtype != torch.int32:
        raise ValueError(f"gemv int4: x {tuple(x2.shape)}, packed {tuple(packed.shape)}, meta {tuple(meta.shape)} "
                         f"{meta.dtype} do not fit group {group_size}")
    if c.block_t not in GEMV_ROWS or not c.fits(m, k, n, group_size):
        raise ValueError(f"gemv int4 config {c} does not fit K={k}, N={n}, group {group_size}")
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    grid = (triton.cdiv(n, c.block_n), m, c.split_k)
    if c.split_k > 1 and grid[0] * grid[1] > _MAX_TILES:
        raise ValueError(f"gemv int4: {grid[0] * grid[1]} output tiles exceed the {_MAX_TILES} split-K counters")
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    ws = torch.empty((c.split_k, m, n), dtype=torch.float32, device=x2.device) if c.split_k > 1 else out
    b = bias.contiguous() if bias is not None else out  # dummy pointer when HAS_BIAS is False
    kps = k // c.split_k
    _w4a16_gemv_kernel[grid](
        x2, packed, meta, b, out, ws, _counters(x2.device), m, n, x2.stride(0), packed.stride(0), meta.stride(0),
        kps * 2, kps, GROUP=group_size, HAS_BIAS=bias is not None, SPLIT_K=c.split_k,
        EXACT=x2.dtype == torch.float32, BN=c.block_n, BK=c.block_k, num_warps=c.num_warps,
        num_stages=c.num_stages)
    return out
