"""W4A16 for decode batches: weights repacked at load into MMA-fragment order, computed as y^T = W^T x^T.

    w = repack_mma(qweight)                  # [K/8, N] GPTQ words -> [N/16, K/32, 2, 32] words (below)
    meta = mma_meta(scales, zq)             # [K/G, N] int32: fp16 scale bits | zero point << 16
    y = mma_mm(x, w, meta, group_size, bias) # y = x @ W + bias, W as in kernels.reference

Why this shape (docs/PERFORMANCE.md "int4 GEMM"): the weights are the MMA's A operand ([out features, K], so a
tile's rows are output features and the few tokens are the MMA's N), and their register layout is the A
fragment's. A fragment of 16 rows x 32 k splits into 32 lanes (lane = 4 g + c: row g and g + 8, k = 2c, 2c+1 +
8 i) and 8 registers per lane; the repacked word (nb, kb, r8, lane) holds exactly the 8 nibbles that lane needs
for row 16 nb + 8 r8 + g:

    nibble p0 + 2 p1 + 4 h of word (nb, kb, r8, 4 g + c) = u(n = 16 nb + 8 r8 + g, k = 32 kb + 16 p1 + 8 p0 + 2 c + h)

so unpacking is elementwise shifts and masks followed by joins and one permute that Triton lays out in
registers (no shared-memory stage for the unpacked tile), and a warp reads 32 consecutive words (128 B) per load.
Each pair (h = 0, 1) shares one 32-bit word: (w >> 4p) & 0x000F000F | MAGIC is two 16-bit floats 128 + u
(bf16, MAGIC 0x4300) or 1024 + u (fp16, 0x6400) with no int->float conversion; subtracting 128 + zq (or
1024 + zq) is exact. Scales multiply the fp32 accumulator once per group (K tile <= group); a group's scale and
zero point share one 32-bit word, so that Triton's pipeliner copies them ahead like the weights (it does not
for 1- and 2-byte loads, which would then stall every K step). K is split across
programs for small grids; the partials are summed in split order by the last program of each tile, so the
result is the same bits on every run (as kernels.int4_triton).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.triton_env import FLOATS, interpreting, tl, triton

__all__ = ["MMA_K", "MMA_N", "MmaConfig", "mma_config", "mma_meta", "mma_mm", "repack_mma",
           "unpack_meta", "unpack_mma"]

MMA_N, MMA_K = 16, 32
"""Output features and input features of one repacked block of 64 words."""
_MAX_TILES = 1 << 16
"""Split-K tile counters per device; every launch numbers its tiles from 0 and leaves them at zero, so two
split-K launches must not run at once on one device (the engine uses one stream)."""


# ----------------------------------------------------------------------------------------------------
# the repacked layout (pure torch: load time, and the round-trip test's inverse)

def _check_kn(k: int, n: int) -> None:
    if k % MMA_K or n % MMA_N:
        raise ValueError(f"the mma int4 layout needs K % {MMA_K} == 0 and N % {MMA_N} == 0, got K={k}, N={n}")


def repack_mma(qweight: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """GPTQ qweight [K/8, N] int32 -> [N/16, K/32, 2, 32] int32 in the fragment order above (same device).
    Works on `chunk` output features at a time so the transient int16/int32 tensors stay small."""
    from kernels.reference import unpack_int4_rows

    kw, n = qweight.shape
    k = kw * 8
    _check_kn(k, n)
    out = torch.empty(n // MMA_N, k // MMA_K, 2, 32, dtype=torch.int32, device=qweight.device)
    chunk = max(MMA_N, chunk - chunk % MMA_N)
    for n0 in range(0, n, chunk):
        nc = min(chunk, n - n0)
        u = unpack_int4_rows(qweight[:, n0:n0 + nc]).to(torch.int32)  # [K, nc]
        # k = 32 kb + 16 p1 + 8 p0 + 2 c + h ; n = 16 nb + 8 r8 + g
        u = u.view(k // 32, 2, 2, 4, 2, nc // 16, 2, 8)  # kb, p1, p0, c, h, nb, r8, g
        u = u.permute(5, 0, 6, 7, 3, 4, 1, 2)  # nb, kb, r8, g, c, h, p1, p0: nibble j = 4h + 2p1 + p0
        u = u.reshape(nc // 16, k // 32, 2, 32, 8)
        w = u[..., 0]
        for j in range(1, 8):
            w = w | (u[..., j] << (4 * j))  # int32 shifts wrap: bit 31 set for nibble 7 >= 8
        out[n0 // 16:(n0 + nc) // 16] = w
    return out


def mma_meta(scales: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
    """scales [K/G, N] (fp16, or any float dtype whose values fp16 holds exactly) and zero points zq + zero_offset
    [K/G, N] (0..16) -> int32 [K/G, N] words: the scale's fp16 bits | zero point << 16."""
    s16 = scales.to(torch.float16)
    if scales.dtype != torch.float16 and not torch.equal(s16.to(scales.dtype), scales):
        raise ValueError(f"the mma int4 layout keeps fp16 scales; these {scales.dtype} scales are not fp16 values")
    return ((zq.to(torch.int32) << 16) | (s16.view(torch.int16).to(torch.int32) & 0xFFFF)).contiguous()


def unpack_meta(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of mma_meta: (fp16 scales, int16 zero points)."""
    scales = (meta & 0xFFFF).to(torch.int16).view(torch.float16)
    return scales, (meta >> 16).to(torch.int16)


def unpack_mma(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of repack_mma: [N/16, K/32, 2, 32] int32 -> GPTQ qweight [K/8, N] int32."""
    from kernels.reference import pack_int4_rows

    nb, kb = packed.shape[:2]
    w = packed.to(torch.int64) & 0xFFFFFFFF
    u = (w.unsqueeze(-1) >> torch.arange(0, 32, 4, device=w.device)) & 0xF  # nb, kb, r8, lane, j
    u = u.view(nb, kb, 2, 8, 4, 2, 2, 2)  # nb, kb, r8, g, c, h, p1, p0
    u = u.permute(1, 6, 7, 4, 5, 0, 2, 3).reshape(kb * 32, nb * 16)  # kb, p1, p0, c, h | nb, r8, g
    return pack_int4_rows(u)


# ----------------------------------------------------------------------------------------------------
# kernel

if triton is not None:

    @triton.jit
    def _unpack(words, MAGIC: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """words [BN/16, BK/32, 2, 32] in the repacked order -> [BN, BK] int16 bit patterns MAGIC16 | u."""
        e0 = (words & 0x000F000F) | MAGIC
        e1 = ((words >> 4) & 0x000F000F) | MAGIC
        e2 = ((words >> 8) & 0x000F000F) | MAGIC
        e3 = ((words >> 12) & 0x000F000F) | MAGIC
        # pair p = p0 + 2 p1: the low half is h = 0, the high half h = 1
        l0 = tl.join(e0.to(tl.int16), (e0 >> 16).to(tl.int16))
        l1 = tl.join(e1.to(tl.int16), (e1 >> 16).to(tl.int16))
        l2 = tl.join(e2.to(tl.int16), (e2 >> 16).to(tl.int16))
        l3 = tl.join(e3.to(tl.int16), (e3 >> 16).to(tl.int16))
        u = tl.join(tl.join(l0, l1), tl.join(l2, l3))  # [nb, kb, r8, lane, h, p0, p1]
        u = tl.reshape(u, (BN // 16, BK // 32, 2, 8, 4, 2, 2, 2))  # lane = 4 g + c
        u = tl.permute(u, (0, 2, 3, 1, 7, 6, 4, 5))  # nb, r8, g | kb, p1, p0, c, h
        return tl.reshape(u, (BN, BK))

    @triton.jit
    def _finish(acc, out_ptr, ws_ptr, cnt_ptr, b_ptr, offs_n, offs_t, M, N, tile, pid_k,
                HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
        """out[t, n] = sum over splits of acc[n, t] (+ bias[n]); split partials parked in ws[pid_k] and added in
        split order by the last program of the tile (counted in cnt[tile])."""
        mask_n = offs_n < N
        mask = mask_n[:, None] & (offs_t[None, :] < M)
        idx = offs_t[None, :] * N + offs_n[:, None]
        if SPLIT_K > 1:
            tl.store(ws_ptr + pid_k * M * N + idx, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is written before the counter says so
            done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT_K - 1:
                acc = tl.zeros_like(acc)
                for s in range(SPLIT_K):  # fixed order: the same bits on every run
                    acc += tl.load(ws_ptr + s * M * N + idx, mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
                tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _w4a16_mma_kernel(
        x_ptr, w_ptr, m_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr,
        M, N, stride_xm, stride_wb, stride_mg, WORDS_PER_SPLIT, K_PER_SPLIT,
        GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
        WTYPE: tl.constexpr, F32_DOT: tl.constexpr, FOLD: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr,
        BK: tl.constexpr,
    ):  # fmt: skip
        """y[t, n] = sum_k x[t, k] * s[k//G, n] * (u(k, n) - zq(k//G, n)), as acc[n, t] += W^T tile @ x^T tile.

        Grid (N tiles, token tiles, K splits). meta[g, n]: the fp16 bits of s(g, n) | zq(g, n) << 16.
        WTYPE 0: the weight tile in bf16 (magic 0x4300), 1: fp16 (0x6400), 2: fp32 (from integers).
        F32_DOT: an exact fp32 dot (fp32 activations, and the interpreter, whose bf16 dot is wrong).
        FOLD (16-bit weight tiles): the dot takes the magic-number values m + u as they are (m = 128 or 1024),
        and the zero point comes off the accumulator once per tile: sum_k (m + u) x - (m + zq) sum_k x, which
        saves a 16-bit subtraction per weight (the products are exact in the fp32 accumulate).
        """
        pid_n, pid_t, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_t = pid_t * BT + tl.arange(0, BT)
        mask_n = offs_n < N
        nb = pid_n * (BN // 16) + tl.arange(0, BN // 16)
        # words (nb, kb, r8, lane) of this split: 64 words per 32 k, 2K words per 16 output features
        wp = (w_ptr + nb[:, None, None, None] * stride_wb + pid_k * WORDS_PER_SPLIT
              + (tl.arange(0, BK // 32) * 64)[None, :, None, None] + (tl.arange(0, 2) * 32)[None, None, :, None]
              + tl.arange(0, 32)[None, None, None, :])
        mask_w = (nb < N // 16)[:, None, None, None]
        k_start = pid_k * K_PER_SPLIT
        xp = x_ptr + offs_t[None, :] * stride_xm + (k_start + tl.arange(0, BK))[:, None]
        mask_x = offs_t[None, :] < M
        MAGIC: tl.constexpr = 0x43004300 if WTYPE == 0 else 0x64006400 if WTYPE == 1 else 0
        WDT: tl.constexpr = tl.bfloat16 if WTYPE == 0 else tl.float16 if WTYPE == 1 else tl.float32
        acc = tl.zeros((BN, BT), dtype=tl.float32)
        last_g = (k_start + K_PER_SPLIT) // GROUP - 1
        s_meta = tl.load(m_ptr + (k_start // GROUP) * stride_mg + offs_n, mask=mask_n, other=0)
        for k0 in range(k_start, k_start + K_PER_SPLIT, BK):
            g = k0 // GROUP
            words = tl.load(wp, mask=mask_w, other=0)
            u = _unpack(words, MAGIC, BN, BK)
            if not FOLD:  # the zero points feed the weight tile, so the pipeliner copies this load ahead with it
                meta = tl.load(m_ptr + g * stride_mg + offs_n, mask=mask_n, other=0)
                z16 = (((meta >> 16) & 0xFF) | (MAGIC & 0xFFFF)).to(tl.int16)[:, None]
            # the scales only meet the accumulator, which the pipeliner does not look ahead for: read the next
            # step's one step early by hand (the last step reads its own again)
            g_next = tl.minimum((k0 + BK) // GROUP, last_g)
            s_next = tl.load(m_ptr + g_next * stride_mg + offs_n, mask=mask_n, other=0)
            s_word = s_meta
            s = (s_word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            s_meta = s_next
            xt = tl.load(xp, mask=mask_x, other=0.0)
            if FOLD:  # [BN, BK] of m + u against x, then (m + zq) * sum_k x per (n, t); zq from the scale's word
                if F32_DOT:
                    part = tl.dot(u.to(WDT, bitcast=True).to(tl.float32), xt.to(tl.float32), input_precision="ieee")
                    xsum = tl.sum(xt.to(tl.float32), axis=0)[None, :]
                else:  # sum_k x as a second MMA of ones (a cross-thread sum would cost more than the subtractions)
                    part = tl.dot(u.to(WDT, bitcast=True), xt)
                    xsum = tl.dot(tl.full((BN, BK), 1.0, WDT), xt)
                mz = (((s_word >> 16) & 0xFF) | (MAGIC & 0xFFFF)).to(tl.int16).to(WDT, bitcast=True).to(tl.float32)
                part = part - mz[:, None] * xsum
            elif WTYPE == 2:
                w = u.to(tl.float32) - z16.to(tl.float32)
            elif F32_DOT:  # the interpreter: its 16-bit float arithmetic is wrong, the bit patterns are not
                w = u.to(WDT, bitcast=True).to(tl.float32) - z16.to(WDT, bitcast=True).to(tl.float32)
            else:  # 128 + u minus 128 + zq (bf16), 1024 + u minus 1024 + zq (fp16): exact small integers
                w = u.to(WDT, bitcast=True) - z16.to(WDT, bitcast=True)
            if not FOLD:
                if F32_DOT:
                    part = tl.dot(w, xt.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(w, xt)  # fp32 accumulate
            acc += part * s[:, None]
            wp += (BK // 32) * 64
            xp += BK
        _finish(acc, out_ptr, ws_ptr, cnt_ptr, b_ptr, offs_n, offs_t, M, N,
                pid_t * tl.num_programs(0) + pid_n, pid_k, HAS_BIAS, SPLIT_K)


# ----------------------------------------------------------------------------------------------------
# launch


@dataclass(frozen=True)
class MmaConfig:
    """Launch shape of the mma W4A16 kernel: output features, tokens and K per tile, K splits, warps, stages."""

    block_n: int
    block_t: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    fold: bool = False
    """Zero points off the accumulator instead of each weight (the kernel's FOLD; 16-bit activations only)."""

    def fits(self, m: int, k: int, n: int, group_size: int) -> bool:
        return (self.block_n % MMA_N == 0 and self.block_k % MMA_K == 0 and group_size % self.block_k == 0
                and k % (self.block_k * self.split_k) == 0 and self.block_t >= 1)


SPLIT_K_TARGET = 512
"""Small grids split K until about this many programs run (the weight read is the whole cost; one program per
N tile leaves most of a large GPU idle)."""


def block_t_for(m: int) -> int:
    """Token tile for M rows: a power of two >= 16 (the MMA's smallest useful N here), at most 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


@functools.lru_cache(maxsize=4096)  # called per layer per step
def mma_config(m: int, k: int, n: int, group_size: int) -> MmaConfig:
    """The untuned launch shape (the dispatch's tuner, kernels.int4_tune, may pick another): 64 output features
    and 128 k (or the group) per tile, K split until about SPLIT_K_TARGET programs run."""
    bk = min(128, group_size)
    bt = block_t_for(m)
    return MmaConfig(64, bt, bk, split_for(m, k, n, 64, bt, bk))


def split_for(m: int, k: int, n: int, block_n: int, block_t: int, block_k: int) -> int:
    """K splits (a power of two) until about SPLIT_K_TARGET programs run, each keeping at least two K tiles."""
    tiles = -(-n // block_n) * -(-m // block_t)
    split = 1
    while tiles * split * 2 <= SPLIT_K_TARGET and k % (block_k * split * 2) == 0 and k // (split * 2) >= 2 * block_k:
        split *= 2
    return split


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    # Allocated on the first (eager) call, before any graph capture; kernels leave it all zero.
    return torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)


_WTYPE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def mma_mm(x2: torch.Tensor, packed: torch.Tensor, meta: torch.Tensor, group_size: int, bias: torch.Tensor | None,
           config: MmaConfig | None = None) -> torch.Tensor:
    """y = x2 @ W + bias, x2 [M, K]; packed from repack_mma, meta from mma_meta ([K/G, N] int32)."""
    if triton is None:
        raise RuntimeError("int4 backend 'triton_mma' needs the triton package")
    m, k = x2.shape
    n = packed.shape[0] * MMA_N
    if x2.dtype not in FLOATS:
        raise TypeError(f"int4_mm: unsupported activation dtype {x2.dtype}")
    if packed.shape[1] * MMA_K != k or meta.shape != (k // group_size, n) or meta.dtype != torch.int32:
        raise ValueError(f"mma int4: x {tuple(x2.shape)}, packed {tuple(packed.shape)}, meta {tuple(meta.shape)} "
                         f"{meta.dtype} do not fit group {group_size}")
    c = config or mma_config(m, k, n, group_size)
    if not c.fits(m, k, n, group_size):
        raise ValueError(f"mma int4 config {c} does not fit K={k}, N={n}, group {group_size}")
    if c.fold and x2.dtype == torch.float32:
        raise ValueError("mma int4: fold (zero points off the accumulator) is for 16-bit activations, not float32")
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    grid = (triton.cdiv(n, c.block_n), triton.cdiv(m, c.block_t), c.split_k)
    if c.split_k > 1 and grid[0] * grid[1] > _MAX_TILES:
        raise ValueError(f"mma int4: {grid[0] * grid[1]} output tiles exceed the {_MAX_TILES} split-K counters")
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    ws = torch.empty((c.split_k, m, n), dtype=torch.float32, device=x2.device) if c.split_k > 1 else out
    b = bias.contiguous() if bias is not None else out  # dummy pointer when HAS_BIAS is False
    kps = k // c.split_k
    _w4a16_mma_kernel[grid](
        x2, packed, meta, b, out, ws, _counters(x2.device), m, n, x2.stride(0), packed.stride(0), meta.stride(0),
        kps * 2, kps, GROUP=group_size, HAS_BIAS=bias is not None, SPLIT_K=c.split_k,
        WTYPE=_WTYPE[x2.dtype], F32_DOT=x2.dtype == torch.float32 or interpreting(),
        FOLD=c.fold, BN=c.block_n, BT=c.block_t,
        BK=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
    return out
