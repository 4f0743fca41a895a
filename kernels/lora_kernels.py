"""The split Triton kernels of batched multi-LoRA (bindings and shape checks: kernels.lora_triton; launch sizes:
kernels.lora_config; the column kernels for decode steps: kernels.lora_cols; the opt-in one-launch fused kernel:
kernels.lora_fused).

Each program reads its M-block's slot, true rank and token run from the step's TokenGroups meta tensor (see
kernels.lora_triton) and touches only rank columns below the slot's rank; masked loads past it fetch
nothing, so a small rank's padding is never read. fp8 e4m3 weights arrive as bytes and are decoded in
registers (`_e4m3_as_f16`), their per-row float32 scales applied to the fp32 accumulators.

A decode step gives each program little work (one token of one adapter: an 8 KB tile of B), so a program's time
is its chain of dependent memory round trips. The programs issue their loads in three rounds: what needs only the
program id (slot, token run, slice, table row), then what needs those (rank, token ids, the slice's pointers), then
the data; the next M-tile's token ids are loaded while the current tile computes.
"""

from __future__ import annotations

from kernels.triton_env import tl, triton

if triton is not None:

    @triton.jit
    def _e4m3_as_f16(u8):
        """fp8 e4m3fn bytes -> float16 holding value * 2^-8, exactly (normals and subnormals alike): the
        4 exponent and 3 mantissa bits moved into float16's fields, the bias difference (15 - 7) left to
        the caller's scale. Bit operations only: the same on every backend and in the interpreter."""
        u = u8.to(tl.uint16)
        return (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.float16, bitcast=True)

    @triton.jit
    def _slice_index(pid_n, b_table_ptr, NUM_SLICES: tl.constexpr):
        """The slice whose column groups hold column group pid_n: table row s = (ptr, stride0, n_s, offset_s, first
        group of s, rank stride of s when B is stored rank-major, fp8 scale ptr, its slot stride)."""
        s = 0
        for i in tl.static_range(1, NUM_SLICES):
            s += (pid_n >= tl.load(b_table_ptr + i * 8 + 4)).to(tl.int32)
        return s

    @triton.jit
    def _b_row(tab, b0_ptr, B_RANK_MAJOR: tl.constexpr, ALIGNED: tl.constexpr):
        """A slice's row of the B table (see _slice_index): (B base, slot stride, n_s, y offset, first column group,
        rank stride), with what the host checked as hints when ALIGNED (16-byte bases; sizes, offsets and strides
        multiples of 8)."""
        b_ptr = tl.load(tab).to(tl.pointer_type(b0_ptr.dtype.element_ty))
        stride_b0 = tl.load(tab + 1)
        n_s = tl.load(tab + 2).to(tl.int32)
        y_off = tl.load(tab + 3).to(tl.int32)
        first = tl.load(tab + 4).to(tl.int32)
        if B_RANK_MAJOR:  # B_s[slot] stored [r_max, n_s] (n contiguous): rank rows are read whole, padding never
            stride_r = tl.load(tab + 5)
        else:  # [n_s, r_max] (r contiguous)
            stride_r = 1
        if ALIGNED:
            b_ptr = tl.multiple_of(b_ptr, 16)
            stride_b0 = tl.multiple_of(stride_b0, 8)
            n_s = tl.multiple_of(n_s, 8)
            y_off = tl.multiple_of(y_off, 8)
            if B_RANK_MAJOR:
                stride_r = tl.multiple_of(stride_r, 8)
        return b_ptr, stride_b0, n_s, y_off, first, stride_r

    @triton.jit
    def _split_sum(ptrs, mask, stride_k, SPLIT_K: tl.constexpr):
        """sum_ks buf[ks] over the shrink's K splits, in a fixed order (deterministic)."""
        t = tl.load(ptrs, mask=mask, other=0.0)
        for kk in tl.static_range(1, SPLIT_K):
            t += tl.load(ptrs + kk * stride_k, mask=mask, other=0.0)
        return t

    @triton.jit
    def _block_of(meta_ptr, blocks_off, num_blocks, pid_b):
        """A program's M-block: (slot, first row, end row) in the slot-sorted tokens (round 1 of its loads)."""
        slot = tl.load(meta_ptr + blocks_off + pid_b)
        m_lo = tl.load(meta_ptr + blocks_off + num_blocks + pid_b)
        m_end = tl.load(meta_ptr + blocks_off + 2 * num_blocks + pid_b)
        return slot, m_lo, m_end

    @triton.jit
    def _rank_and_tokens(ranks_ptr, s, slot, num_slots, stride_rs, stride_rt, R_MAX, meta_ptr, sorted_off, m_lo, m_end,
                         chunk, BLOCK_M: tl.constexpr):
        """Round 2: the slot's rank in slice s (an unused block, slot == num_slots, reads the last slot's and
        stops), and the run's first BLOCK_M rows and token ids. Returns (slot64, rank, m_hi, rows, mask_m, tok)."""
        slot64 = tl.minimum(slot, num_slots - 1).to(tl.int64)
        rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot64 * stride_rt), R_MAX)
        m_hi = tl.minimum(m_end, m_lo + chunk)
        rows = m_lo + tl.arange(0, BLOCK_M)
        mask_m = rows < m_hi
        tok = tl.load(meta_ptr + sorted_off + rows, mask=mask_m, other=0).to(tl.int64)
        return slot64, rank, m_hi, rows, mask_m, tok

    @triton.jit
    def _shrink_tile(x_ptrs, a_ptrs, mask_m, mask_r, k_lo, k_hi, K, stride_xk, BLOCK_M: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FP32_DOT: tl.constexpr,
                     FP8: tl.constexpr):
        """sum_{k in [k_lo, k_hi)} x[rows, k] * A[r, k] -> [BM, BR] float32 (fp8 A decoded, its scales left to the
        caller); x_ptrs [BM, BK] and a_ptrs [BK, BR] point at k_lo."""
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                xt = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
                at = tl.load(a_ptrs, mask=mask_r[None, :], other=0)
            else:
                mask_k = (k0 + offs_k) < K
                xt = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                at = tl.load(a_ptrs, mask=mask_r[None, :] & mask_k[:, None], other=0)
            if FP8:
                at = _e4m3_as_f16(at)
            if FP32_DOT:
                acc += _mm(xt, at, BLOCK_M == 1, True)
            else:
                acc += _mm(xt, at.to(xt.dtype), BLOCK_M == 1, False)  # 16-bit inputs, fp32 accumulate
            x_ptrs += BLOCK_K * stride_xk
            a_ptrs += BLOCK_K
        return acc

    @triton.jit
    def _mm(a, b, ROW: tl.constexpr, IEEE: tl.constexpr):
        """a [M, K] @ b [K, N] -> float32 [M, N]: tl.dot (M >= 16; IEEE: in fp32), or for one row (ROW: M == 1, a
        decode block's one token) a broadcast and a sum over K in fp32, with no 16-row accumulator tile to hold."""
        if ROW:
            return tl.sum(tl.trans(a).to(tl.float32) * b.to(tl.float32), axis=0)[None, :]
        elif IEEE:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _expand_dot(bt, wt, out_dtype: tl.constexpr, FP32_DOT: tl.constexpr, FP8: tl.constexpr, ROW: tl.constexpr):
        """bt [BM, BR] float32 @ wt [BR, BN] (B's dtype, or fp8 bytes) -> float32 (ROW: BM == 1, see _mm)."""
        if FP8:
            wt = _e4m3_as_f16(wt)
        if FP32_DOT:
            acc = _mm(bt, wt, ROW, True)
        elif FP8:
            acc = _mm(bt.to(out_dtype), wt.to(out_dtype), ROW, False)
        else:
            acc = _mm(bt.to(wt.dtype), wt, ROW, False)  # shrink result rounded to B's 16-bit dtype, fp32 accumulate
        return acc

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
        slot[t] >= 0, r < rank[s, slot[t]]. Program (M-block, slice x rank chunk, K split)."""
        pid_b = tl.program_id(0)
        pid_sr = tl.program_id(1)
        pid_k = tl.program_id(2)
        s = pid_sr // NUM_RB
        r0 = (pid_sr % NUM_RB) * BLOCK_R
        slot, m_lo, m_end = _block_of(meta_ptr, blocks_off, num_blocks, pid_b)  # round 1, with the table row
        a_ptr = tl.load(a_table_ptr + 2 * s).to(tl.pointer_type(a0_ptr.dtype.element_ty))
        if FP8:
            sc_ptr = tl.load(a_table_ptr + 2 * s + 1).to(tl.pointer_type(tl.float32))
        slot64, rank, m_hi, rows, mask_m, tok = _rank_and_tokens(ranks_ptr, s, slot, num_slots, stride_rs, stride_rt,
                                                                 R_MAX, meta_ptr, sorted_off, m_lo, m_end, chunk,
                                                                 BLOCK_M)
        if (slot < num_slots) & (r0 < rank):  # no work on rank padding
            if ALIGNED:  # the host checked: 16-byte aligned bases (lets the loads vectorise)
                a_ptr = tl.multiple_of(a_ptr, 16)
            offs_r = r0 + tl.arange(0, BLOCK_R)
            mask_r = offs_r < rank
            k_lo = pid_k * K_PER_SPLIT  # K_PER_SPLIT is a multiple of BLOCK_K
            k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
            if FP8:  # per rank row; 256 undoes _e4m3_as_f16's 2^-8
                scale = tl.load(sc_ptr + slot64 * stride_s0 + offs_r * stride_s1, mask=mask_r, other=0.0) * 256.0
            offs_k = k_lo + tl.arange(0, BLOCK_K)
            a_tile = a_ptr + slot64 * stride_a0 + offs_r[None, :] * stride_a1 + offs_k[:, None]  # [BK, BR]
            # The run's tokens in BLOCK_M tiles; the slot's A tile comes from DRAM once, then from the cache.
            for _m0 in range(m_lo, m_hi, BLOCK_M):
                x_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :] * stride_xk
                acc = _shrink_tile(x_ptrs, a_tile, mask_m, mask_r, k_lo, k_hi, K, stride_xk, BLOCK_M, BLOCK_R, BLOCK_K,
                                   EVEN_K, FP32_DOT, FP8)
                if FP8:
                    acc = acc * scale[None, :]
                out = buf_ptr + pid_k * stride_bk + s * stride_bs + tok[:, None] * stride_bm + offs_r[None, :]
                tl.store(out, acc, mask=mask_m[:, None] & mask_r[None, :])
                rows += BLOCK_M  # the next tile's token ids
                mask_m = rows < m_hi
                tok = tl.load(meta_ptr + sorted_off + rows, mask=mask_m, other=0).to(tl.int64)

    @triton.jit
    def _lora_expand_kernel(
        y_ptr, buf_ptr, b_table_ptr, b0_ptr, ranks_ptr, meta_ptr,
        sorted_off, blocks_off, num_blocks, chunk, R_MAX, num_slots,
        stride_ym, stride_yn, stride_bk, stride_bs, stride_bm, stride_bn, stride_rs, stride_rt,
        NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, ADD_INPUTS: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, N_ITERS: tl.constexpr, BLOCK_R: tl.constexpr, B_RANK_MAJOR: tl.constexpr,
        ALIGNED: tl.constexpr, FP32_DOT: tl.constexpr, FP8: tl.constexpr, ONE_CHUNK: tl.constexpr,
    ):  # fmt: skip
        """y[t, off_s + n] (+)= sum_{r < rank[s, slot[t]]} sum_ks buf[ks, s, t, r] * B_s[slot[t], n, r]
        * (fp8: scale_s[slot[t], n]); slot[t] >= 0. ONE_CHUNK: BLOCK_R >= R_MAX, the whole rank in one tile (the
        shrink result is loaded once per M-tile, B's first tile ahead of the token loop, which it does not need).
        Program (M-block, column group)."""
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        slot, m_lo, m_end = _block_of(meta_ptr, blocks_off, num_blocks, pid_b)  # round 1, with the slice
        s = _slice_index(pid_n, b_table_ptr, NUM_SLICES)
        # round 2: the slice's row of the table, the slot's rank, the run's first token ids
        tab = b_table_ptr + s * 8
        b_ptr, stride_b0, n_s, y_off, first, stride_r = _b_row(tab, b0_ptr, B_RANK_MAJOR, ALIGNED)
        if FP8:
            sc_base = tl.load(tab + 6).to(tl.pointer_type(tl.float32))
            sc_stride = tl.load(tab + 7)
        slot64, rank, m_hi, rows, mask_m, tok = _rank_and_tokens(ranks_ptr, s, slot, num_slots, stride_rs, stride_rt,
                                                                 R_MAX, meta_ptr, sorted_off, m_lo, m_end, chunk,
                                                                 BLOCK_M)
        if slot < num_slots:
            n_first = (pid_n - first) * (BLOCK_N * N_ITERS)
            offs_r = tl.arange(0, BLOCK_R)
            b_slot = b_ptr + slot64 * stride_b0 + offs_r[:, None] * stride_r  # [BR, 1]
            if FP8:
                sc_ptr = sc_base + slot64 * sc_stride
            if ONE_CHUNK:  # round 3 starts with the first column block of B: it needs no token
                mask_r = offs_r < rank
                offs_n0 = n_first + tl.arange(0, BLOCK_N)
                wt0 = tl.load(b_slot + offs_n0[None, :] * stride_bn, mask=mask_r[:, None] & (offs_n0 < n_s)[None, :],
                              other=0)
            if (not ADD_INPUTS) or rank > 0:  # a rank-0 add adds nothing (a replace still writes its zeros)
                for _m0 in range(m_lo, m_hi, BLOCK_M):  # the run's tokens in tiles
                    buf_rows = buf_ptr + s * stride_bs + tok[:, None] * stride_bm + offs_r[None, :]  # [BM, BR]
                    y_rows = y_ptr + tok[:, None] * stride_ym
                    if ONE_CHUNK:
                        bt = _split_sum(buf_rows, mask_m[:, None] & mask_r[None, :], stride_bk, SPLIT_K)
                    for j in tl.static_range(N_ITERS):  # column blocks: the slot and token lookups are paid once
                        offs_n = n_first + j * BLOCK_N + tl.arange(0, BLOCK_N)
                        mask_n = offs_n < n_s
                        y_ptrs = y_rows + (y_off + offs_n)[None, :] * stride_yn
                        mask = mask_m[:, None] & mask_n[None, :]
                        if ADD_INPUTS:
                            y_in = tl.load(y_ptrs, mask=mask, other=0.0)
                        if ONE_CHUNK:
                            if j == 0:
                                wt = wt0
                            else:
                                wt = tl.load(b_slot + offs_n[None, :] * stride_bn,
                                             mask=mask_r[:, None] & mask_n[None, :], other=0)
                            acc = _expand_dot(bt, wt, y_ptr.dtype.element_ty, FP32_DOT, FP8, BLOCK_M == 1)
                        else:
                            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                            for r0 in range(0, rank, BLOCK_R):  # only the slot's true rank
                                mask_rr = (r0 + offs_r) < rank
                                bt_r = _split_sum(buf_rows + r0, mask_m[:, None] & mask_rr[None, :], stride_bk,
                                                  SPLIT_K)
                                wt_r = tl.load(b_slot + r0 * stride_r + offs_n[None, :] * stride_bn,
                                               mask=mask_rr[:, None] & mask_n[None, :], other=0)  # [BR, BN]
                                acc += _expand_dot(bt_r, wt_r, y_ptr.dtype.element_ty, FP32_DOT, FP8, BLOCK_M == 1)
                        if FP8:  # per output row of B; 256 undoes _e4m3_as_f16's 2^-8
                            acc = acc * (tl.load(sc_ptr + offs_n, mask=mask_n, other=0.0) * 256.0)[None, :]
                        out = acc.to(y_ptr.dtype.element_ty)
                        if ADD_INPUTS:  # like torch's y += out.to(y.dtype): add in fp32, round once
                            out = (y_in.to(tl.float32) + out.to(tl.float32)).to(out.dtype)
                        tl.store(y_ptrs, out, mask=mask)
                    rows += BLOCK_M  # the next tile's token ids
                    mask_m = rows < m_hi
                    tok = tl.load(meta_ptr + sorted_off + rows, mask=mask_m, other=0).to(tl.int64)

else:  # pragma: no cover - without triton the bindings refuse to launch (kernels.lora_triton._require_triton)
    _lora_shrink_kernel = _lora_expand_kernel = None
