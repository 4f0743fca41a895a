"""The Triton kernels of batched multi-LoRA (bindings, shape checks and launch sizes: kernels.lora_triton).

Each program reads its M-block's slot, true rank and token run from the step's TokenGroups meta tensor (see
kernels.lora_triton) and touches only rank columns below the slot's rank; masked loads past it fetch
nothing, so a small rank's padding is never read. fp8 e4m3 weights arrive as bytes and are decoded in
registers (`_e4m3_as_f16`), their per-row float32 scales applied to the fp32 accumulators.
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
    def _slice_of(pid_n, slot, b_table_ptr, ranks_ptr, stride_rs, stride_rt, R_MAX: tl.constexpr,
                  NUM_SLICES: tl.constexpr):
        """(table row, slice, the slot's rank in it) of a program's column group: table row s = (ptr, stride0,
        n_s, offset_s, first group of s, rank stride of s when B is stored rank-major, fp8 scale ptr, its slot
        stride)."""
        s = 0
        for i in tl.static_range(1, NUM_SLICES):
            s += (pid_n >= tl.load(b_table_ptr + i * 8 + 4)).to(tl.int32)
        rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot * stride_rt), R_MAX)
        return b_table_ptr + s * 8, s, rank

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
        tab, s, rank = _slice_of(pid_n, slot, b_table_ptr, ranks_ptr, stride_rs, stride_rt, R_MAX, NUM_SLICES)
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

    @triton.jit
    def _lora_fused_kernel(
        y_ptr, x_ptr, a_table_ptr, a0_ptr, b_table_ptr, b0_ptr, ranks_ptr, meta_ptr,
        sorted_off, blocks_off, num_blocks, chunk,
        K, R_MAX, num_slots,
        stride_xm, stride_xk, stride_a0, stride_a1, stride_s0, stride_s1,
        stride_ym, stride_yn, stride_bn, stride_rs, stride_rt,
        NUM_SLICES: tl.constexpr, ADD_INPUTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        N_ITERS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        B_RANK_MAJOR: tl.constexpr, ALIGNED: tl.constexpr, FP32_DOT: tl.constexpr, FP8: tl.constexpr,
    ):  # fmt: skip
        """y[t, off_s + n] (+)= sum_{r < rank} (sum_k x[t, k] A_s[slot, r, k]) B_s[slot, n, r] (fp8: both scaled);
        one launch per layer: each program computes its tokens' whole shrink (all of K, rank <= BLOCK_R) and
        expands it into its N_ITERS column blocks of one slice."""
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        slot = tl.load(meta_ptr + blocks_off + pid_b)
        if slot >= num_slots:
            return
        tab, s, rank = _slice_of(pid_n, slot, b_table_ptr, ranks_ptr, stride_rs, stride_rt, R_MAX, NUM_SLICES)
        if ADD_INPUTS and rank == 0:
            return
        a_ptr = tl.load(a_table_ptr + 2 * s).to(tl.pointer_type(a0_ptr.dtype.element_ty))
        b_ptr = tl.load(tab).to(tl.pointer_type(b0_ptr.dtype.element_ty))
        stride_b0 = tl.load(tab + 1)
        n_s = tl.load(tab + 2).to(tl.int32)
        y_off = tl.load(tab + 3).to(tl.int32)
        if B_RANK_MAJOR:
            stride_r = tl.load(tab + 5)
        else:
            stride_r = 1
        if ALIGNED:
            a_ptr = tl.multiple_of(a_ptr, 16)
            b_ptr = tl.multiple_of(b_ptr, 16)
            stride_b0 = tl.multiple_of(stride_b0, 8)
            n_s = tl.multiple_of(n_s, 8)
            y_off = tl.multiple_of(y_off, 8)
            if B_RANK_MAJOR:
                stride_r = tl.multiple_of(stride_r, 8)
        n_first = (pid_n - tl.load(tab + 4).to(tl.int32)) * (BLOCK_N * N_ITERS)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        slot64 = slot.to(tl.int64)
        if FP8:
            a_sc = tl.load(a_table_ptr + 2 * s + 1).to(tl.pointer_type(tl.float32))
            a_scale = tl.load(a_sc + slot64 * stride_s0 + offs_r * stride_s1, mask=mask_r, other=0.0) * 256.0
            b_sc = tl.load(tab + 6).to(tl.pointer_type(tl.float32)) + slot64 * tl.load(tab + 7)
        a_rows = a_ptr + slot64 * stride_a0 + offs_r[None, :] * stride_a1  # [1, BR]
        b_slot = b_ptr + slot64 * stride_b0 + offs_r[:, None] * stride_r  # [BR, 1]
        m_lo = tl.load(meta_ptr + blocks_off + num_blocks + pid_b)
        m_hi = tl.minimum(tl.load(meta_ptr + blocks_off + 2 * num_blocks + pid_b), m_lo + chunk)
        for m0 in range(m_lo, m_hi, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            mask_m = rows < m_hi
            tok = tl.load(meta_ptr + sorted_off + rows, mask=mask_m, other=0).to(tl.int64)
            offs_k = tl.arange(0, BLOCK_K)
            x_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :] * stride_xk
            a_ptrs = a_rows + offs_k[:, None]  # [BK, BR]
            h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)  # the shrink result of these tokens
            for k0 in range(0, K, BLOCK_K):
                if EVEN_K:
                    xt = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
                    at = tl.load(a_ptrs, mask=mask_r[None, :], other=0)
                else:
                    mask_k = offs_k < K - k0
                    xt = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                    at = tl.load(a_ptrs, mask=mask_r[None, :] & mask_k[:, None], other=0)
                if FP8:
                    at = _e4m3_as_f16(at)
                if FP32_DOT:
                    h += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
                else:
                    h += tl.dot(xt, at.to(xt.dtype))
                x_ptrs += BLOCK_K * stride_xk
                a_ptrs += BLOCK_K
            if FP8:
                h = h * a_scale[None, :]
            y_rows = y_ptr + tok[:, None] * stride_ym
            for j in range(N_ITERS):
                offs_n = n_first + j * BLOCK_N + tl.arange(0, BLOCK_N)
                mask_n = offs_n < n_s
                wt = tl.load(b_slot + offs_n[None, :] * stride_bn, mask=mask_r[:, None] & mask_n[None, :], other=0)
                if FP8:
                    wt = _e4m3_as_f16(wt)
                if FP32_DOT:
                    acc = tl.dot(h, wt.to(tl.float32), input_precision="ieee")
                elif FP8:
                    acc = tl.dot(h.to(y_ptr.dtype.element_ty), wt.to(y_ptr.dtype.element_ty))
                else:
                    acc = tl.dot(h.to(wt.dtype), wt)  # the shrink result rounded to B's 16-bit dtype, as the split path
                if FP8:
                    acc = acc * (tl.load(b_sc + offs_n, mask=mask_n, other=0.0) * 256.0)[None, :]
                y_ptrs = y_rows + (y_off + offs_n)[None, :] * stride_yn
                mask = mask_m[:, None] & mask_n[None, :]
                out = acc.to(y_ptr.dtype.element_ty)
                if ADD_INPUTS:
                    out = (tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32) + out.to(tl.float32)).to(out.dtype)
                tl.store(y_ptrs, out, mask=mask)

else:  # pragma: no cover - without triton the bindings refuse to launch (kernels.lora_triton._require_triton)
    _lora_shrink_kernel = _lora_expand_kernel = _lora_fused_kernel = None
