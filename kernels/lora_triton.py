"""Batched multi-LoRA shrink / expand in Triton (CUDA through `triton`, Intel GPUs through triton-xpu,
the CPU under TRITON_INTERPRET=1). Same semantics as kernels.reference.lora_shrink / lora_expand.

Once per step, outside graph capture, the engine groups the step's tokens by adapter slot on the device:

    info = prepare_lora_batch(token_slots, ranks_per_slice, num_slots)   # LoRABatchInfo
    # (graph replay: prepare_lora_batch(new_slots, None, num_slots, out=info) updates it in place)

and every wrapped layer then runs two launches, whatever its number of slices:

    buf = lora_shrink(x, lora_a, info, ranks)           # [n_slices, T, r_max] float32
    lora_expand(y, buf, lora_b, info, offsets, ranks)    # y[:, off_s:off_s+n_s] (+)= ...

Work is scheduled in M-blocks of tokens that share one slot (tokens sorted by slot, each slot's run cut
into blocks of BLOCK_M rows); slot -1 tokens belong to no block. Each program reads its slot's true rank
from a device tensor and computes only rank columns below it (shrink: rank chunks at or past the rank
exit; expand: the reduction loops over rank in BLOCK_R chunks up to the rank). Every output element is
written by exactly one program (no atomics, no split-K): results are deterministic. Grids are sized from
upper bounds (tokens, slots, r_max, output widths), so no launch needs a host sync and all of them can
be captured in a graph.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

try:  # guarded: importing this module must work where triton is absent
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

__all__ = [
    "LoRABatchInfo",
    "add_lora",
    "lora_expand",
    "lora_shrink",
    "prepare_lora_batch",
    "ranks_tensor",
    "triton_available",
]

_BLOCK_R = 16  # rank chunk: tl.dot needs every dim >= 16; ranks below 16 run one masked chunk
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    return triton is not None


def _interpreting() -> bool:
    # Triton's CPU interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584): there we
    # dot in fp32, exact for 16-bit inputs, so the interpreter tests stay meaningful.
    return os.environ.get("TRITON_INTERPRET") == "1"


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
        token_slots = torch.tensor([int(s) for s in token_slots], dtype=torch.long)
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
_table_cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def _cached(cache: OrderedDict[tuple, torch.Tensor], key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = make()
        if len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return hit


def ranks_tensor(ranks: torch.Tensor | Sequence[Sequence[int]], num_slots: int,
                 device: torch.device) -> torch.Tensor:
    """[n_slices, num_slots] int32 ranks on `device`. Host lists are converted once and cached by value.

    A layer whose adapters change should own such a tensor and update it in place (graph capture bakes
    its address); the cached conversion of lists is for eager use.
    """
    if isinstance(ranks, torch.Tensor):
        if ranks.dim() != 2 or ranks.size(1) != num_slots:
            raise ValueError(f"ranks tensor must be [n_slices, {num_slots}], got {tuple(ranks.shape)}")
        if ranks.device != torch.device(device):
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
        x_ptr, a_table_ptr, a0_ptr, buf_ptr, ranks_ptr,
        sorted_ptr, bslot_ptr, bstart_ptr, bend_ptr,
        K, R_MAX, num_slots,
        stride_xm, stride_xk, stride_a0, stride_a1,
        stride_bs, stride_bm, stride_br, stride_rs,
        NUM_RB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, FP32_DOT: tl.constexpr,
    ):  # fmt: skip
        """buf[s, t, r] = sum_k x[t, k] * A_s[slot[t], r, k]  for slot[t] >= 0, r < min(ranks[s, slot[t]], r_max)."""
        pid_b = tl.program_id(0)
        pid_sr = tl.program_id(1)
        s = pid_sr // NUM_RB
        r0 = (pid_sr % NUM_RB) * BLOCK_R
        slot = tl.load(bslot_ptr + pid_b)
        if slot >= num_slots:  # an unused block of the upper-bound grid
            return
        rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot), R_MAX)
        if r0 >= rank:  # no work on rank padding
            return
        rows = tl.load(bstart_ptr + pid_b) + tl.arange(0, BLOCK_M)
        mask_m = rows < tl.load(bend_ptr + pid_b)
        tok = tl.load(sorted_ptr + rows, mask=mask_m, other=0).to(tl.int64)
        a_ptr = tl.load(a_table_ptr + s).to(tl.pointer_type(a0_ptr.dtype.element_ty))

        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :] * stride_xk
        a_ptrs = a_ptr + slot.to(tl.int64) * stride_a0 + offs_r[None, :] * stride_a1 + offs_k[:, None]  # [BK, BR]
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                xt = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
                at = tl.load(a_ptrs, mask=mask_r[None, :], other=0.0)
            else:
                mask_k = (k0 + offs_k) < K
                xt = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                at = tl.load(a_ptrs, mask=mask_r[None, :] & mask_k[:, None], other=0.0)
            if FP32_DOT:
                acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xt, at)  # 16-bit inputs, fp32 accumulate
            x_ptrs += BLOCK_K * stride_xk
            a_ptrs += BLOCK_K
        out = buf_ptr + s * stride_bs + tok[:, None] * stride_bm + offs_r[None, :] * stride_br
        tl.store(out, acc, mask=mask_m[:, None] & mask_r[None, :])

    @triton.jit
    def _lora_expand_kernel(
        y_ptr, buf_ptr, b_table_ptr, b0_ptr, ranks_ptr,
        sorted_ptr, bslot_ptr, bstart_ptr, bend_ptr,
        R_MAX, num_slots,
        stride_ym, stride_yn, stride_bs, stride_bm, stride_br, stride_b1, stride_rs,
        NUM_SLICES: tl.constexpr, ADD_INPUTS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, FP32_DOT: tl.constexpr,
    ):  # fmt: skip
        """y[t, off_s + n] (+)= sum_{r < ranks[s, slot[t]]} buf[s, t, r] * B_s[slot[t], n, r]  for slot[t] >= 0."""
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        slot = tl.load(bslot_ptr + pid_b)
        if slot >= num_slots:
            return
        # Which slice owns this column block: table row s = (ptr, stride0, n_s, offset_s, first block of s).
        s = 0
        for i in tl.static_range(1, NUM_SLICES):
            s += (pid_n >= tl.load(b_table_ptr + i * 5 + 4)).to(tl.int32)
        tab = b_table_ptr + s * 5
        rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot), R_MAX)
        if ADD_INPUTS and rank == 0:  # adds nothing (a replace still writes its zeros)
            return
        b_ptr = tl.load(tab).to(tl.pointer_type(b0_ptr.dtype.element_ty))
        stride_b0 = tl.load(tab + 1)
        n_s = tl.load(tab + 2)
        y_off = tl.load(tab + 3)
        offs_n = (pid_n - tl.load(tab + 4)) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_s

        rows = tl.load(bstart_ptr + pid_b) + tl.arange(0, BLOCK_M)
        mask_m = rows < tl.load(bend_ptr + pid_b)
        tok = tl.load(sorted_ptr + rows, mask=mask_m, other=0).to(tl.int64)

        offs_r = tl.arange(0, BLOCK_R)
        buf_ptrs = buf_ptr + s * stride_bs + tok[:, None] * stride_bm + offs_r[None, :] * stride_br  # [BM, BR]
        w_ptrs = b_ptr + slot.to(tl.int64) * stride_b0 + offs_n[None, :] * stride_b1 + offs_r[:, None]  # [BR, BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):  # only the slot's true rank
            mask_r = (r0 + offs_r) < rank
            bt = tl.load(buf_ptrs, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0)
            if FP32_DOT:
                acc += tl.dot(bt.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(bt.to(wt.dtype), wt)  # shrink result rounded to B's 16-bit dtype, fp32 accumulate
            buf_ptrs += BLOCK_R * stride_br
            w_ptrs += BLOCK_R

        y_ptrs = y_ptr + tok[:, None] * stride_ym + (y_off + offs_n)[None, :] * stride_yn
        mask = mask_m[:, None] & mask_n[None, :]
        out = acc.to(y_ptr.dtype.element_ty)
        if ADD_INPUTS:  # like torch's y += out.to(y.dtype): add in fp32, round once
            out = (tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32) + out.to(tl.float32)).to(out.dtype)
        tl.store(y_ptrs, out, mask=mask)


# ----------------------------------------------------------------------------------------------------
# bindings


def _ptr_table(tensors: Sequence[torch.Tensor], rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """int64 [len(rows) * len(rows[0])] on device, cached by (pointers, shapes, strides, rows)."""
    key = (tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors), tuple(map(tuple, rows)),
           str(device))
    return _cached(_table_cache, key, lambda: torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1))


def _check_info(info: LoRABatchInfo, t: int, device: torch.device) -> None:
    if info.num_tokens != t:
        raise ValueError(f"LoRA batch info is for {info.num_tokens} tokens, the tensors have {t}")
    if info.sorted_tokens.device != device:
        raise ValueError(f"LoRA batch info on {info.sorted_tokens.device}, tensors on {device}")


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


def lora_shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], info: LoRABatchInfo,
                ranks: torch.Tensor | Sequence[Sequence[int]] | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """buf[s, t, :r] = x[t] @ A_s[slot[t], :r].T, r = ranks[s][slot[t]]; one launch for all slices.

    x [T, K]; lora_a[s] [S, r_max, K] (same shape for every slice, last dim contiguous) -> float32
    [n_slices, T, r_max]. Entries the kernel does not compute (slot -1 rows, columns past a slot's rank)
    keep out's contents: zeros when out is None (the reference's result), whatever out held otherwise
    (the expand never reads them).
    """
    _require_triton()
    if x.dim() != 2 or not lora_a:
        raise ValueError(f"lora_shrink: x must be [T, K] and lora_a non-empty, got x {tuple(x.shape)}")
    a0 = lora_a[0]
    n_slices, (num_slots, r_max, k) = len(lora_a), a0.shape
    for a in lora_a:
        if a.dim() != 3 or a.shape != a0.shape or a.stride() != a0.stride() or a.dtype != a0.dtype:
            raise ValueError(f"lora_shrink: every A must match [S, r_max, K] = {tuple(a0.shape)} (same strides, "
                             f"dtype); got {tuple(a.shape)} {a.stride()} {a.dtype}")
        if a.stride(-1) != 1 or a.device != x.device:
            raise ValueError("lora_shrink: A must be contiguous in K and on x's device")
    if x.size(1) != k:
        raise ValueError(f"lora_shrink: A has {k} inputs, x has {x.size(1)}")
    if x.dtype not in _FLOATS or a0.dtype not in _FLOATS:
        raise TypeError(f"lora_shrink: unsupported dtypes x {x.dtype}, A {a0.dtype}")
    if info.num_slots != num_slots:
        raise ValueError(f"lora_shrink: info has {info.num_slots} slots, A has {num_slots}")
    t = x.size(0)
    _check_info(info, t, x.device)
    r = _layer_ranks(info, ranks, n_slices, x.device)
    if out is None:
        out = torch.zeros(n_slices, t, r_max, dtype=torch.float32, device=x.device)
    elif out.shape != (n_slices, t, r_max) or out.dtype != torch.float32:
        raise ValueError(f"lora_shrink: out must be float32 {(n_slices, t, r_max)}, got {tuple(out.shape)}")
    if _nothing_to_do(info) or r_max == 0:
        return out

    table = _ptr_table(lora_a, [[a.data_ptr()] for a in lora_a], x.device)
    block_k = 128 if k >= 128 else max(16, triton.next_power_of_2(k))
    num_rb = triton.cdiv(r_max, _BLOCK_R)
    grid = (info.num_blocks, n_slices * num_rb)
    _lora_shrink_kernel[grid](
        x, table, a0, out, r,
        info.sorted_tokens, info.block_slot, info.block_start, info.block_end,
        k, r_max, num_slots,
        x.stride(0), x.stride(1), a0.stride(0), a0.stride(1),
        out.stride(0), out.stride(1), out.stride(2), r.stride(0),
        NUM_RB=num_rb, BLOCK_M=info.block_m, BLOCK_R=_BLOCK_R, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        FP32_DOT=_interpreting() or x.dtype == torch.float32 or x.dtype != a0.dtype,
    )  # fmt: skip
    return out


def lora_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: Sequence[torch.Tensor], info: LoRABatchInfo,
                offsets: Sequence[int], ranks: torch.Tensor | Sequence[Sequence[int]] | None = None,
                add_inputs: bool = True) -> torch.Tensor:
    """y[t, off_s:off_s+n_s] (+)= buf[s, t, :r] @ B_s[slot[t], :, :r].T for slot[t] >= 0; one launch.

    y [T, N]; buf float32 [n_slices, T, r_max] with r_max = B.size(-1) exactly; lora_b[s] [S, n_s, r_max]
    (n_s may differ per slice, last dim contiguous). Rows with slot -1 are untouched. Returns y (in place).
    """
    _require_triton()
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
    if buf.dtype != torch.float32 or buf.device != y.device:
        raise ValueError("lora_expand: buf must be float32 on y's device")
    for b, off in zip(lora_b, offsets):
        if b.dim() != 3 or b.size(0) != num_slots or b.size(-1) != r_max or b.dtype != b0.dtype:
            raise ValueError(f"lora_expand: every B must be [{num_slots}, n_s, {r_max}] of {b0.dtype}, "
                             f"got {tuple(b.shape)} {b.dtype}")
        if b.stride(-1) != 1 or b.stride(1) != b0.stride(1) or b.device != y.device:
            raise ValueError("lora_expand: B must be contiguous in the rank dim (same row stride) on y's device")
        if off < 0 or off + b.size(1) > y.size(1):
            raise ValueError(f"lora_expand: slice [{off}, {off + b.size(1)}) outside y of width {y.size(1)}")
    if y.dtype not in _FLOATS or b0.dtype not in _FLOATS:
        raise TypeError(f"lora_expand: unsupported dtypes y {y.dtype}, B {b0.dtype}")
    if info.num_slots != num_slots:
        raise ValueError(f"lora_expand: info has {info.num_slots} slots, B has {num_slots}")
    _check_info(info, y.size(0), y.device)
    r = _layer_ranks(info, ranks, n_slices, y.device)
    if _nothing_to_do(info):
        return y

    block_n = 128 if max(b.size(1) for b in lora_b) >= 128 else 32
    rows, first = [], 0
    for b, off in zip(lora_b, offsets):
        rows.append([b.data_ptr(), b.stride(0), b.size(1), int(off), first])
        first += triton.cdiv(b.size(1), block_n)
    table = _ptr_table(lora_b, rows, y.device)
    grid = (info.num_blocks, first)
    _lora_expand_kernel[grid](
        y, buf, table, b0, r,
        info.sorted_tokens, info.block_slot, info.block_start, info.block_end,
        r_max, num_slots,
        y.stride(0), y.stride(1), buf.stride(0), buf.stride(1), buf.stride(2), b0.stride(1), r.stride(0),
        NUM_SLICES=n_slices, ADD_INPUTS=bool(add_inputs),
        BLOCK_M=info.block_m, BLOCK_N=block_n, BLOCK_R=_BLOCK_R,
        FP32_DOT=_interpreting() or b0.dtype == torch.float32,
    )  # fmt: skip
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
             info: LoRABatchInfo, offsets: Sequence[int], ranks: torch.Tensor | Sequence[Sequence[int]] | None = None,
             add_inputs: bool = True) -> torch.Tensor:
    """y[:, off_s:off_s+n_s] (+)= (x @ A_s[slot].T)[:, :r] @ B_s[slot][:, :r].T per slice: two launches in all,
    none when info.has_lora is False. Returns y (in place)."""
    if len(lora_a) != len(lora_b):
        raise ValueError("add_lora: one A and one B per slice")
    if _nothing_to_do(info):
        return y
    for a, b in zip(lora_a, lora_b):
        if a.size(1) != b.size(-1):
            raise ValueError(f"add_lora: A rank dim {a.size(1)} != B rank dim {b.size(-1)}")
    # The expand reads only computed entries (active rows, columns below the rank): no zero fill needed.
    buf = torch.empty(len(lora_a), x.size(0), lora_a[0].size(1), dtype=torch.float32, device=x.device)
    buf = lora_shrink(x, lora_a, info, ranks, out=buf)
    return lora_expand(y, buf, lora_b, info, offsets, ranks, add_inputs)
