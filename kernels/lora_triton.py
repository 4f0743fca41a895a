"""Batched multi-LoRA shrink / expand in Triton (CUDA through `triton`, Intel GPUs through triton-xpu,
the CPU under TRITON_INTERPRET=1). Same semantics as kernels.reference.lora_shrink / lora_expand.

Once per step, outside graph capture, the engine groups the step's tokens by adapter slot (from the host
list: computed on the CPU, one copy to the device):

    info = prepare_lora_batch(slot_list, None, num_slots, device=dev)   # LoRABatchInfo
    # (graph replay: prepare_lora_batch(new_slots, None, num_slots, out=info) updates it in place)

and every wrapped layer then runs two launches, whatever its number of slices:

    add_lora(y, x, lora_a, lora_b, info, offsets, ranks)   # ranks: the layer's [n_slices, S] int32 tensor
    # = lora_shrink (K-split partials) + lora_expand: y[:, off_s:off_s+n_s] (+)= ...

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

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.triton_env import FLOATS, interpreting, tl, triton

__all__ = [
    "LoRABatchInfo",
    "add_lora",
    "lora_expand",
    "lora_shrink",
    "prepare_lora_batch",
    "ranks_tensor",
]

_BLOCK_R = 16  # rank chunk: tl.dot needs every dim >= 16; ranks below 16 run one masked chunk


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("the 'triton' LoRA backend needs the triton package (triton-xpu on Intel GPUs)")


# ----------------------------------------------------------------------------------------------------
# per-step token grouping


@dataclass
class LoRABatchInfo:
    """The step's tokens grouped by adapter slot, on the device (built by prepare_lora_batch).

    All int32 metadata lives in one tensor `meta` (one host-to-device copy per step); the fields below are
    views of it. Its address survives in-place updates (prepare_lora_batch(out=...)), so a captured graph
    that reads it stays valid when the next step's mapping is written into it.
    """

    meta: torch.Tensor
    """int32 [2T + 2S + 3NB]: token_slots, sorted_tokens, slot_start, slot_len, block_slot, block_start, block_end."""
    num_tokens: int
    num_slots: int
    num_blocks: int
    block_m: int
    ranks: torch.Tensor | None
    """[n_slices, S] int32 true rank of each slot per slice, when prepare_lora_batch was given ranks."""
    has_lora: bool | None
    """False: no token has an adapter (nothing to launch). None: unknown without a host sync (device input)."""

    def _part(self, i: int) -> torch.Tensor:
        t, s, nb = self.num_tokens, self.num_slots, self.num_blocks
        bounds = [0, t, 2 * t, 2 * t + s, 2 * t + 2 * s, 2 * t + 2 * s + nb, 2 * t + 2 * s + 2 * nb,
                  2 * t + 2 * s + 3 * nb]
        return self.meta[bounds[i]:bounds[i + 1]]

    @property
    def token_slots(self) -> torch.Tensor:
        """[T] adapter slot of each token, -1 for none."""
        return self._part(0)

    @property
    def sorted_tokens(self) -> torch.Tensor:
        """[T] token indices stable-sorted by slot, slot -1 tokens last."""
        return self._part(1)

    @property
    def slot_start(self) -> torch.Tensor:
        """[S] first position of each slot's tokens in sorted_tokens."""
        return self._part(2)

    @property
    def slot_len(self) -> torch.Tensor:
        """[S] number of tokens of each slot."""
        return self._part(3)

    @property
    def block_slot(self) -> torch.Tensor:
        """[NB] slot of each M-block (num_slots: an unused block of the upper-bound grid)."""
        return self._part(4)

    @property
    def block_start(self) -> torch.Tensor:
        """[NB] first row (position in sorted_tokens) of each M-block."""
        return self._part(5)

    @property
    def block_end(self) -> torch.Tensor:
        """[NB] end (exclusive) of the block's slot run in sorted_tokens; the block's rows stop there."""
        return self._part(6)


def _default_block_m(num_tokens: int) -> int:
    # Decode steps: few tokens per slot, small blocks waste little. Prefill: larger tiles for the expand.
    return 16 if num_tokens <= 256 else 32 if num_tokens <= 2048 else 64


def max_blocks(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Upper bound of sum_s cdiv(len_s, block_m) over slots with sum_s len_s <= num_tokens."""
    if num_tokens == 0:
        return 0
    return (num_tokens + block_m - 1) // block_m + min(num_slots, num_tokens)


def _schedule(slots: torch.Tensor, num_slots: int, block_m: int, num_blocks: int) -> torch.Tensor:
    """meta (int32, on slots' device) for int64 slots: sort by slot, count, cut each slot's run into blocks."""
    key = torch.where(slots >= 0, slots, num_slots)  # -1 sorts last, as slot S
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=slots.device)
    cnt = counts.scatter_add_(0, key, torch.ones_like(key))[:num_slots]  # bincount without a host sync
    start = torch.cumsum(cnt, 0) - cnt
    nblk = (cnt + block_m - 1) // block_m
    cum = torch.cumsum(nblk, 0)
    b = torch.arange(num_blocks, dtype=torch.long, device=slots.device)
    bslot = torch.searchsorted(cum, b, right=True)  # slot s owns blocks cum[s-1] <= b < cum[s]; S: unused
    s_c = bslot.clamp(max=num_slots - 1)
    bstart = start[s_c] + (b - (cum[s_c] - nblk[s_c])) * block_m
    bend = start[s_c] + cnt[s_c]
    return torch.cat([slots, order, start, cnt, bslot, bstart, bend]).to(torch.int32)


def prepare_lora_batch(token_slots: torch.Tensor | Sequence[int], ranks_per_slice: torch.Tensor |
                       Sequence[Sequence[int]] | None, num_slots: int, *, device: torch.device | None = None,
                       block_m: int | None = None, out: LoRABatchInfo | None = None) -> LoRABatchInfo:
    """info: tokens sorted by slot, per-slot start/len, the M-block schedule, ranks as a device tensor.

    token_slots: [T] ints in [-1, num_slots). From the host (a sequence or a CPU tensor; `device` says
    where the kernels run, default CPU) it is checked, `has_lora` is known, and the schedule is computed
    on the CPU and sent in ONE copy (the cheap path: a handful of tiny device ops cost more in launches).
    A device tensor is scheduled on the device with no host sync (has_lora None). ranks_per_slice:
    [n_slices][num_slots] true ranks (or an int32 tensor), kept as info.ranks for the kernels, or None
    when each layer passes its own. With `out`, everything is written into out's tensors (same T,
    num_slots and block_m) and out is returned: what a captured graph needs.
    """
    if num_slots <= 0:
        raise ValueError(f"prepare_lora_batch: num_slots must be positive, got {num_slots}")
    if not isinstance(token_slots, torch.Tensor):
        token_slots = torch.tensor(token_slots, dtype=torch.long)
    if token_slots.dim() != 1:
        raise ValueError(f"prepare_lora_batch: token_slots must be 1-D, got {tuple(token_slots.shape)}")
    slots = token_slots.to(torch.long)
    on_host = slots.device.type == "cpu"
    dev = torch.device(device) if device is not None else (out.meta.device if out is not None else slots.device)
    t = slots.numel()
    bm = block_m or (out.block_m if out is not None else _default_block_m(t))
    nb = max_blocks(t, num_slots, bm)
    has_lora: bool | None = None
    if on_host:
        bad = (slots < -1) | (slots >= num_slots)
        if bool(bad.any()):
            raise ValueError(f"prepare_lora_batch: slots {sorted(set(slots[bad].tolist()))} outside "
                             f"[-1, {num_slots})")
        has_lora = bool((slots >= 0).any())
    meta = _schedule(slots, num_slots, bm, nb)
    ranks = ranks_tensor(ranks_per_slice, num_slots, dev) if ranks_per_slice is not None else None

    if out is None:
        return LoRABatchInfo(meta=meta.to(dev), num_tokens=t, num_slots=num_slots, num_blocks=nb, block_m=bm,
                             ranks=ranks, has_lora=has_lora)
    if out.num_tokens != t or out.num_slots != num_slots or out.block_m != bm:
        raise ValueError(f"prepare_lora_batch(out=...): out holds T={out.num_tokens}, S={out.num_slots}, "
                         f"block_m={out.block_m}; got T={t}, S={num_slots}, block_m={bm}")
    out.meta.copy_(meta)
    if ranks is not None:
        if out.ranks is None or out.ranks.shape != ranks.shape:
            raise ValueError("prepare_lora_batch(out=...): ranks shape differs from out.ranks")
        out.ranks.copy_(ranks)
    out.has_lora = has_lora
    return out


_CACHE_SIZE = 1024
_rank_cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_table_cache: dict[tuple, torch.Tensor] = {}
"""Pointer tables, never evicted: captured graphs read them by address, so freeing one (an LRU over 1024
entries did, at 27B scale: 352 wrapped layers x 3 launch shapes) would leave a graph reading freed memory.
Their number is bounded by wrapped layers x launch shapes."""


def _cached(cache: OrderedDict[tuple, torch.Tensor], key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = make()
        if len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return hit


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def ranks_tensor(ranks: torch.Tensor | Sequence[Sequence[int]], num_slots: int,
                 device: torch.device) -> torch.Tensor:
    """[n_slices, num_slots] int32 ranks on `device`. Host lists are converted once and cached by value.

    A layer whose adapters change should own such a tensor and update it in place (graph capture bakes
    its address); the cached conversion of lists is for eager use.
    """
    if isinstance(ranks, torch.Tensor):
        if ranks.dim() != 2 or ranks.size(1) != num_slots:
            raise ValueError(f"ranks tensor must be [n_slices, {num_slots}], got {tuple(ranks.shape)}")
        if not _same_device(ranks.device, torch.device(device)):
            raise ValueError(f"ranks tensor on {ranks.device}, kernels run on {device}")
        if ranks.dtype != torch.int32 or not ranks.is_contiguous():
            raise ValueError("ranks tensor must be contiguous int32")
        return ranks
    rows = tuple(tuple(int(r) for r in row) for row in ranks)
    for row in rows:
        if len(row) != num_slots:
            raise ValueError(f"ranks: every slice needs {num_slots} per-slot ranks, got {len(row)}")
        if any(r < 0 for r in row):
            raise ValueError("ranks must be >= 0")
    return _cached(_rank_cache, (rows, str(device)),
                   lambda: torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(rows), num_slots))


# ----------------------------------------------------------------------------------------------------
# kernels

if triton is not None:

    @triton.jit
    def _lora_shrink_kernel(
        x_ptr, a_table_ptr, a0_ptr, buf_ptr, ranks_ptr, meta_ptr,
        sorted_off, blocks_off, num_blocks,
        K, K_PER_SPLIT, R_MAX, num_slots,
        stride_xm, stride_xk, stride_a0, stride_a1,
        stride_bk, stride_bs, stride_bm, stride_rs,
        NUM_RB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, ALIGNED: tl.constexpr, FP32_DOT: tl.constexpr,
    ):  # fmt: skip
        """buf[ks, s, t, r] = sum_{k in split ks} x[t, k] * A_s[slot[t], r, k]  (slot[t] >= 0, r < rank[s, slot[t]])."""
        pid_b = tl.program_id(0)
        pid_sr = tl.program_id(1)
        pid_k = tl.program_id(2)
        s = pid_sr // NUM_RB
        r0 = (pid_sr % NUM_RB) * BLOCK_R
        slot = tl.load(meta_ptr + blocks_off + pid_b)
        if slot >= num_slots:  # an unused block of the upper-bound grid
            return
        rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot), R_MAX)
        if r0 >= rank:  # no work on rank padding
            return
        rows = tl.load(meta_ptr + blocks_off + num_blocks + pid_b) + tl.arange(0, BLOCK_M)
        mask_m = rows < tl.load(meta_ptr + blocks_off + 2 * num_blocks + pid_b)
        tok = tl.load(meta_ptr + sorted_off + rows, mask=mask_m, other=0).to(tl.int64)
        a_ptr = tl.load(a_table_ptr + s).to(tl.pointer_type(a0_ptr.dtype.element_ty))
        if ALIGNED:  # the host checked: 16-byte aligned bases (lets the loads vectorise)
            a_ptr = tl.multiple_of(a_ptr, 16)

        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        k_lo = pid_k * K_PER_SPLIT  # K_PER_SPLIT is a multiple of BLOCK_K
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :] * stride_xk
        a_ptrs = a_ptr + slot.to(tl.int64) * stride_a0 + offs_r[None, :] * stride_a1 + offs_k[:, None]  # [BK, BR]
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
            if EVEN_K:
                xt = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
                at = tl.load(a_ptrs, mask=mask_r[None, :], other=0.0)
            else:
                mask_k = (k0 - k_lo + offs_k) < K
                xt = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                at = tl.load(a_ptrs, mask=mask_r[None, :] & mask_k[:, None], other=0.0)
            if FP32_DOT:
                acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xt, at)  # 16-bit inputs, fp32 accumulate
            x_ptrs += BLOCK_K * stride_xk
            a_ptrs += BLOCK_K
        out = buf_ptr + pid_k * stride_bk + s * stride_bs + tok[:, None] * stride_bm + offs_r[None, :]
        tl.store(out, acc, mask=mask_m[:, None] & mask_r[None, :])

    @triton.jit
    def _lora_expand_kernel(
        y_ptr, buf_ptr, b_table_ptr, b0_ptr, ranks_ptr, meta_ptr,
        sorted_off, blocks_off, num_blocks,
        R_MAX, num_slots,
        stride_ym, stride_yn, stride_bk, stride_bs, stride_bm, stride_bn, stride_rs,
        NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, ADD_INPUTS: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, N_ITERS: tl.constexpr, BLOCK_R: tl.constexpr, B_RANK_MAJOR: tl.constexpr,
        ALIGNED: tl.constexpr, FP32_DOT: tl.constexpr,
    ):  # fmt: skip
        """y[t, off_s + n] (+)= sum_{r < rank[s, slot[t]]} sum_ks buf[ks, s, t, r] * B_s[slot[t], n, r]; slot[t] >= 0"""
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        slot = tl.load(meta_ptr + blocks_off + pid_b)
        if slot >= num_slots:
            return
        # Which slice owns this column group: table row s = (ptr, stride0, n_s, offset_s, first group of s,
        # rank stride of s when B is stored rank-major).
        s = 0
        for i in tl.static_range(1, NUM_SLICES):
            s += (pid_n >= tl.load(b_table_ptr + i * 6 + 4)).to(tl.int32)
        tab = b_table_ptr + s * 6
        rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot), R_MAX)
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

        rows = tl.load(meta_ptr + blocks_off + num_blocks + pid_b) + tl.arange(0, BLOCK_M)
        mask_m = rows < tl.load(meta_ptr + blocks_off + 2 * num_blocks + pid_b)
        tok = tl.load(meta_ptr + sorted_off + rows, mask=mask_m, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        buf_rows = buf_ptr + s * stride_bs + tok[:, None] * stride_bm + offs_r[None, :]  # [BM, BR]
        b_slot = b_ptr + slot.to(tl.int64) * stride_b0 + offs_r[:, None] * stride_r  # [BR, 1]
        y_rows = y_ptr + tok[:, None] * stride_ym

        for j in range(N_ITERS):  # several column blocks per program: the slot/token lookups are paid once
            offs_n = n_first + j * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_s
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):  # only the slot's true rank
                mask_r = (r0 + offs_r) < rank
                bt = tl.load(buf_rows + r0, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
                for kk in tl.static_range(1, SPLIT_K):  # the shrink's K splits, summed in a fixed order
                    bt += tl.load(buf_rows + kk * stride_bk + r0, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
                wt = tl.load(b_slot + r0 * stride_r + offs_n[None, :] * stride_bn,
                             mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BR, BN]
                if FP32_DOT:
                    acc += tl.dot(bt, wt.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(bt.to(wt.dtype), wt)  # shrink result rounded to B's 16-bit dtype, fp32 accumulate
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
expand_block_n, expand_n_iters, expand_warps, expand_stages (tuning scripts only; empty in normal use)."""


def _shrink_config(k: int) -> dict[str, int]:
    # Split K so that each program runs ~4-6 K steps (an H200 sweep: 4096 -> 8 splits, 12288 -> 16), deterministic
    # because the expand sums the splits' partials in a fixed order.
    block_k = CONFIG_OVERRIDES.get("shrink_block_k", 128 if k >= 128 else 16)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    iters = triton.cdiv(k, block_k)
    split = CONFIG_OVERRIDES.get("shrink_split_k", max(1, min(16, iters // 4)))
    split = max(1, min(split, iters))
    return dict(block_k=block_k, split_k=split, k_per_split=triton.cdiv(iters, split) * block_k,
                block_r=CONFIG_OVERRIDES.get("shrink_block_r", _BLOCK_R),
                num_warps=CONFIG_OVERRIDES.get("shrink_warps", 4), num_stages=CONFIG_OVERRIDES.get("shrink_stages", 3))


def _expand_config(n_max: int, num_tokens: int) -> dict[str, int]:
    block_n = CONFIG_OVERRIDES.get("expand_block_n", 256 if n_max >= 256 else 64 if n_max >= 64 else 16)
    n_iters = CONFIG_OVERRIDES.get("expand_n_iters", 1 if num_tokens <= 256 else 2)
    return dict(block_n=block_n, n_iters=n_iters,
                num_warps=CONFIG_OVERRIDES.get("expand_warps", 4), num_stages=CONFIG_OVERRIDES.get("expand_stages", 2))


# ----------------------------------------------------------------------------------------------------
# bindings


def _ptr_table(tensors: Sequence[torch.Tensor], rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """int64 [len(rows) * len(rows[0])] on device, cached by its contents (pointers, strides, offsets)."""
    key = (tuple(map(tuple, rows)), str(device))
    hit = _table_cache.get(key)
    if hit is None:
        hit = _table_cache[key] = torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1)
    return hit


def _check_info(info: LoRABatchInfo, t: int, device: torch.device) -> None:
    if info.num_tokens != t:
        raise ValueError(f"LoRA batch info is for {info.num_tokens} tokens, the tensors have {t}")
    if not _same_device(info.meta.device, device):
        raise ValueError(f"LoRA batch info on {info.meta.device}, tensors on {device}")


def _layer_ranks(info: LoRABatchInfo, ranks: torch.Tensor | Sequence[Sequence[int]] | None, n_slices: int,
                 device: torch.device) -> torch.Tensor:
    r = info.ranks if ranks is None else ranks_tensor(ranks, info.num_slots, device)
    if r is None:
        raise ValueError("no ranks: pass the layer's ranks or build the info with ranks_per_slice")
    if r.size(0) != n_slices:
        raise ValueError(f"ranks has {r.size(0)} slices, the layer has {n_slices}")
    return r


def _nothing_to_do(info: LoRABatchInfo) -> bool:
    return info.has_lora is False or info.num_blocks == 0


def _meta_offsets(info: LoRABatchInfo) -> tuple[int, int, int]:
    """(sorted_tokens offset, block arrays offset, num_blocks) inside info.meta."""
    t, s = info.num_tokens, info.num_slots
    return t, 2 * t + 2 * s, info.num_blocks


def _check_shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], info: LoRABatchInfo) -> None:
    if x.dim() != 2 or not lora_a:
        raise ValueError(f"lora_shrink: x must be [T, K] and lora_a non-empty, got x {tuple(x.shape)}")
    a0 = lora_a[0]
    for a in lora_a:
        if a.dim() != 3 or a.shape != a0.shape or a.stride() != a0.stride() or a.dtype != a0.dtype:
            raise ValueError(f"lora_shrink: every A must match [S, r_max, K] = {tuple(a0.shape)} (same strides, "
                             f"dtype); got {tuple(a.shape)} {a.stride()} {a.dtype}")
        if a.stride(-1) != 1 or a.device != x.device:
            raise ValueError("lora_shrink: A must be contiguous in K and on x's device")
    if x.size(1) != a0.size(2):
        raise ValueError(f"lora_shrink: A has {a0.size(2)} inputs, x has {x.size(1)}")
    if x.dtype not in FLOATS or a0.dtype not in FLOATS:
        raise TypeError(f"lora_shrink: unsupported dtypes x {x.dtype}, A {a0.dtype}")
    if info.num_slots != a0.size(0):
        raise ValueError(f"lora_shrink: info has {info.num_slots} slots, A has {a0.size(0)}")
    _check_info(info, x.size(0), x.device)


def _launch_shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], info: LoRABatchInfo, r: torch.Tensor,
                   buf: torch.Tensor, cfg: dict[str, int]) -> None:
    """buf [split_k, n_slices, T, r_max] float32 (last dim contiguous) <- per-split partial shrink results."""
    a0 = lora_a[0]
    num_slots, r_max, k = a0.shape
    table = _ptr_table(lora_a, [[a.data_ptr()] for a in lora_a], x.device)
    num_rb = triton.cdiv(r_max, cfg["block_r"])
    sorted_off, blocks_off, nb = _meta_offsets(info)
    grid = (nb, len(lora_a) * num_rb, cfg["split_k"])
    _lora_shrink_kernel[grid](
        x, table, a0, buf, r, info.meta,
        sorted_off, blocks_off, nb,
        k, cfg["k_per_split"], r_max, num_slots,
        x.stride(0), x.stride(1), a0.stride(0), a0.stride(1),
        buf.stride(0), buf.stride(1), buf.stride(2), r.stride(0),
        NUM_RB=num_rb, BLOCK_M=info.block_m, BLOCK_R=cfg["block_r"], BLOCK_K=cfg["block_k"],
        EVEN_K=k % cfg["block_k"] == 0, ALIGNED=all(a.data_ptr() % 16 == 0 for a in lora_a),
        FP32_DOT=interpreting() or x.dtype == torch.float32 or x.dtype != a0.dtype,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def lora_shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], info: LoRABatchInfo,
                ranks: torch.Tensor | Sequence[Sequence[int]] | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """buf[s, t, :r] = x[t] @ A_s[slot[t], :r].T, r = ranks[s][slot[t]]; one launch for all slices.

    x [T, K]; lora_a[s] [S, r_max, K] (same shape for every slice, last dim contiguous) -> float32
    [n_slices, T, r_max]. Entries not computed (slot -1 rows, columns past a slot's rank) are zero, as in
    the reference. (add_lora skips this function's zero fill and K-split sum: its expand reads the
    per-split partials directly.)
    """
    _require_triton()
    _check_shrink(x, lora_a, info)
    n_slices, (_, r_max, k) = len(lora_a), lora_a[0].shape
    r = _layer_ranks(info, ranks, n_slices, x.device)
    if out is None:
        out = torch.zeros(n_slices, x.size(0), r_max, dtype=torch.float32, device=x.device)
    elif out.shape != (n_slices, x.size(0), r_max) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"lora_shrink: out must be float32 {(n_slices, x.size(0), r_max)}, got {tuple(out.shape)}")
    else:
        out.zero_()
    if _nothing_to_do(info) or r_max == 0:
        return out
    cfg = _shrink_config(k)
    if cfg["split_k"] == 1:
        _launch_shrink(x, lora_a, info, r, out.unsqueeze(0), cfg)
    else:
        parts = torch.zeros(cfg["split_k"], *out.shape, dtype=torch.float32, device=x.device)
        _launch_shrink(x, lora_a, info, r, parts, cfg)
        torch.sum(parts, dim=0, out=out)  # fixed-order reduction: deterministic
    return out


def _launch_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: Sequence[torch.Tensor], info: LoRABatchInfo,
                   offsets: Sequence[int], r: torch.Tensor, add_inputs: bool) -> None:
    """buf [split_k, n_slices, T, r_max] float32, summed over split_k in order inside the kernel."""
    b0 = lora_b[0]
    rank_major = _b_rank_major(lora_b)
    cfg = _expand_config(max(b.size(1) for b in lora_b), y.size(0))
    block_n, n_iters = cfg["block_n"], cfg["n_iters"]
    rows, first, aligned = [], 0, True
    for b, off in zip(lora_b, offsets):
        rows.append([b.data_ptr(), b.stride(0), b.size(1), int(off), first, b.stride(2)])
        first += triton.cdiv(b.size(1), block_n * n_iters)
        aligned = (aligned and b.data_ptr() % 16 == 0 and b.stride(0) % 8 == 0 and b.size(1) % 8 == 0
                   and off % 8 == 0 and b.stride(2 if rank_major else 1) % 8 == 0)
    table = _ptr_table(lora_b, rows, y.device)
    sorted_off, blocks_off, nb = _meta_offsets(info)
    _lora_expand_kernel[(nb, first)](
        y, buf, table, b0, r, info.meta,
        sorted_off, blocks_off, nb,
        b0.size(-1), b0.size(0),
        y.stride(0), y.stride(1), buf.stride(0), buf.stride(1), buf.stride(2), b0.stride(1), r.stride(0),
        NUM_SLICES=len(lora_b), SPLIT_K=buf.size(0), ADD_INPUTS=bool(add_inputs), BLOCK_M=info.block_m,
        BLOCK_N=block_n, N_ITERS=n_iters, BLOCK_R=_BLOCK_R, B_RANK_MAJOR=rank_major, ALIGNED=aligned,
        FP32_DOT=interpreting() or b0.dtype == torch.float32,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def _check_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: Sequence[torch.Tensor], info: LoRABatchInfo,
                  offsets: Sequence[int]) -> None:
    if y.dim() != 2 or buf.dim() != 3 or not lora_b:
        raise ValueError(f"lora_expand: y must be [T, N], buf [n_slices, T, r_max]; got {tuple(y.shape)}, "
                         f"{tuple(buf.shape)}")
    b0 = lora_b[0]
    n_slices, num_slots, r_max = len(lora_b), b0.size(0), b0.size(-1)
    if len(offsets) != n_slices:
        raise ValueError("lora_expand: one offset per slice")
    if buf.shape != (n_slices, y.size(0), r_max):
        raise ValueError(f"lora_expand: shrink result {tuple(buf.shape)} does not match {n_slices} slices of "
                         f"LoRA B (rank dim {r_max}) for {y.size(0)} tokens")
    if buf.dtype != torch.float32 or buf.device != y.device or buf.stride(-1) != 1:
        raise ValueError("lora_expand: buf must be float32 on y's device, contiguous in its last dim")
    for b, off in zip(lora_b, offsets):
        if b.dim() != 3 or b.size(0) != num_slots or b.size(-1) != r_max or b.dtype != b0.dtype:
            raise ValueError(f"lora_expand: every B must be [{num_slots}, n_s, {r_max}] of {b0.dtype}, "
                             f"got {tuple(b.shape)} {b.dtype}")
        if b.device != y.device:
            raise ValueError("lora_expand: B must be on y's device")
        if off < 0 or off + b.size(1) > y.size(1):
            raise ValueError(f"lora_expand: slice [{off}, {off + b.size(1)}) outside y of width {y.size(1)}")
    if y.dtype not in FLOATS or b0.dtype not in FLOATS:
        raise TypeError(f"lora_expand: unsupported dtypes y {y.dtype}, B {b0.dtype}")
    if info.num_slots != num_slots:
        raise ValueError(f"lora_expand: info has {info.num_slots} slots, B has {num_slots}")
    _b_rank_major(lora_b)
    _check_info(info, y.size(0), y.device)


def _b_rank_major(lora_b: Sequence[torch.Tensor]) -> bool:
    """True when every B [S, n_s, r_max] is a view of rank-major storage [S, r_max, n_s] (n contiguous),
    False when every one is r-contiguous with one row stride; anything else is refused."""
    if all(b.stride(1) == 1 and b.stride(2) >= b.size(1) for b in lora_b):
        return True
    if all(b.stride(2) == 1 and b.stride(1) == lora_b[0].stride(1) for b in lora_b):
        return False
    raise ValueError("lora_expand: every B [S, n_s, r_max] must be contiguous in r with one row stride, or a "
                     "transposed view of [S, r_max, n_s] storage (n contiguous)")


def lora_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: Sequence[torch.Tensor], info: LoRABatchInfo,
                offsets: Sequence[int], ranks: torch.Tensor | Sequence[Sequence[int]] | None = None,
                add_inputs: bool = True) -> torch.Tensor:
    """y[t, off_s:off_s+n_s] (+)= buf[s, t, :r] @ B_s[slot[t], :, :r].T for slot[t] >= 0; one launch.

    y [T, N]; buf float32 [n_slices, T, r_max] with r_max = B.size(-1) exactly; lora_b[s] [S, n_s, r_max]
    (n_s may differ per slice), either r-contiguous or, faster, a transposed view of rank-major storage
    [S, r_max, n_s] (rank rows are then read whole and a small rank's padding is never fetched). Rows with
    slot -1 are untouched. Returns y (in place).
    """
    _require_triton()
    _check_expand(y, buf, lora_b, info, offsets)
    r = _layer_ranks(info, ranks, len(lora_b), y.device)
    if not _nothing_to_do(info):
        _launch_expand(y, buf.unsqueeze(0), lora_b, info, offsets, r, add_inputs)
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
             info: LoRABatchInfo, offsets: Sequence[int], ranks: torch.Tensor | Sequence[Sequence[int]] | None = None,
             add_inputs: bool = True) -> torch.Tensor:
    """y[:, off_s:off_s+n_s] (+)= (x @ A_s[slot].T)[:, :r] @ B_s[slot][:, :r].T per slice: two launches in all,
    none when info.has_lora is False. Returns y (in place)."""
    _require_triton()
    if len(lora_a) != len(lora_b):
        raise ValueError("add_lora: one A and one B per slice")
    if _nothing_to_do(info):
        return y
    _check_shrink(x, lora_a, info)
    n_slices, (_, r_max, k) = len(lora_a), lora_a[0].shape
    if lora_b[0].size(-1) != r_max:
        raise ValueError(f"add_lora: A rank dim {r_max} != B rank dim {lora_b[0].size(-1)}")
    buf_shape = (n_slices, x.size(0), r_max)
    cfg = _shrink_config(k)
    # Per-split partials, summed in order by the expand; it reads only computed entries (active rows,
    # columns below the rank), so no zero fill.
    buf = torch.empty(cfg["split_k"], *buf_shape, dtype=torch.float32, device=x.device)
    _check_expand(y, buf[0], lora_b, info, offsets)
    r = _layer_ranks(info, ranks, n_slices, x.device)
    _launch_shrink(x, lora_a, info, r, buf, cfg)
    _launch_expand(y, buf, lora_b, info, offsets, r, add_inputs)
    return y
