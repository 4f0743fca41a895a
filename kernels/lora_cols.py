"""The column expand of batched multi-LoRA for small steps (decode): a program per column block of one slice holds all
the step's tokens and streams the B rows of the used slots, GROUP slots per dot, into one accumulator. It reads the
split shrink's partials. kernels.lora_triton takes it where it applies (kernels.lora_config.use_cols: <= 32 tokens by
default, ranks <= 64); the shared conventions (TokenGroups meta, pointer tables, rank masks) are
kernels.lora_kernels'. (A column shrink of the same form was measured slower than the split shrink on an H200 and
removed: docs/PERFORMANCE.md, twenty-fifth session.)

Why: the split kernels give a decode program one token of one adapter (an 8 KB tile of B, a 16 KB run of A) behind
a chain of dependent lookups (block -> slot -> rank -> token ids -> data), so their time is that chain times their
waves, not their bytes. Here a program's weight loads need only the loop counter and the slots' ranks (zero for a
slot no token uses), all loaded once before the loop, so they pipeline across its iterations. In each slot's rows
of a dot the tokens of other slots take part with zeros, so the sums are exact: each token gets its own slot's
value.
"""

from __future__ import annotations

from kernels.triton_env import tl, triton

if triton is not None:
    from kernels.lora_kernels import _b_row, _expand_dot, _slice_index, _split_sum

    @triton.jit
    def _live_rank(meta_ptr, len_off, ranks_ptr, s, slot, num_slots, stride_rs, stride_rt, R_MAX):
        """Slot `slot`'s rank in slice s if some token of the step uses it, else 0 (also past the last slot); `slot`
        may be a tensor of slots."""
        valid = slot < num_slots
        used = tl.load(meta_ptr + len_off + slot, mask=valid, other=0) > 0  # TokenGroups part 3: slot_len
        rank = tl.load(ranks_ptr + s * stride_rs + slot * stride_rt, mask=valid, other=0)
        return tl.where(used, tl.minimum(rank, R_MAX), 0)

    @triton.jit
    def _tok_rank(ranks_ptr, s, tok_slot, stride_rs, stride_rt, R_MAX):
        """Each token's slot's rank in slice s, at most R_MAX; 0 for slot -1."""
        rank = tl.load(ranks_ptr + s * stride_rs + tl.maximum(tok_slot, 0) * stride_rt, mask=tok_slot >= 0, other=0)
        return tl.minimum(rank, R_MAX)

    @triton.jit
    def _busy_groups(meta_ptr, len_off, ranks_ptr, s, num_slots, stride_rs, stride_rt, R_MAX, GROUP: tl.constexpr,
                     S_PAD: tl.constexpr):
        """Slice s's slot groups (GROUP slots each): (groups [G], live ranks [G, GROUP], place [G]: a busy group's
        place among the busy ones, -1 for an idle one, n_busy). A group is busy if one of its slots is live: used
        by some token of the step, with rank > 0 in s. Loaded once, so no weight load waits on a lookup."""
        groups = tl.arange(0, S_PAD // GROUP)  # S_PAD >= GROUP
        slots2 = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        live = _live_rank(meta_ptr, len_off, ranks_ptr, s, slots2, num_slots, stride_rs, stride_rt, R_MAX)
        busy = (tl.max(live, axis=1) > 0).to(tl.int32)
        place = tl.where(busy > 0, tl.cumsum(busy, axis=0) - 1, -1)
        return groups, live, place, tl.sum(busy, axis=0)

    @triton.jit
    def _group_at(groups, live, place, i, GROUP: tl.constexpr, BLOCK_R: tl.constexpr):
        """The i-th busy group's first slot and its slots' live ranks, one per K row / column ([GROUP * BLOCK_R])."""
        g = tl.sum(tl.where(place == i, groups, 0), axis=0)
        rank_g = tl.sum(tl.where((place == i)[:, None], live, 0), axis=0)  # [GROUP]
        return g * GROUP, tl.reshape(tl.broadcast_to(rank_g[:, None], (GROUP, BLOCK_R)), (GROUP * BLOCK_R,))

    @triton.jit
    def _lora_expand_cols_kernel(
        y_ptr, buf_ptr, b_table_ptr, b0_ptr, ranks_ptr, meta_ptr,
        num_tokens, len_off, R_MAX, num_slots,
        stride_ym, stride_yn, stride_bk, stride_bs, stride_bm, stride_bn, stride_rs, stride_rt,
        NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, ADD_INPUTS: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr, S_PAD: tl.constexpr,
        B_RANK_MAJOR: tl.constexpr, ALIGNED: tl.constexpr, FP32_DOT: tl.constexpr, FP8: tl.constexpr,
    ):  # fmt: skip
        """y[t, off_s + n] (+)= sum_{r < rank[s, slot[t]]} sum_ks buf[ks, s, t, r] * B_s[slot[t], n, r]
        * (fp8: scale_s[slot[t], n]) for slot[t] >= 0, rank <= BLOCK_R, B in a 16- or 32-bit float dtype or as fp8
        e4m3 bytes. Program = one column block of one slice, all T <= BLOCK_T tokens; it goes over the slots GROUP
        per dot, reading only the B rows of slots that some token uses, below their rank; each token's shrink result
        takes part in its own slot's K rows only."""
        pid_n = tl.program_id(0)
        s = _slice_index(pid_n, b_table_ptr, NUM_SLICES)
        tab = b_table_ptr + s * 8
        b_ptr, stride_b0, n_s, y_off, first, stride_r = _b_row(tab, b0_ptr, B_RANK_MAJOR, ALIGNED)
        rows = tl.arange(0, BLOCK_T)  # the step's tokens, in their own order
        mask_t = rows < num_tokens
        tok_slot = tl.load(meta_ptr + rows, mask=mask_t, other=-1)  # TokenGroups part 0: each token's slot
        offs_n = (pid_n - first) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_s
        offs_r = tl.arange(0, BLOCK_R)
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + (y_off + offs_n)[None, :] * stride_yn
        if ADD_INPUTS:
            y_in = tl.load(y_ptrs, mask=mask_t[:, None] & mask_n[None, :], other=0.0)
        # Each token's own shrink result [BT, BR], summed over the K splits once. Its loads do not wait on the
        # ranks (columns past a rank hold garbage, NaN maybe: zeroed after the sum).
        bt = _split_sum(buf_ptr + s * stride_bs + rows[:, None].to(tl.int64) * stride_bm + offs_r[None, :],
                        mask_t[:, None] & (offs_r[None, :] < R_MAX), stride_bk, SPLIT_K)
        tok_rank = _tok_rank(ranks_ptr, s, tok_slot, stride_rs, stride_rt, R_MAX)
        bt = tl.where(offs_r[None, :] < tok_rank[:, None], bt, 0.0)
        # GROUP slots per dot: K row k is rank row k % BLOCK_R of slot s0 + k // BLOCK_R
        offs_k = tl.arange(0, GROUP * BLOCK_R)
        kg, kr = offs_k // BLOCK_R, offs_k % BLOCK_R
        b_rows = b_ptr + kg[:, None] * stride_b0 + kr[:, None] * stride_r + offs_n[None, :] * stride_bn  # [KB, BN]
        # The loop visits only the busy slot groups (the i-th chosen in registers): an idle group costs nothing
        groups, live, place, n_busy = _busy_groups(meta_ptr, len_off, ranks_ptr, s, num_slots, stride_rs, stride_rt,
                                                   R_MAX, GROUP, S_PAD)
        if FP8:  # per output row of B, each token its own slot's: a token's sum holds its slot's rows only, so the
            # scale applies once, after the loop; 256 undoes _e4m3_as_f16's 2^-8. Loaded ahead: it needs no weight
            sc_ptr = tl.load(tab + 6).to(tl.pointer_type(tl.float32))
            sc = tl.load(sc_ptr + tl.maximum(tok_slot, 0)[:, None].to(tl.int64) * tl.load(tab + 7) + offs_n[None, :],
                         mask=(tok_slot >= 0)[:, None] & mask_n[None, :], other=0.0) * 256.0
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for i in range(0, n_busy):
            s0, rank = _group_at(groups, live, place, i, GROUP, BLOCK_R)
            wt = tl.load(b_rows + s0 * stride_b0, mask=(kr < rank)[:, None] & mask_n[None, :], other=0)
            mine = tok_slot[:, None, None] == (s0 + tl.arange(0, GROUP))[None, :, None]  # [BT, GROUP, 1]
            p = tl.reshape(tl.where(mine, bt[:, None, :], 0.0), (BLOCK_T, GROUP * BLOCK_R))
            acc += _expand_dot(p, wt, y_ptr.dtype.element_ty, FP32_DOT, FP8, False)
        if FP8:
            acc = acc * sc
        out = acc.to(y_ptr.dtype.element_ty)
        if ADD_INPUTS:  # like torch's y += out.to(y.dtype): add in fp32, round once; a rank-0 add adds nothing
            out = (y_in.to(tl.float32) + out.to(tl.float32)).to(out.dtype)
            touched = (tok_slot >= 0) & (tok_rank > 0)
        else:  # a replace writes its zeros, rank 0 included
            touched = tok_slot >= 0
        tl.store(y_ptrs, out, mask=touched[:, None] & mask_n[None, :])  # rows past T have slot -1: untouched

else:  # pragma: no cover - without triton the bindings refuse to launch (kernels.lora_triton._require_triton)
    _lora_expand_cols_kernel = None
