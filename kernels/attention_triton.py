"""Paged attention in Triton (CUDA through `triton`, Intel GPUs through triton-xpu, the CPU under
TRITON_INTERPRET=1); same semantics as kernels.attention.paged_attention_ref.

Cache layout per layer: k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]; block_tables
[B, max_blocks] int32; context_lens [B] int32 (tokens in the cache after this step's writes); cu_q [B+1]
int32 (sequence s owns query rows cu_q[s]:cu_q[s+1], its LAST tokens).

- decode (every sequence has at most one query): one program per (sequence, kv head, split) handles all
  q heads of that kv head (GQA), reading each K/V tile once; the keys of a sequence are cut into
  `num_splits` contiguous ranges (flash-decoding) whose partial results are merged in a fixed order by a
  second kernel: deterministic, no atomics. Grid from B, kv heads and num_splits only: no host sync.
- prefill (any query lengths, varlen through cu_q): one program per (query block, sequence, q head),
  causal over the paged cache: query i of n sees keys 0..c-n+i.
- mixed (prompt chunks and decodes in one step): the decode kernel for the one-query sequences, the prefill
  kernel for the others, each skipping the other's sequences on the device (still graph-capturable).
Softmax in fp32 (online, base 2); P is rounded to V's dtype for the P @ V product on 16-bit caches.
"""

from __future__ import annotations

import torch

from kernels.triton_env import FLOATS, interpreting, tl, triton

__all__ = ["decode_num_splits", "paged_attention_decode", "paged_attention_mixed", "paged_attention_prefill"]

_LOG2E = 1.4426950408889634


if triton is not None:

    @triton.jit
    def _not_mine(n, SINGLE_ONLY: tl.constexpr):
        """Whether the decode kernels skip a sequence of n queries: none, or (SINGLE_ONLY) not exactly one."""
        if SINGLE_ONLY:
            return n != 1
        return n == 0

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, cu_q_ptr, ctx_ptr, out_ptr, po_ptr, pml_ptr,
        scale_log2,
        stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_bt, stride_ot, stride_oh, stride_pos, stride_poh, stride_pol, stride_pmls, stride_pmlh,
        GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, FP32_DOT: tl.constexpr,
        SINGLE_ONLY: tl.constexpr,
    ):  # fmt: skip
        """o[cu_q[b], h] = softmax_j(scale * q[cu_q[b], h] . K[b, j, h // GROUP]) V[b, j, h // GROUP], j < ctx[b],
        over this split's key range (NUM_SPLITS > 1: unnormalised o, running max m and sum l to the partials);
        SINGLE_ONLY: only sequences with exactly one query (a mixed step's decodes; the prefill kernel the rest)."""
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        q_row = tl.load(cu_q_ptr + seq)
        if _not_mine(tl.load(cu_q_ptr + seq + 1) - q_row, SINGLE_ONLY):
            return
        ctx = tl.load(ctx_ptr + seq)
        tiles = tl.cdiv(ctx, BLOCK_N)
        per = tl.cdiv(tiles, NUM_SPLITS)
        j_lo = split * per * BLOCK_N
        j_hi = tl.minimum(j_lo + per * BLOCK_N, ctx)

        offs_g = tl.arange(0, G_PAD)
        mask_g = offs_g < GROUP
        heads = kvh * GROUP + offs_g
        offs_d = tl.arange(0, D_PAD)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0)
        if FP32_DOT:
            q = q.to(tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D_PAD), tl.float32)
        for j in range(j_lo, j_hi, BLOCK_N):
            pos = j + offs_n
            mask_n = pos < j_hi
            blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
            k_off = blk * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kvh * stride_kh
            v_off = blk * stride_vb + (pos % BLOCK_SIZE) * stride_vt + kvh * stride_vh
            k = tl.load(k_ptr + k_off[None, :] + offs_d[:, None], mask=mask_d[:, None] & mask_n[None, :], other=0.0)
            v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            if FP32_DOT:
                s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, k)
            s = tl.where(mask_n[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds >= 1 key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if FP32_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
        else:
            po = po_ptr + seq.to(tl.int64) * stride_pos + split * stride_pol
            tl.store(po + heads[:, None] * stride_poh + offs_d[None, :], acc, mask=mask_g[:, None] & mask_d[None, :])
            pml = pml_ptr + seq.to(tl.int64) * stride_pmls + heads * stride_pmlh + split * 2
            tl.store(pml, m_i, mask=mask_g)
            tl.store(pml + 1, l_i, mask=mask_g)

    @triton.jit
    def _paged_decode_merge_kernel(
        cu_q_ptr, out_ptr, po_ptr, pml_ptr,
        stride_ot, stride_oh, stride_pos, stride_poh, stride_pol, stride_pmls, stride_pmlh,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
        SINGLE_ONLY: tl.constexpr,
    ):  # fmt: skip
        """o[cu_q[b], h] = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s,  M = max_s m_s (fixed order)."""
        seq = tl.program_id(0)
        h = tl.program_id(1)
        q_row = tl.load(cu_q_ptr + seq)
        if _not_mine(tl.load(cu_q_ptr + seq + 1) - q_row, SINGLE_ONLY):
            return
        offs_s = tl.arange(0, SPLITS_PAD)
        mask_s = offs_s < NUM_SPLITS
        offs_d = tl.arange(0, D_PAD)
        mask_d = offs_d < HEAD_DIM
        pml = pml_ptr + seq.to(tl.int64) * stride_pmls + h * stride_pmlh + offs_s * 2
        m = tl.load(pml, mask=mask_s, other=float("-inf"))
        l_s = tl.load(pml + 1, mask=mask_s, other=0.0)
        m_max = tl.max(m, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no key at all (ctx 0): all weights 0
        w = tl.exp2(m - m_max)
        po = po_ptr + seq.to(tl.int64) * stride_pos + h * stride_poh + offs_s[:, None] * stride_pol + offs_d[None, :]
        o = tl.sum(tl.load(po, mask=mask_s[:, None] & mask_d[None, :], other=0.0) * w[:, None], 0)
        den = tl.sum(l_s * w, 0)
        o = o / tl.where(den == 0.0, 1.0, den)
        tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
                 mask=mask_d)

    @triton.jit
    def _paged_prefill_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, cu_q_ptr, ctx_ptr, out_ptr,
        scale_log2,
        stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_bt, stride_ot, stride_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr, SKIP_SINGLE: tl.constexpr,
    ):  # fmt: skip
        """o[cu_q[b] + i, h] = softmax_{j <= c-n+i}(scale * q[cu_q[b] + i, h] . K[b, j, h // GROUP]) V[b, j, h // GROUP]
        (n = cu_q[b+1] - cu_q[b], c = ctx[b]); SKIP_SINGLE: not for sequences with n == 1 (the decode kernel's)."""
        pid_m = tl.program_id(0)
        seq = tl.program_id(1)
        h = tl.program_id(2)
        q_start = tl.load(cu_q_ptr + seq)
        n = tl.load(cu_q_ptr + seq + 1) - q_start
        m0 = pid_m * BLOCK_M
        skip = m0 >= n  # the grid is sized by the longest query run
        if SKIP_SINGLE:
            skip = skip | (n == 1)
        if skip:
            return
        ctx = tl.load(ctx_ptr + seq)
        kvh = h // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < n
        q_pos = ctx - n + offs_m  # absolute position of each query
        offs_d = tl.arange(0, D_PAD)
        mask_d = offs_d < HEAD_DIM
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        if FP32_DOT:
            q = q.to(tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)
        j_hi = tl.minimum(ctx, ctx - n + m0 + BLOCK_M)  # keys past the block's last query are never seen
        for j in range(0, j_hi, BLOCK_N):
            pos = j + offs_n
            mask_n = pos < j_hi
            blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
            k_off = blk * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kvh * stride_kh
            v_off = blk * stride_vb + (pos % BLOCK_SIZE) * stride_vt + kvh * stride_vh
            k = tl.load(k_ptr + k_off[None, :] + offs_d[:, None], mask=mask_d[:, None] & mask_n[None, :], other=0.0)
            v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            if FP32_DOT:
                s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, k)
            see = mask_n[None, :] & (pos[None, :] <= q_pos[:, None])
            s = tl.where(see, s * scale_log2, float("-inf"))
            # Finite: the first tile holds key 0, which every row (padding rows too) sees.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if FP32_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


# ----------------------------------------------------------------------------------------------------
# bindings


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           cu_q: torch.Tensor, context_lens: torch.Tensor) -> tuple[int, int, int]:
    """Shape checks at the boundary; returns (batch, q heads per kv head, head_dim)."""
    if triton is None:
        raise RuntimeError("the 'triton' attention backend needs the triton package (triton-xpu on Intel GPUs)")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged attention: q [T, Hq, D], caches [blocks, block_size, Hkv, D]; got q "
                         f"{tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    hq, d = q.size(1), q.size(2)
    hkv = k_cache.size(2)
    if k_cache.size(3) != d or hq % hkv:
        raise ValueError(f"paged attention: head_dim {d} vs cache {k_cache.size(3)}, {hq} q heads vs {hkv} kv heads")
    b = block_tables.size(0)
    if block_tables.dim() != 2 or cu_q.shape != (b + 1,) or context_lens.shape != (b,):
        raise ValueError(f"paged attention: block_tables [B, max_blocks], cu_q [B+1], context_lens [B]; got "
                         f"{tuple(block_tables.shape)}, {tuple(cu_q.shape)}, {tuple(context_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("cu_q", cu_q), ("context_lens", context_lens)):
        if t.dtype not in (torch.int32, torch.int64) or t.device != q.device:
            raise ValueError(f"paged attention: {name} must be int32/int64 on {q.device}, got {t.dtype} {t.device}")
    if q.dtype not in FLOATS or k_cache.dtype not in FLOATS or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"paged attention: dtypes q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("paged attention: q, caches and block_tables must be contiguous in their last dim")
    return b, hq // hkv, d


def _out(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"paged attention: out must be {tuple(q.shape)} on {q.device}, got {tuple(out.shape)}")
    return out


def _fp32_dot(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return interpreting() or q.dtype == torch.float32 or k_cache.dtype == torch.float32 or q.dtype != k_cache.dtype


def decode_num_splits(batch: int, kv_heads: int, max_keys: int, block_n: int = 64, target_programs: int = 512,
                      max_splits: int = 16) -> int:
    """Key-range splits per (sequence, kv head) so that about `target_programs` programs run, each with at
    least two key tiles. From static sizes only (max_keys = block_tables.size(1) * block_size), so a
    captured graph keeps its grid."""
    tiles = max(1, -(-max_keys // block_n))
    want = max(1, target_programs // max(1, batch * kv_heads))
    return int(max(1, min(want, max_splits, tiles // 2)))


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           cu_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, out: torch.Tensor | None = None,
                           block_n: int | None = None, single_only: bool = False) -> torch.Tensor:
    """Decode attention (each sequence has 0 or 1 query rows) over the paged cache; returns out [T, Hq, D].

    num_splits: key ranges per (sequence, kv head), merged by a second launch when > 1 (default from
    decode_num_splits). block_n: keys per tile (power of two >= 16). single_only: sequences with more than
    one query are left to the prefill kernel (their rows of out are not written).
    """
    b, group, d = _check(q, k_cache, v_cache, block_tables, cu_q, context_lens)
    hq, hkv, block_size = q.size(1), k_cache.size(2), k_cache.size(1)
    out = _out(q, out)
    if b == 0 or q.size(0) == 0:
        return out
    block_n = block_n or (64 if block_tables.size(1) * block_size >= 64 and not interpreting() else 16)
    if num_splits is None:
        num_splits = decode_num_splits(b, hkv, block_tables.size(1) * block_size, block_n)
    g_pad = max(16, triton.next_power_of_2(group))
    d_pad = max(16, triton.next_power_of_2(d))
    if num_splits > 1:
        po = torch.empty(b, hq, num_splits, d_pad, dtype=torch.float32, device=q.device)
        pml = torch.empty(b, hq, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        po = pml = out  # unused
    _paged_decode_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, cu_q, context_lens, out, po, pml,
        scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        po.stride(0), po.stride(1), po.stride(2), pml.stride(0), pml.stride(1),
        GROUP=group, G_PAD=g_pad, HEAD_DIM=d, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, FP32_DOT=_fp32_dot(q, k_cache), SINGLE_ONLY=single_only,
    )  # fmt: skip
    if num_splits > 1:
        _paged_decode_merge_kernel[(b, hq)](
            cu_q, out, po, pml,
            out.stride(0), out.stride(1), po.stride(0), po.stride(1), po.stride(2), pml.stride(0), pml.stride(1),
            HEAD_DIM=d, D_PAD=d_pad, NUM_SPLITS=num_splits, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
            SINGLE_ONLY=single_only,
        )  # fmt: skip
    return out


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_q: torch.Tensor, context_lens: torch.Tensor, max_q_len: int, scale: float,
                            out: torch.Tensor | None = None, block_m: int | None = None,
                            block_n: int | None = None, skip_single: bool = False) -> torch.Tensor:
    """Causal attention of each sequence's last n queries over its paged cache (varlen, any n including 1).

    block_m / block_n (powers of two >= 16) override the tile sizes; the interpreter defaults to 16 (its
    cost grows with the tile, not with the number of programs). skip_single: sequences with one query are
    left to the decode kernel (their rows of out are not written).
    """
    b, group, d = _check(q, k_cache, v_cache, block_tables, cu_q, context_lens)
    hq, block_size = q.size(1), k_cache.size(1)
    out = _out(q, out)
    if b == 0 or q.size(0) == 0 or max_q_len <= 0:
        return out
    small = max_q_len <= 16 or interpreting()
    block_m = block_m or (16 if small else 64)
    block_n = block_n or (16 if small else 64)
    d_pad = max(16, triton.next_power_of_2(d))
    _paged_prefill_kernel[(triton.cdiv(max_q_len, block_m), b, hq)](
        q, k_cache, v_cache, block_tables, cu_q, context_lens, out,
        scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=d, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        FP32_DOT=_fp32_dot(q, k_cache), SKIP_SINGLE=skip_single,
    )  # fmt: skip
    return out


def paged_attention_mixed(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                          cu_q: torch.Tensor, context_lens: torch.Tensor, max_q_len: int, scale: float) -> torch.Tensor:
    """A step of prompt chunks and decodes: the decode kernel for the sequences with one query, the prefill
    kernel for the longer runs, into one out. The prefill kernel spends a whole query tile per q head on a
    decode row and reads its kv head's keys once per q head; the decode kernel reads them once per kv head
    for all its q heads (benchmarks/bench_mixed.py measures what a prompt costs the decode step it joins)."""
    out = paged_attention_decode(q, k_cache, v_cache, block_tables, cu_q, context_lens, scale, single_only=True)
    return paged_attention_prefill(q, k_cache, v_cache, block_tables, cu_q, context_lens, max_q_len, scale, out=out,
                                   skip_single=True)
