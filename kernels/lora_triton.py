"""Batched multi-LoRA shrink / expand in Triton (CUDA through `triton`, Intel GPUs through triton-xpu, the CPU under
TRITON_INTERPRET=1). Same semantics as kernels.reference.lora_shrink / lora_expand. The kernels are in kernels.
lora_kernels (and lora_fused, lora_cols); their sizes are kernels.lora_config's; this module checks shapes and
launches.

The launchers read the step's tokens grouped by adapter slot (`TokenGroups`, built once per step by engine.lora.punica
from the host slot list, rewritten in place for graph replay) and each layer's true ranks as an int32 device tensor
[n_slices, S] (any strides); a wrapped layer runs two launches whatever its number of slices: add_lora = lora_shrink
(K-split partials) + lora_expand (split, or use_cols' column expand): y[:, off_s:off_s+n_s] (+)= ..., or one with
the fused variant (use_fused: each program computes its tokens' whole shrink, then expands it).

Layouts: A_s [S, r_max, K] (K contiguous; the engine's slices are column ranges of one [S, r_max, n*K]
store). B_s [S, n_s, r_max] either r-contiguous or, ~2x faster for small ranks (measured on an H200), a
transposed view of rank-major storage [S, r_max, n_s]: then a rank-r adapter reads r whole rows and never
touches its padding. fp8 e4m3 A / B come with float32 scales, per rank row of A and per output row of B.

Work is scheduled in runs of tokens that share one slot (tokens sorted by slot, each slot's run cut into runs of
TokenGroups.block_m tokens, which a program steps through in tiles of 16); slot -1 tokens belong to no run. Each
program reads its slot's true rank from a device tensor and computes only rank columns below it. The split shrink
cuts K into a fixed number of ranges whose fp32 partials the expand sums in a fixed order; every element is written
by exactly one program (no atomics): results are deterministic. Grids are sized from upper bounds (tokens, slots,
r_max, output widths), so no launch needs a host sync and all of them can be captured in a graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.lora_checks import check_expand, check_ranks, check_shrink
from kernels.lora_cols import _lora_expand_cols_kernel
from kernels.lora_config import (
    CONFIG_KEYS,
    CONFIG_OVERRIDES,
    block_m,
    block_r,
    cols_expand_config,
    expand_config,
    fused_config,
    shrink_config,
    use_cols,
    use_fused,
)
from kernels.lora_fused import _lora_fused_kernel
from kernels.lora_kernels import _lora_expand_kernel, _lora_shrink_kernel
from kernels.lora_tables import _b_table, _ptr_table, _raw
from kernels.triton_env import interpreting, triton

__all__ = ["CONFIG_KEYS", "CONFIG_OVERRIDES", "TokenGroups", "add_lora", "expand_partials", "lora_expand",
           "lora_shrink", "max_blocks"]

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


# ----------------------------------------------------------------------------------------------------
# bindings


def nothing_to_do(info: TokenGroups) -> bool:
    """No token of the step has an adapter (known on the host), or no block to run."""
    return info.has_lora is False or info.num_blocks == 0


def _meta_offsets(info: TokenGroups) -> tuple[int, int, int]:
    """(sorted_tokens offset, block arrays offset, num_blocks) inside info.meta."""
    return info.num_tokens, 2 * info.num_tokens + 2 * info.num_slots, info.num_blocks


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
        NUM_RB=num_rb, BLOCK_M=block_m(info.block_m), BLOCK_R=cfg["block_r"], BLOCK_K=cfg["block_k"],
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
    computed (slot -1 rows, columns past a slot's rank) are zero, as in the reference (add_lora skips the zero
    fill and the K-split sum: its expand reads the partials).
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
    if nothing_to_do(info) or r_max == 0:
        return out
    cfg = shrink_config(k, r_max)
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
    b0 = _raw(lora_b[0])
    if use_cols(y.size(0), b0.size(-1)):
        return _launch_cols(y, buf, lora_b, info, offsets, r, add_inputs, b_scales)
    cfg = expand_config(max(b.size(1) for b in lora_b), y.size(0))
    block_n, n_iters = cfg["block_n"], cfg["n_iters"]
    table, groups, aligned, rank_major = _b_table(lora_b, offsets, b_scales, block_n * n_iters, y.device)
    sorted_off, blocks_off, nb = _meta_offsets(info)
    _lora_expand_kernel[(nb, groups)](
        y, buf, table, b0, r, info.meta,
        sorted_off, blocks_off, nb, info.block_m,
        b0.size(-1), b0.size(0),
        y.stride(0), y.stride(1), buf.stride(0), buf.stride(1), buf.stride(2), b0.stride(1), r.stride(0), r.stride(1),
        NUM_SLICES=len(lora_b), SPLIT_K=buf.size(0), ADD_INPUTS=bool(add_inputs), BLOCK_M=block_m(info.block_m),
        BLOCK_N=block_n, N_ITERS=n_iters, BLOCK_R=block_r(b0.size(-1)), B_RANK_MAJOR=rank_major, ALIGNED=aligned,
        FP32_DOT=interpreting() or b0.dtype == torch.float32 or (fp8 and y.dtype == torch.float32), FP8=fp8,
        ONE_CHUNK=block_r(b0.size(-1)) >= b0.size(-1), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def _launch_cols(y: torch.Tensor, buf: torch.Tensor, lora_b: Sequence[torch.Tensor], info: TokenGroups,
                 offsets: Sequence[int], r: torch.Tensor, add_inputs: bool,
                 b_scales: Sequence[torch.Tensor] | None) -> None:
    """_launch_expand as kernels.lora_cols (use_cols): program = one column block of one slice."""
    fp8 = lora_b[0].dtype == torch.float8_e4m3fn
    b0, t, s = _raw(lora_b[0]), info.num_tokens, info.num_slots
    cfg = cols_expand_config(t, s, sum(b.size(1) for b in lora_b), b0.size(-1))
    table, groups, aligned, rank_major = _b_table(lora_b, offsets, b_scales, cfg["block_n"], y.device)
    _lora_expand_cols_kernel[(groups,)](
        y, buf, table, b0, r, info.meta, t, 2 * t + s, b0.size(-1), s,
        y.stride(0), y.stride(1), buf.stride(0), buf.stride(1), buf.stride(2), b0.stride(1), r.stride(0), r.stride(1),
        NUM_SLICES=len(lora_b), SPLIT_K=buf.size(0), ADD_INPUTS=bool(add_inputs), BLOCK_T=cfg["block_t"],
        BLOCK_N=cfg["block_n"], BLOCK_R=cfg["block_r"], GROUP=cfg["group"], S_PAD=cfg["s_pad"],
        B_RANK_MAJOR=rank_major, ALIGNED=aligned,
        FP32_DOT=interpreting() or b0.dtype == torch.float32 or (fp8 and y.dtype == torch.float32), FP8=fp8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def _launch_fused(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
                  info: TokenGroups, offsets: Sequence[int], r: torch.Tensor, add_inputs: bool,
                  a_scales: Sequence[torch.Tensor] | None, b_scales: Sequence[torch.Tensor] | None) -> None:
    """Shrink and expand in one launch (r_max <= 64): program (token run, column group of one slice)."""
    fp8 = lora_a[0].dtype == torch.float8_e4m3fn
    a0, b0 = _raw(lora_a[0]), _raw(lora_b[0])
    num_slots, r_max, k = a0.shape
    cfg = fused_config(k, max(b.size(1) for b in lora_b))
    sc_a = a_scales if a_scales is not None else lora_a
    a_table = _ptr_table([[a.data_ptr(), sc.data_ptr()] for a, sc in zip(lora_a, sc_a)], x.device)
    b_table, groups, aligned, rank_major = _b_table(lora_b, offsets, b_scales, cfg["block_n"] * cfg["n_iters"],
                                                    y.device)
    sorted_off, blocks_off, nb = _meta_offsets(info)
    s0 = sc_a[0]
    _lora_fused_kernel[(nb, groups)](
        y, x, a_table, a0, b_table, b0, r, info.meta,
        sorted_off, blocks_off, nb, info.block_m,
        k, r_max, num_slots,
        x.stride(0), x.stride(1), a0.stride(0), a0.stride(1), s0.stride(0), s0.stride(1),
        y.stride(0), y.stride(1), b0.stride(1), r.stride(0), r.stride(1),
        NUM_SLICES=len(lora_b), ADD_INPUTS=bool(add_inputs), BLOCK_M=block_m(info.block_m), BLOCK_N=cfg["block_n"],
        N_ITERS=cfg["n_iters"], BLOCK_R=block_r(r_max), BLOCK_K=cfg["block_k"], EVEN_K=k % cfg["block_k"] == 0,
        B_RANK_MAJOR=rank_major, ALIGNED=aligned and all(a.data_ptr() % 16 == 0 for a in lora_a),
        FP32_DOT=interpreting() or x.dtype == torch.float32 or (not fp8 and (x.dtype != a0.dtype or
                                                                            b0.dtype == torch.float32)),
        FP8=fp8, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
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
    if not nothing_to_do(info):
        _launch_expand(y, buf.unsqueeze(0), lora_b, info, offsets, r, add_inputs, b_scales)
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
             info: TokenGroups, offsets: Sequence[int], ranks: torch.Tensor, add_inputs: bool = True,
             a_scales: Sequence[torch.Tensor] | None = None,
             b_scales: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """y[:, off_s:off_s+n_s] (+)= (x @ A_s[slot].T)[:, :r] @ B_s[slot][:, :r].T per slice: one launch (the fused
    kernel, see use_fused) or two (shrink, expand) in all, none when info.has_lora is False. fp8 A and B take
    their scales (see lora_shrink / lora_expand). Returns y (in place)."""
    _require_triton()
    if len(lora_a) != len(lora_b):
        raise ValueError("add_lora: one A and one B per slice")
    if nothing_to_do(info):
        return y
    check_shrink(x, lora_a, info, a_scales)
    n_slices, r_max = len(lora_a), lora_a[0].size(1)
    if lora_b[0].size(-1) != r_max:
        raise ValueError(f"add_lora: A rank dim {r_max} != B rank dim {lora_b[0].size(-1)}")
    check_expand(y, None, lora_b, info, offsets, b_scales)  # the shrink's buffer is made to fit
    r = check_ranks(ranks, n_slices, info.num_slots, x.device)
    if use_fused(r_max):
        _launch_fused(y, x, lora_a, lora_b, info, offsets, r, add_inputs, a_scales, b_scales)
    else:
        buf = _shrink_partials(x, lora_a, info, r, a_scales)
        _launch_expand(y, buf, lora_b, info, offsets, r, add_inputs, b_scales)
    return y


def _shrink_partials(x: torch.Tensor, lora_a: Sequence[torch.Tensor], info: TokenGroups, r: torch.Tensor,
                     a_scales: Sequence[torch.Tensor] | None) -> torch.Tensor:
    """buf[ks, s, t, :r] = the K split ks of x[t] @ A_s[slot[t], :r].T on checked inputs (r: check_ranks' view):
    float32 [split_k, n_slices, T, r_max], written only where computed (rows with an adapter, columns below their
    slot's rank; the rest is garbage, never read by expand_partials)."""
    _, r_max, k = lora_a[0].shape
    cfg = shrink_config(k, r_max)
    buf = torch.empty(cfg["split_k"], len(lora_a), x.size(0), r_max, dtype=torch.float32, device=x.device)
    _launch_shrink(x, lora_a, info, r, buf, cfg, a_scales)
    return buf


def expand_partials(y: torch.Tensor, buf: torch.Tensor, lora_b: Sequence[torch.Tensor], info: TokenGroups,
                    offsets: Sequence[int], ranks: torch.Tensor, add_inputs: bool = True,
                    b_scales: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """add_lora's second half: y[t, off_s:+n_s] (+)= (sum_ks buf[ks, s, t, :r]) @ B_s[slot[t], :, :r].T (buf from
    _shrink_partials or kernels.lora_prologue). Returns y."""
    _require_triton()
    check_expand(y, buf[0], lora_b, info, offsets, b_scales)
    r = check_ranks(ranks, len(lora_b), info.num_slots, y.device)
    _launch_expand(y, buf, lora_b, info, offsets, r, add_inputs, b_scales)
    return y
