"""Launch configuration of the Triton LoRA kernels (kernels.lora_triton launches them): which variant a step takes
and the sizes of its grid and tiles, chosen by measurement on an H100 / H200 (docs/PERFORMANCE.md). `CONFIG_OVERRIDES`
forces any of them for tuning runs (benchmarks, or XPULORA_LORA_CONFIG in the environment); it is empty normally."""

from __future__ import annotations

import os

from kernels.triton_env import interpreting, triton

BLOCK_R = 16  # rank chunk: tl.dot needs every dim >= 16; ranks below 16 run one masked chunk

CONFIG_KEYS = ("fused", "cols", "run_m", "block_m", "shrink_block_k", "shrink_split_k",
               "shrink_block_r", "shrink_warps", "shrink_stages", "expand_block_n", "expand_n_iters", "expand_warps",
               "expand_stages", "cols_block_n", "cols_group", "cols_warps", "cols_stages", "fused_block_k",
               "fused_block_n", "fused_n_iters", "fused_warps", "fused_stages", "prologue", "prologue_block_k",
               "prologue_split_k", "prologue_warps")


def _env_overrides(text: str) -> dict[str, int]:
    """XPULORA_LORA_CONFIG="fused=1,expand_n_iters=4" -> {"fused": 1, "expand_n_iters": 4} (tuning runs)."""
    out: dict[str, int] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, val = item.partition("=")
        if key not in CONFIG_KEYS or not val.lstrip("-").isdigit():
            raise ValueError(f"XPULORA_LORA_CONFIG: {item!r} is not KEY=INT with KEY one of {', '.join(CONFIG_KEYS)}")
        out[key] = int(val)
    return out


CONFIG_OVERRIDES: dict[str, int] = _env_overrides(os.environ.get("XPULORA_LORA_CONFIG", ""))
"""Force a launch parameter (CONFIG_KEYS): fused (add_lora in one launch), cols (the most tokens of a column
expand, see use_cols), run_m (tokens of one slot per program: TokenGroups.block_m, set by
engine.lora.token_groups.group_tokens), block_m (the token tile a program steps through its run in), prologue (the
most tokens of a step whose shrinks join the norm / activation before their layers, see use_prologue), the kernels'
shrink_* / expand_* / cols_* / fused_* / prologue_* sizes."""


def block_r(r_max: int) -> int:
    """The split kernels' rank chunk: one covers every rank up to 64 (masked past the slot's true rank: no padding
    is read)."""
    return CONFIG_OVERRIDES.get("shrink_block_r", _one_chunk(r_max))


def _one_chunk(r_max: int) -> int:
    return min(64, max(BLOCK_R, triton.next_power_of_2(r_max)))


def block_m(run: int) -> int:
    """The token tile a split program steps through its run of `run` tokens in."""
    return min(CONFIG_OVERRIDES.get("block_m", 16), run)


def shrink_config(k: int, r_max: int = BLOCK_R) -> dict[str, int]:
    # Split K so that each program runs ~4-6 K steps (an H200 sweep: 4096 -> 8 splits, 12288 -> 16), deterministic
    # because the expand sums the splits' partials in a fixed order.
    block_k = CONFIG_OVERRIDES.get("shrink_block_k", 128 if k >= 128 else 16)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    iters = triton.cdiv(k, block_k)
    split = CONFIG_OVERRIDES.get("shrink_split_k", max(1, min(16, iters // 4)))
    split = max(1, min(split, iters))
    return dict(block_k=block_k, split_k=split, k_per_split=triton.cdiv(iters, split) * block_k,
                block_r=block_r(r_max),
                num_warps=CONFIG_OVERRIDES.get("shrink_warps", 4), num_stages=CONFIG_OVERRIDES.get("shrink_stages", 3))


def use_fused(r_max: int) -> bool:
    """add_lora in one launch (each program computes its tokens' whole shrink, then expands its columns) instead
    of two (a K-split shrink, then the expand); ranks up to 64 only (one rank chunk held in registers)."""
    return bool(CONFIG_OVERRIDES.get("fused", 0)) and r_max <= 64


def fused_config(k: int, n_max: int) -> dict[str, int]:
    block_k = CONFIG_OVERRIDES.get("fused_block_k", 128 if k >= 128 else 16)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    block_n = CONFIG_OVERRIDES.get("fused_block_n", 256 if n_max >= 256 else 64 if n_max >= 64 else 16)
    # Few, wide column groups per slice: each program re-reads its slot's A (from the cache after the first).
    n_iters = CONFIG_OVERRIDES.get("fused_n_iters", max(1, min(8, triton.cdiv(n_max, block_n))))
    return dict(block_k=block_k, block_n=block_n, n_iters=n_iters,
                num_warps=CONFIG_OVERRIDES.get("fused_warps", 4), num_stages=CONFIG_OVERRIDES.get("fused_stages", 3))


def use_cols(num_tokens: int, r_max: int) -> bool:
    """The expand as kernels.lora_cols' column kernel (every program holds all the step's tokens and streams the
    used slots' B rows) for steps of up to CONFIG_OVERRIDES["cols"] tokens (at most 64; 0: never), ranks <= 64,
    fp8 weights included. The default, 32, beat the split expand at 32 tokens for 1-32 adapters on an H100 and an
    H200 and tied at 64 (docs/PERFORMANCE.md, twenty-fourth and twenty-fifth sessions)."""
    limit = CONFIG_OVERRIDES.get("cols", 32)
    if not 0 <= limit <= 64:
        raise ValueError(f"XPULORA_LORA_CONFIG: cols is the most tokens of a column expand, 0..64; got {limit}")
    return 0 < num_tokens <= limit and r_max <= 64


def cols_expand_config(num_tokens: int, num_slots: int, n_total: int, r_max: int) -> dict[str, int]:
    """The column expand's tiles: all tokens in one tile, the whole rank in one chunk, GROUP slots per dot (64 rows
    of B: 4 slots of rank 16), block_n columns per program."""
    br = _one_chunk(r_max)
    group = CONFIG_OVERRIDES.get("cols_group", max(1, 64 // br))  # a power of 2
    # >= ~128 programs on a GPU (4096 columns 32 wide); the interpreter runs the programs one after another, so
    # there a few wide ones (the CPU tests' time: 3-6x per launch at 32 wide)
    block_n = 256 if interpreting() else 64 if n_total >= 8192 else 32
    return dict(block_t=max(16, triton.next_power_of_2(num_tokens)), block_r=br, group=group,
                s_pad=max(group, triton.next_power_of_2(num_slots)),
                block_n=CONFIG_OVERRIDES.get("cols_block_n", block_n),
                num_warps=CONFIG_OVERRIDES.get("cols_warps", 4), num_stages=CONFIG_OVERRIDES.get("cols_stages", 4))


def expand_config(n_max: int, num_tokens: int) -> dict[str, int]:
    block_n = CONFIG_OVERRIDES.get("expand_block_n", 256 if n_max >= 256 else 64 if n_max >= 64 else 16)
    n_iters = CONFIG_OVERRIDES.get("expand_n_iters", 1 if num_tokens <= 256 else 2)
    return dict(block_n=block_n, n_iters=n_iters,
                num_warps=CONFIG_OVERRIDES.get("expand_warps", 4), num_stages=CONFIG_OVERRIDES.get("expand_stages", 2))


def use_prologue(num_tokens: int, r_max: int) -> bool:
    """The shrink joined to the RMSNorm / silu-and-mul launch before a wrapped layer (kernels.lora_prologue) for
    steps of up to CONFIG_OVERRIDES["prologue"] tokens (each token reads its A rows itself; 0: never), ranks <= 64,
    fp8 weights included. The default, 32, saved 2.2-3.3 % of a 32-adapter decode step in each of four H100
    comparisons and tied with one adapter (docs/PERFORMANCE.md, twenty-seventh and twenty-ninth sessions)."""
    limit = CONFIG_OVERRIDES.get("prologue", 32)
    return 0 < num_tokens <= limit and r_max <= 64


def prologue_config(k: int, r_max: int) -> dict[str, int]:
    """The prologue kernels' K chunks (one per program, as the split shrink's K splits: ~4-6 steps of block_k) and
    tiles: [4 slices x block_r, block_k] of A per step, ~8 K elements."""
    br = max(16, triton.next_power_of_2(r_max))
    block_k = CONFIG_OVERRIDES.get("prologue_block_k", max(16, min(128, 8192 // (4 * br))))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    iters = triton.cdiv(k, block_k)
    split = max(1, min(CONFIG_OVERRIDES.get("prologue_split_k", max(1, min(16, iters // 4))), iters))
    return dict(block_k=block_k, block_r=br, split_k=split, k_per_split=triton.cdiv(iters, split) * block_k,
                num_warps=CONFIG_OVERRIDES.get("prologue_warps", 4))
