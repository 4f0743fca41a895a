"""The column expand of batched multi-LoRA for small steps (decode): one program per column block of one slice,
holding every token of the step, streams the B rows of all slots through one accumulator. kernels.lora_triton
takes it where it applies (use_cols: <= 64 tokens, ranks <= 64) and sizes its launch; the shared conventions
(TokenGroups meta, B table rows, rank masks, fp8 bytes) are kernels.lora_kernels'.

Why: the split expand gives a decode program one token of one adapter (an 8 KB tile of B) behind a chain of
dependent lookups (block -> slot -> rank -> token ids -> data), so its time is that chain times its waves, not
its bytes. Here a program's B loads need only the loop counter (slot s's rows are the K range s * BLOCK_R ...),
so they stream with nothing in front of them but the slot's token count and rank, loaded beside them. Each token
takes only its own slot's rows: the other slots' shrink results are masked to zero (a token row of the left
operand is nonzero in one K range), so the sum over slots is exact, the same value as the split expand's.
"""

from __future__ import annotations

from kernels.triton_env import tl, triton

if triton is not None:
    from kernels.lora_kernels import _b_row, _expand_dot, _slice_index, _split_sum

    @triton.jit
    def _lora_expand_cols_kernel(
        y_ptr, buf_ptr, b_table_ptr, b0_ptr, ranks_ptr, meta_ptr,
        num_tokens, len_off, R_MAX, num_slots,
        stride_ym, stride_yn, stride_bk, stride_bs, stride_bm, stride_bn, stride_rs, stride_rt,
        NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, ADD_INPUTS: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr, B_RANK_MAJOR: tl.constexpr,
        ALIGNED: tl.constexpr, FP32_DOT: tl.constexpr, FP8: tl.constexpr,
    ):  # fmt: skip
        """y[t, off_s + n] (+)= sum_{r < rank[s, slot[t]]} sum_ks buf[ks, s, t, r] * B_s[slot[t], n, r]
        * (fp8: scale_s[slot[t], n]); slot[t] >= 0. Program = one column block of one slice, all T <= BLOCK_T tokens;
        it goes over the slots GROUP at a time (K = GROUP * BLOCK_R rows of B per dot), reading only the rows of
        slots that some token uses, below their rank. FP8 needs GROUP == 1 (its scales are per slot)."""
        pid_n = tl.program_id(0)
        s = _slice_index(pid_n, b_table_ptr, NUM_SLICES)
        tab = b_table_ptr + s * 8
        b_ptr, stride_b0, n_s, y_off, first, stride_r = _b_row(tab, b0_ptr, B_RANK_MAJOR, ALIGNED)
        if FP8:
            sc_base = tl.load(tab + 6).to(tl.pointer_type(tl.float32))
            sc_stride = tl.load(tab + 7)
        rows = tl.arange(0, BLOCK_T)  # the step's tokens, in their own order
        mask_t = rows < num_tokens
        tok_slot = tl.load(meta_ptr + rows, mask=mask_t, other=-1)  # TokenGroups part 0: each token's slot
        offs_n = (pid_n - first) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_s
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + (y_off + offs_n)[None, :] * stride_yn
        if ADD_INPUTS:
            y_in = tl.load(y_ptrs, mask=mask_t[:, None] & mask_n[None, :], other=0.0)
        tok_rank = tl.load(ranks_ptr + s * stride_rs + tl.maximum(tok_slot, 0) * stride_rt, mask=tok_slot >= 0,
                           other=0)
        KB: tl.constexpr = GROUP * BLOCK_R
        offs_k = tl.arange(0, KB)
        kr = offs_k % BLOCK_R  # the rank row inside its slot
        buf_rows = buf_ptr + s * stride_bs + rows[:, None].to(tl.int64) * stride_bm + kr[None, :]  # [BT, KB]
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for s0 in range(0, num_slots, GROUP):
            sl = s0 + offs_k // BLOCK_R  # each K row's slot
            valid = sl < num_slots
            used = tl.load(meta_ptr + len_off + sl, mask=valid, other=0) > 0  # TokenGroups part 3: slot_len
            rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + sl * stride_rt, mask=valid, other=0), R_MAX)
            live = used & (kr < rank)  # rows of B that count (no padding, no idle slot is read)
            sl64 = tl.minimum(sl, num_slots - 1).to(tl.int64)
            wt = tl.load(b_ptr + sl64[:, None] * stride_b0 + kr[:, None] * stride_r + offs_n[None, :] * stride_bn,
                         mask=live[:, None] & mask_n[None, :], other=0)  # [KB, BN]
            mine = (tok_slot[:, None] == sl[None, :]) & live[None, :]  # each token's own slot's rows only
            bt = _split_sum(buf_rows, mine, stride_bk, SPLIT_K)
            part = _expand_dot(bt, wt, y_ptr.dtype.element_ty, FP32_DOT, FP8, False)
            if FP8:  # per output row of B of slot s0 (an idle slot's scales are never read); 256 undoes
                # _e4m3_as_f16's 2^-8
                s0_used = tl.load(meta_ptr + len_off + s0 + offs_n * 0) > 0  # slot_len[s0], one per column
                part = part * (tl.load(sc_base + s0 * sc_stride + offs_n, mask=mask_n & s0_used, other=0.0)
                               * 256.0)[None, :]
            acc += part
        out = acc.to(y_ptr.dtype.element_ty)
        if ADD_INPUTS:  # like torch's y += out.to(y.dtype): add in fp32, round once; a rank-0 add adds nothing
            out = (y_in.to(tl.float32) + out.to(tl.float32)).to(out.dtype)
            touched = (tok_slot >= 0) & (tok_rank > 0)
        else:  # a replace writes its zeros, rank 0 included
            touched = tok_slot >= 0
        tl.store(y_ptrs, out, mask=(touched & mask_t)[:, None] & mask_n[None, :])

else:  # pragma: no cover - without triton the bindings refuse to launch (kernels.lora_triton._require_triton)
    _lora_expand_cols_kernel = None
