"""Batched multi-LoRA shrink / expand in Triton (CUDA through `triton`, Intel GPUs through triton-xpu,
the CPU under TRITON_INTERPRET=1). Same semantics as kernels.reference.lora_shrink / lora_expand.

The launchers read the step's tokens grouped by adapter slot (`TokenGroups`, built once per step by
engine.lora.punica from the host slot list, rewritten in place for graph replay) and each layer's true
ranks as an int32 device tensor [n_slices, S]; a wrapped layer runs two launches whatever its number of
slices: add_lora = lora_shrink (K-split partials) + lora_expand: y[:, off_s:off_s+n_s] (+)= ...

Layouts: A_s [S, r_max, K] rank-major (K contiguous). B_s [S, n_s, r_max] either r-contiguous or, ~2x
faster for small ranks (measured on an H200), a transposed view of rank-major storage [S, r_max, n_s]:
then a rank-r adapter reads r whole rows and never touches its padding.

Work is scheduled in M-blocks of tokens that share one slot (tokens sorted by slot, each slot's run cut
into blocks of BLOCK_M rows); slot -1 tokens belong to no block. Each program reads its slot's true rank
from a device tensor and computes only rank columns below it (shrink: rank chunks at or past the rank
exit; expand: the reduction loops over rank in BLOCK_R chunks up to the rank). The shrink splits K into
a fixed number of ranges whose fp32 partials the expand sums in a fixed order; every element is written
by exactly one program (no atomics): results are deterministic. Grids are sized from upper bounds
(tokens, slots, r_max, output widths), so no launch needs a host sync and all of them can be captured in
a graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.lora_checks import b_rank_major, check_expand, check_ranks, check_shrink
from kernels.triton_env import interpreting, tl, triton

__all__ = ["TokenGroups", "add_lora", "lora_expand", "lora_shrink", "max_blocks"]

_BLOCK_R = 16  # rank chunk: tl.dot needs every dim >= 16; ranks below 16 run one masked chunk


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("the 'triton' LoRA backend needs the triton package (triton-xpu on Intel GPUs)")


# ----------------------------------------------------------------------------------------------------
# what the kernels read: the step's tokens grouped by slot (built by engine.lora.punica)


@dataclass
class TokenGroups:
    """The step's tokens grouped by adapter slot, on the device, in one int32 tensor `meta`.

    meta = [token_slots T | sorted_tokens T | slot_start S | slot_len S | block_slot NB | block_start NB |
    block_end NB]: tokens stable-sorted by slot (slot -1 last), each slot's run cut into M-blocks of
    block_m rows; block_slot == num_slots marks an unused block of the upper-bound grid. Its address
    survives in-place rewrites, so a captured graph that reads it stays valid from step to step.
    """

    meta: torch.Tensor
    num_tokens: int
    num_slots: int
    num_blocks: int
    block_m: int
    has_lora: bool | None
    """False: no token has an adapter (nothing to launch). None: unknown without a host sync."""

    def part(self, i: int) -> torch.Tensor:
        """The i-th array of meta (0: token_slots ... 6: block_end)."""
        t, s, nb = self.num_tokens, self.num_slots, self.num_blocks
        bounds = [0, t, 2 * t, 2 * t + s, 2 * t + 2 * s, 2 * t + 2 * s + nb, 2 * t + 2 * s + 2 * nb,
                  2 * t + 2 * s + 3 * nb]
        return self.meta[bounds[i]:bounds[i + 1]]


def max_blocks(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Upper bound of sum_s cdiv(len_s, block_m) over slots with sum_s len_s <= num_tokens (grid size)."""
    if num_tokens == 0:
        return 0
    return (num_tokens + block_m - 1) // block_m + min(num_slots, num_tokens)


_table_cache: dict[tuple, torch.Tensor] = {}
"""Pointer tables, never evicted: captured graphs read them by address, so freeing one (an LRU over 1024
entries did, at 27B scale: 352 wrapped layers x 3 launch shapes) would leave a graph reading freed memory.
Their number is bounded by wrapped layers x launch shapes."""


# ----------------------------------------------------------------------------------------------------
# kernels

if triton is not None:

    @triton.jit
    def _e4m3_as_f16(u8):
        """fp8 e4m3fn bytes -> float16 holding value * 2^-8, exactly (normals and subnormals alike): the
        4 exponent and 3 mantissa bits moved into float16's fields, the bias difference (15 - 7) left to
        the caller's scale. Bit operations only: the same on every backend and in the interpreter."""
        u = u8.to(tl.uint16)
        return (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.float16, bitcast=True)

    @triton.jit
    def _lora_shrink_kernel(
        x_ptr, a_table_ptr, a0_ptr, buf_ptr, ranks_ptr, meta_ptr,
        sorted_off, blocks_off, num_blocks, chunk,
        K, K_PER_SPLIT, R_MAX, num_slots,
        stride_xm, stride_xk, stride_a0, stride_a1, stride_s0, stride_s1,
        stride_bk, stride_bs, stride_bm, stride_rs, stride_rt,
        NUM_RB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, ALIGNED: tl.constexpr, FP32_DOT: tl.constexpr, FP8: tl.constexpr,
    ):  # fmt: skip
        """buf[ks, s, t, r] = sum_{k in split ks} x[t, k] * A_s[slot[t], r, k] * (fp8: scale_s[slot[t], r]);
        slot[t] >= 0, r < rank[s, slot[t]]."""
        pid_b = tl.program_id(0)
        pid_sr = tl.program_id(1)
        pid_k = tl.program_id(2)
        s = pid_sr // NUM_RB
        r0 = (pid_sr % NUM_RB) * BLOCK_R
        slot = tl.load(meta_ptr + blocks_off + pid_b)
        if slot >= num_slots:  # an unused block of the upper-bound grid
            return
        rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot * stride_rt), R_MAX)
        if r0 >= rank:  # no work on rank padding
            return
        # This program's tokens: a run of one slot's tokens (up to `chunk`), in BLOCK_M tiles; the slot's A
        # tile comes from DRAM once and from the cache for the following tiles.
        m_lo = tl.load(meta_ptr + blocks_off + num_blocks + pid_b)
        m_hi = tl.minimum(tl.load(meta_ptr + blocks_off + 2 * num_blocks + pid_b), m_lo + chunk)
        a_ptr = tl.load(a_table_ptr + 2 * s).to(tl.pointer_type(a0_ptr.dtype.element_ty))
        if ALIGNED:  # the host checked: 16-byte aligned bases (lets the loads vectorise)
            a_ptr = tl.multiple_of(a_ptr, 16)
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        k_lo = pid_k * K_PER_SPLIT  # K_PER_SPLIT is a multiple of BLOCK_K
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        if FP8:  # per rank row; 256 undoes _e4m3_as_f16's 2^-8
            sc_ptr = tl.load(a_table_ptr + 2 * s + 1).to(tl.pointer_type(tl.float32))
            scale = tl.load(sc_ptr + slot.to(tl.int64) * stride_s0 + offs_r * stride_s1, mask=mask_r, other=0.0) * 256.0
        for m0 in range(m_lo, m_hi, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            mask_m = rows < m_hi
            tok = tl.load(meta_ptr + sorted_off + rows, mask=mask_m, other=0).to(tl.int64)
            offs_k = k_lo + tl.arange(0, BLOCK_K)
            x_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :] * stride_xk
            a_ptrs = a_ptr + slot.to(tl.int64) * stride_a0 + offs_r[None, :] * stride_a1 + offs_k[:, None]  # [BK, BR]
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                if EVEN_K:
                    xt = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
                    at = tl.load(a_ptrs, mask=mask_r[None, :], other=0)
                else:
                    mask_k = (k0 - k_lo + offs_k) < K
                    xt = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                    at = tl.load(a_ptrs, mask=mask_r[None, :] & mask_k[:, None], other=0)
                if FP8:
                    at = _e4m3_as_f16(at)
                if FP32_DOT:
                    acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(xt, at.to(xt.dtype))  # 16-bit inputs, fp32 accumulate
                x_ptrs += BLOCK_K * stride_xk
                a_ptrs += BLOCK_K
            if FP8:
                acc = acc * scale[None, :]
            out = buf_ptr + pid_k * stride_bk + s * stride_bs + tok[:, None] * stride_bm + offs_r[None, :]
            tl.store(out, acc, mask=mask_m[:, None] & mask_r[None, :])

    @triton.jit
    def _lora_expand_kernel(
        y_ptr, buf_ptr, b_table_ptr, b0_ptr, ranks_ptr, meta_ptr,
        sorted_off, blocks_off, num_blocks, chunk,
        R_MAX, num_slots,
        stride_ym, stride_yn, stride_bk, stride_bs, stride_bm, stride_bn, stride_rs, stride_rt,
        NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, ADD_INPUTS: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, N_ITERS: tl.constexpr, BLOCK_R: tl.constexpr, B_RANK_MAJOR: tl.constexpr,
        ALIGNED: tl.constexpr, FP32_DOT: tl.constexpr, FP8: tl.constexpr,
    ):  # fmt: skip
        """y[t, off_s + n] (+)= sum_{r < rank[s, slot[t]]} sum_ks buf[ks, s, t, r] * B_s[slot[t], n, r]
        * (fp8: scale_s[slot[t], n]); slot[t] >= 0."""
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        slot = tl.load(meta_ptr + blocks_off + pid_b)
        if slot >= num_slots:
            return
        # Which slice owns this column group: table row s = (ptr, stride0, n_s, offset_s, first group of s,
        # rank stride of s when B is stored rank-major, fp8 scale ptr, its slot stride).
        s = 0
        for i in tl.static_range(1, NUM_SLICES):
            s += (pid_n >= tl.load(b_table_ptr + i * 8 + 4)).to(tl.int32)
        tab = b_table_ptr + s * 8
        rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot * stride_rt), R_MAX)
        if ADD_INPUTS and rank == 0:  # adds nothing (a replace still writes its zeros)
            return
        b_ptr = tl.load(tab).to(tl.pointer_type(b0_ptr.dtype.element_ty))
        stride_b0 = tl.load(tab + 1)
        n_s = tl.load(tab + 2).to(tl.int32)
        y_off = tl.load(tab + 3).to(tl.int32)
        if B_RANK_MAJOR:  # B_s[slot] stored [r_max, n_s] (n contiguous): rank rows are read whole, padding never
            stride_r = tl.load(tab + 5)
        else:  # [n_s, r_max] (r contiguous)
            stride_r = 1
        if ALIGNED:  # the host checked: 16-byte aligned bases, sizes, offsets and strides multiples of 8
            b_ptr = tl.multiple_of(b_ptr, 16)
            stride_b0 = tl.multiple_of(stride_b0, 8)
            n_s = tl.multiple_of(n_s, 8)
            y_off = tl.multiple_of(y_off, 8)
            if B_RANK_MAJOR:
                stride_r = tl.multiple_of(stride_r, 8)
        n_first = (pid_n - tl.load(tab + 4).to(tl.int32)) * (BLOCK_N * N_ITERS)
        if FP8:
            sc_ptr = tl.load(tab + 6).to(tl.pointer_type(tl.float32)) + slot.to(tl.int64) * tl.load(tab + 7)
        m_lo = tl.load(meta_ptr + blocks_off + num_blocks + pid_b)
        m_hi = tl.minimum(tl.load(meta_ptr + blocks_off + 2 * num_blocks + pid_b), m_lo + chunk)
        offs_r = tl.arange(0, BLOCK_R)
        b_slot = b_ptr + slot.to(tl.int64) * stride_b0 + offs_r[:, None] * stride_r  # [BR, 1]
        for m0 in range(m_lo, m_hi, BLOCK_M):  # the run's tokens in tiles; B tiles come from the cache after the first
            rows = m0 + tl.arange(0, BLOCK_M)
            mask_m = rows < m_hi
            tok = tl.load(meta_ptr + sorted_off + rows, mask=mask_m, other=0).to(tl.int64)
            buf_rows = buf_ptr + s * stride_bs + tok[:, None] * stride_bm + offs_r[None, :]  # [BM, BR]
            y_rows = y_ptr + tok[:, None] * stride_ym
            for j in range(N_ITERS):  # several column blocks per program: the slot/token lookups are paid once
                offs_n = n_first + j * BLOCK_N + tl.arange(0, BLOCK_N)
                mask_n = offs_n < n_s
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for r0 in range(0, rank, BLOCK_R):  # only the slot's true rank
                    mask_r = (r0 + offs_r) < rank
                    bt = tl.load(buf_rows + r0, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
                    for kk in tl.static_range(1, SPLIT_K):  # the shrink's K splits, summed in a fixed order
                        bt += tl.load(buf_rows + kk * stride_bk + r0, mask=mask_m[:, None] & mask_r[None, :],
                                      other=0.0)
                    wt = tl.load(b_slot + r0 * stride_r + offs_n[None, :] * stride_bn,
                                 mask=mask_r[:, None] & mask_n[None, :], other=0)  # [BR, BN]
                    if FP8:
                        wt = _e4m3_as_f16(wt)
                    if FP32_DOT:
                        acc += tl.dot(bt, wt.to(tl.float32), input_precision="ieee")
                    elif FP8:
                        acc += tl.dot(bt.to(y_ptr.dtype.element_ty), wt.to(y_ptr.dtype.element_ty))
                    else:
                        acc += tl.dot(bt.to(wt.dtype), wt)  # shrink result rounded to B's 16-bit dtype, fp32 accumulate
                if FP8:  # per output row of B; 256 undoes _e4m3_as_f16's 2^-8
                    acc = acc * (tl.load(sc_ptr + offs_n, mask=mask_n, other=0.0) * 256.0)[None, :]
                y_ptrs = y_rows + (y_off + offs_n)[None, :] * stride_yn
                mask = mask_m[:, None] & mask_n[None, :]
                out = acc.to(y_ptr.dtype.element_ty)
                if ADD_INPUTS:  # like torch's y += out.to(y.dtype): add in fp32, round once
                    out = (tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32) + out.to(tl.float32)).to(out.dtype)
                tl.store(y_ptrs, out, mask=mask)


# ----------------------------------------------------------------------------------------------------
# launch configuration (sizes chosen by measurement on an H200; `CONFIG_OVERRIDES` is for tuning runs)

CONFIG_OVERRIDES: dict[str, int] = {}
"""Force a launch parameter: shrink_block_k, shrink_split_k, shrink_block_r, shrink_warps, shrink_stages,
expand_block_n, expand_n_iters, expand_warps, expand_stages, block_m (the token tile; the schedule's runs of
one slot's tokens are TokenGroups.block_m long) (tuning scripts only; empty in normal use)."""


def _block_r(r_max: int) -> int:
    # One rank chunk covers every rank up to 64 (masked past the slot's true rank: no padding is read); tl.dot
    # needs every dim >= 16.
    return CONFIG_OVERRIDES.get("shrink_block_r", min(64, max(_BLOCK_R, triton.next_power_of_2(r_max))))


def _block_m(info: TokenGroups) -> int:
    return min(CONFIG_OVERRIDES.get("block_m", 16), info.block_m)


def _shrink_config(k: int, r_max: int = _BLOCK_R) -> dict[str, int]:
    # Split K so that each program runs ~4-6 K steps (an H200 sweep: 4096 -> 8 splits, 12288 -> 16), deterministic
    # because the expand sums the splits' partials in a fixed order.
    block_k = CONFIG_OVERRIDES.get("shrink_block_k", 128 if k >= 128 else 16)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    iters = triton.cdiv(k, block_k)
    split = CONFIG_OVERRIDES.get("shrink_split_k", max(1, min(16, iters // 4)))
    split = max(1, min(split, iters))
    return dict(block_k=block_k, split_k=split, k_per_split=triton.cdiv(iters, split) * block_k,
                block_r=_block_r(r_max),
                num_warps=CONFIG_OVERRIDES.get("shrink_warps", 4), num_stages=CONFIG_OVERRIDES.get("shrink_stages", 3))


def _expand_config(n_max: int, num_tokens: int) -> dict[str, int]:
    block_n = CONFIG_OVERRIDES.get("expand_block_n", 256 if n_max >= 256 else 64 if n_max >= 64 else 16)
    n_iters = CONFIG_OVERRIDES.get("expand_n_iters", 1 if num_tokens <= 256 else 2)
    return dict(block_n=block_n, n_iters=n_iters,
                num_warps=CONFIG_OVERRIDES.get("expand_warps", 4), num_stages=CONFIG_OVERRIDES.get("expand_stages", 2))


# ----------------------------------------------------------------------------------------------------
# bindings


def _ptr_table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """int64 [len(rows) * len(rows[0])] on device, cached by its contents (pointers, strides, offsets)."""
    key = (tuple(map(tuple, rows)), str(device))
    hit = _table_cache.get(key)
    if hit is None:
        hit = _table_cache[key] = torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1)
    return hit


def _nothing_to_do(info: TokenGroups) -> bool:
    return info.has_lora is False or info.num_blocks == 0


def _meta_offsets(info: TokenGroups) -> tuple[int, int, int]:
    """(sorted_tokens offset, block arrays offset, num_blocks) inside info.meta."""
    t, s = info.num_tokens, info.num_slots
    return t, 2 * t + 2 * s, info.num_blocks


def _raw(w: torch.Tensor) -> torch.Tensor:
    """What the kernels read: fp8 e4m3 as its bytes (decoded in the kernel), anything else as it is."""
    return w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w


def _launch_shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], info: TokenGroups, r: torch.Tensor,
                   buf: torch.Tensor, cfg: dict[str, int], a_scales: Sequence[torch.Tensor] | None) -> None:
    """buf [split_k, n_slices, T, r_max] float32 (last dim contiguous) <- per-split partial shrink results."""
    fp8 = lora_a[0].dtype == torch.float8_e4m3fn
    a0 = _raw(lora_a[0])
    num_slots, r_max, k = a0.shape
    scales = a_scales if a_scales is not None else lora_a
    table = _ptr_table([[a.data_ptr(), sc.data_ptr()] for a, sc in zip(lora_a, scales)], x.device)
    num_rb = triton.cdiv(r_max, cfg["block_r"])
    sorted_off, blocks_off, nb = _meta_offsets(info)
    grid = (nb, len(lora_a) * num_rb, cfg["split_k"])
    s0 = scales[0]
    _lora_shrink_kernel[grid](
        x, table, a0, buf, r, info.meta,
        sorted_off, blocks_off, nb, info.block_m,
        k, cfg["k_per_split"], r_max, num_slots,
        x.stride(0), x.stride(1), a0.stride(0), a0.stride(1), s0.stride(0), s0.stride(1),
        buf.stride(0), buf.stride(1), buf.stride(2), r.stride(0), r.stride(1),
        NUM_RB=num_rb, BLOCK_M=_block_m(info), BLOCK_R=cfg["block_r"], BLOCK_K=cfg["block_k"],
        EVEN_K=k % cfg["block_k"] == 0, ALIGNED=all(a.data_ptr() % 16 == 0 for a in lora_a),
        FP32_DOT=interpreting() or x.dtype == torch.float32 or (not fp8 and x.dtype != a0.dtype), FP8=fp8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def lora_shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], info: TokenGroups,
                ranks: torch.Tensor, out: torch.Tensor | None = None,
                a_scales: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """buf[s, t, :r] = x[t] @ A_s[slot[t], :r].T, r = ranks[s][slot[t]]; one launch for all slices.

    x [T, K]; lora_a[s] [S, r_max, K] (same shape for every slice, last dim contiguous; fp8 e4m3 with
    a_scales[s] [S, r_max] float32, one scale per rank row) -> float32 [n_slices, T, r_max]. Entries not
    computed (slot -1 rows, columns past a slot's rank) are zero, as in the reference. (add_lora skips this
    function's zero fill and K-split sum: its expand reads the per-split partials directly.)
    """
    _require_triton()
    check_shrink(x, lora_a, info, a_scales)
    n_slices, (_, r_max, k) = len(lora_a), lora_a[0].shape
    r = check_ranks(ranks, n_slices, info.num_slots, x.device)
    if out is None:
        out = torch.zeros(n_slices, x.size(0), r_max, dtype=torch.float32, device=x.device)
    elif out.shape != (n_slices, x.size(0), r_max) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"lora_shrink: out must be float32 {(n_slices, x.size(0), r_max)}, got {tuple(out.shape)}")
    else:
        out.zero_()
    if _nothing_to_do(info) or r_max == 0:
        return out
    cfg = _shrink_config(k, r_max)
    if cfg["split_k"] == 1:
        _launch_shrink(x, lora_a, info, r, out.unsqueeze(0), cfg, a_scales)
    else:
        parts = torch.zeros(cfg["split_k"], *out.shape, dtype=torch.float32, device=x.device)
        _launch_shrink(x, lora_a, info, r, parts, cfg, a_scales)
        torch.sum(parts, dim=0, out=out)  # fixed-order reduction: deterministic
    return out


def _launch_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: Sequence[torch.Tensor], info: TokenGroups,
                   offsets: Sequence[int], r: torch.Tensor, add_inputs: bool,
                   b_scales: Sequence[torch.Tensor] | None) -> None:
    """buf [split_k, n_slices, T, r_max] float32, summed over split_k in order inside the kernel."""
    fp8 = lora_b[0].dtype == torch.float8_e4m3fn
    raw = [_raw(b) for b in lora_b]
    b0 = raw[0]
    rank_major = b_rank_major(raw)
    cfg = _expand_config(max(b.size(1) for b in raw), y.size(0))
    block_n, n_iters = cfg["block_n"], cfg["n_iters"]
    rows, first, aligned = [], 0, True
    scales = b_scales if b_scales is not None else lora_b
    for b, off, sc in zip(raw, offsets, scales):
        rows.append([b.data_ptr(), b.stride(0), b.size(1), int(off), first, b.stride(2), sc.data_ptr(), sc.stride(0)])
        first += triton.cdiv(b.size(1), block_n * n_iters)
        aligned = (aligned and b.data_ptr() % 16 == 0 and b.stride(0) % 8 == 0 and b.size(1) % 8 == 0
                   and off % 8 == 0 and b.stride(2 if rank_major else 1) % 8 == 0)
    table = _ptr_table(rows, y.device)
    sorted_off, blocks_off, nb = _meta_offsets(info)
    _lora_expand_kernel[(nb, first)](
        y, buf, table, b0, r, info.meta,
        sorted_off, blocks_off, nb, info.block_m,
        b0.size(-1), b0.size(0),
        y.stride(0), y.stride(1), buf.stride(0), buf.stride(1), buf.stride(2), b0.stride(1), r.stride(0), r.stride(1),
        NUM_SLICES=len(lora_b), SPLIT_K=buf.size(0), ADD_INPUTS=bool(add_inputs), BLOCK_M=_block_m(info),
        BLOCK_N=block_n, N_ITERS=n_iters, BLOCK_R=_block_r(b0.size(-1)), B_RANK_MAJOR=rank_major, ALIGNED=aligned,
        FP32_DOT=interpreting() or b0.dtype == torch.float32 or (fp8 and y.dtype == torch.float32), FP8=fp8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def lora_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: Sequence[torch.Tensor], info: TokenGroups,
                offsets: Sequence[int], ranks: torch.Tensor, add_inputs: bool = True,
                b_scales: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """y[t, off_s:off_s+n_s] (+)= buf[s, t, :r] @ B_s[slot[t], :, :r].T for slot[t] >= 0; one launch.

    y [T, N]; buf float32 [n_slices, T, r_max] with r_max = B.size(-1) exactly; lora_b[s] [S, n_s, r_max]
    (n_s may differ per slice), either r-contiguous or, faster, a transposed view of rank-major storage
    [S, r_max, n_s] (rank rows are then read whole and a small rank's padding is never fetched); fp8 e4m3
    with b_scales[s] [S, n_s] float32, one scale per output row. Rows with slot -1 are untouched. Returns y.
    """
    _require_triton()
    check_expand(y, buf, lora_b, info, offsets, b_scales)
    r = check_ranks(ranks, len(lora_b), info.num_slots, y.device)
    if not _nothing_to_do(info):
        _launch_expand(y, buf.unsqueeze(0), lora_b, info, offsets, r, add_inputs, b_scales)
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
             info: TokenGroups, offsets: Sequence[int], ranks: torch.Tensor, add_inputs: bool = True,
             a_scales: Sequence[torch.Tensor] | None = None,
             b_scales: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """y[:, off_s:off_s+n_s] (+)= (x @ A_s[slot].T)[:, :r] @ B_s[slot][:, :r].T per slice: two launches in all,
    none when info.has_lora is False. fp8 A and B take their scales (see lora_shrink / lora_expand).
    Returns y (in place)."""
    _require_triton()
    if len(lora_a) != len(lora_b):
        raise ValueError("add_lora: one A and one B per slice")
    if _nothing_to_do(info):
        return y
    check_shrink(x, lora_a, info, a_scales)
    n_slices, (_, r_max, k) = len(lora_a), lora_a[0].shape
    if lora_b[0].size(-1) != r_max:
        raise ValueError(f"add_lora: A rank dim {r_max} != B rank dim {lora_b[0].size(-1)}")
    buf_shape = (n_slices, x.size(0), r_max)
    cfg = _shrink_config(k, r_max)
    # Per-split partials, summed in order by the expand; it reads only computed entries (active rows,
    # columns below the rank), so no zero fill.
    buf = torch.empty(cfg["split_k"], *buf_shape, dtype=torch.float32, device=x.device)
    check_expand(y, buf[0], lora_b, info, offsets, b_scales)
    r = check_ranks(ranks, n_slices, info.num_slots, x.device)
    _launch_shrink(x, lora_a, info, r, buf, cfg, a_scales)
    _launch_expand(y, buf, lora_b, info, offsets, r, add_inputs, b_scales)
    return y
