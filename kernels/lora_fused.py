"""The one-launch fused multi-LoRA kernel (opt-in: kernels.lora_triton.use_fused): each program computes its tokens'
whole shrink (all of K, rank <= 64 held in registers) and expands it into its column blocks of one slice. Bindings
and launch sizes: kernels.lora_triton; the shared conventions (TokenGroups meta, rank masks, fp8 bytes): kernels.
lora_kernels.
"""

from __future__ import annotations

from kernels.triton_env import tl, triton

if triton is not None:
    from kernels.lora_kernels import _b_row, _expand_dot, _shrink_tile, _slice_index

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
        s = _slice_index(pid_n, b_table_ptr, NUM_SLICES)
        tab = b_table_ptr + s * 8
        rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot * stride_rt), R_MAX)
        if ADD_INPUTS and rank == 0:
            return
        a_ptr = tl.load(a_table_ptr + 2 * s).to(tl.pointer_type(a0_ptr.dtype.element_ty))
        b_ptr, stride_b0, n_s, y_off, first, stride_r = _b_row(tab, b0_ptr, B_RANK_MAJOR, ALIGNED)
        if ALIGNED:
            a_ptr = tl.multiple_of(a_ptr, 16)
        n_first = (pid_n - first) * (BLOCK_N * N_ITERS)
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
            # the shrink result of these tokens
            h = _shrink_tile(x_ptrs, a_rows + offs_k[:, None], mask_m, mask_r, 0, K, K, stride_xk, BLOCK_M, BLOCK_R,
                             BLOCK_K, EVEN_K, FP32_DOT, FP8)
            if FP8:
                h = h * a_scale[None, :]
            y_rows = y_ptr + tok[:, None] * stride_ym
            for j in range(N_ITERS):
                offs_n = n_first + j * BLOCK_N + tl.arange(0, BLOCK_N)
                mask_n = offs_n < n_s
                wt = tl.load(b_slot + offs_n[None, :] * stride_bn, mask=mask_r[:, None] & mask_n[None, :], other=0)
                acc = _expand_dot(h, wt, y_ptr.dtype.element_ty, FP32_DOT, FP8, BLOCK_M == 1)  # as the split path
                if FP8:
                    acc = acc * (tl.load(b_sc + offs_n, mask=mask_n, other=0.0) * 256.0)[None, :]
                y_ptrs = y_rows + (y_off + offs_n)[None, :] * stride_yn
                mask = mask_m[:, None] & mask_n[None, :]
                out = acc.to(y_ptr.dtype.element_ty)
                if ADD_INPUTS:
                    out = (tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32) + out.to(tl.float32)).to(out.dtype)
                tl.store(y_ptrs, out, mask=mask)

else:  # pragma: no cover - without triton the bindings refuse to launch
    _lora_fused_kernel = None
