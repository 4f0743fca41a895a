"""W4A16 for decode batches (1-64 rows) on tensor cores, in CUDA C compiled at run time (NVRTC): backend "cuda_mma".

    w = repack_cuda(qweight)              # [N/16, K/64, 32, 4] int32, once at load (round trip: unpack_cuda)
    y = cuda_mm(x2, w, meta, G, bias)     # y = x2 @ W + bias, meta = kernels.int4_mma.mma_meta(scales, zq)

    y[t, n] = sum_g s[g, n] * sum_{k in g} x[t, k] * (u(k, n) - zq(g, n))

Why CUDA C: the Triton kernels stop at 1.3-1.8 TB/s, bound by issuing their own instructions (the unpack and a
wgmma they cannot overlap, docs/PERFORMANCE.md's Nsight section). Here the weights go straight from global memory
to the registers an MMA reads: the output features are the MMA's 16 rows and the tokens its 8 columns
(`mma.sync m16n8k16`: y^T = W^T x^T, so one row wastes 7 columns, not 15 rows), and each lane's 16-byte load is
exactly its A fragments for 64 k (4 MMAs of 16): a nibble pair becomes a bf16 pair of 128 + u by one LOP3
(0x4300 | u), minus 128 + zq by one bf16x2 FMA, exact. Per 64 k the 4 x (8 tokens) partials are scaled in fp32
(the scale never rounds the weight). The k order inside 64 is permuted so that each lane's x is 16 consecutive
k (two 16-byte loads per 8 tokens); the repack applies the same order to the weights.
A block is one to four 16-feature tiles (x read once for all of them); its warps split K (warp w takes the w-th
run of UNROLL chunks of 64 k in each round of WARPS * UNROLL) and sum their partials through shared memory in
warp order: the same bits on every run. With K also split over the grid (CudaMmaConfig.splits), each block does
that for its share of K and parks fp32 sums in a workspace; the last block of a feature column adds them in split
order (kernels.int4_triton's counters), so wide blocks still make a full grid.
The CUDA backend is chosen by engine/device.py (tuned candidates on CUDA only); XPU keeps the Triton kernels.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.int4_cuda_src import SOURCE
from kernels.int4_triton import _MAX_TILES, _counters
from kernels.kernel_cache import cache_dir, cache_lock

log = logging.getLogger(__name__)

__all__ = ["CUDA_MAX_ROWS", "CudaMmaConfig", "available", "cuda_config", "cuda_mm", "repack_cuda", "unpack_cuda"]

CUDA_MAX_ROWS = 64
CHUNK_K = 64
COMPILE_LOCK = ".int4_cuda.lock"
TOKEN_TILES = (1, 2, 4, 8)
"""Compiled token-tile counts (8 rows each): a launch takes the smallest that holds its rows."""
SHAPES = ((16, 1, 1), (16, 2, 1), (8, 1, 1), (8, 2, 1), (4, 2, 1), (4, 1, 1), (16, 1, 2), (8, 1, 2), (4, 1, 2),
          (8, 1, 4), (4, 1, 4))
"""(warps, chunks per warp per round, feature tiles per block) compiled for each token-tile count whose registers
allow it (_shapes_for): the shapes that won or came within 3 % at some M <= 32 on the four Qwen3-8B shapes on an
H200 (docs/PERFORMANCE.md, sixteenth session; 4-chunk unrolls, 2-tile unrolls and 4-tile blocks never did), and
(4, 1, 1), the one that fits K = 256 and won at M = 64; 4-tile blocks again for K split over the grid (SPLITS)."""


@dataclass(frozen=True)
class CudaMmaConfig:
    """Launch shape: warps per block (each a share of its split of K), chunks of 64 k each warp loads before it
    computes, tiles of 16 output features per block (each x fragment feeds that many MMAs), and splits of K over
    the grid (blocks of one feature column sum through an fp32 workspace: more blocks when the columns are few)."""

    warps: int
    unroll: int
    tiles: int = 1
    splits: int = 1

    def fits(self, m: int, k: int, n: int) -> bool:
        mt, chunks = _token_tiles(m), k // CHUNK_K
        return (mt is not None and (self.warps, self.unroll, self.tiles) in _shapes_for(mt) and self.splits >= 1
                and chunks % self.splits == 0 and (chunks // self.splits) % (self.warps * self.unroll) == 0
                and n % (16 * self.tiles) == 0)


def _token_tiles(m: int) -> int | None:
    return next((t for t in TOKEN_TILES if 8 * t >= m), None)


def _shapes_for(mt: int) -> tuple[tuple[int, int, int], ...]:
    """Registers per lane (accumulators 4 NT MT, one tile's partials 4 MT, x 8 U MT, weights 4 U NT) within ~136,
    and the partials' shared memory (WARPS NT MT x 512 bytes) within 32 KB."""
    return tuple((w, u, nt) for w, u, nt in SHAPES
                 if 4 * nt * mt + 4 * mt + 8 * u * mt + 4 * u * nt <= 136 and w * nt * mt <= 64)


@functools.lru_cache(maxsize=4096)
def cuda_config(m: int, k: int, n: int) -> CudaMmaConfig | None:
    """The untuned shape: one feature tile per block, 8 warps with as many chunks each as fit the rows' registers
    and K (None: none fits)."""
    mt = _token_tiles(m)
    if mt is None:
        return None
    for w, u, nt in sorted(_shapes_for(mt), key=lambda s: (s[2] != 1, s[0] != 8, -s[1])):
        if CudaMmaConfig(w, u, nt).fits(m, k, n):
            return CudaMmaConfig(w, u, nt)
    return None


TUNED: dict[int, tuple[tuple[int, int, int] | tuple[int, int, int, int], ...]] = {
    1: ((16, 1, 1), (16, 2, 1), (8, 2, 1), (8, 1, 1), (4, 2, 1)),
    2: ((16, 1, 1), (16, 2, 1), (8, 2, 1), (8, 1, 2), (4, 1, 2)),
    4: ((8, 1, 1), (8, 2, 1), (16, 1, 1), (8, 1, 2), (4, 1, 2), (8, 1, 2, 2)),
    8: ((4, 1, 1), (8, 1, 1)),
}
"""Per token-tile count, the launch shapes (warps, unroll, tiles[, splits of K]) the tuner times: those that won, or
came within 3 % of the best, at some M of that tile count on the four Qwen3-8B shapes (H200, sixteenth session).
K split over the grid won once in the nineteenth session's sweep of every compiled shape (H200, `run_h200.sh
split18`): 2-tile blocks with K in 2 on 12288 x 4096 at M = 32, 20.7 us against 24.7; at M = 16 and 64 no split
shape came within 3 %, so only that one is timed."""


SPLITS = (2, 4)
"""Splits of K over the grid the compiled shapes are swept with (benchmarks/bench_int4.py, the CUDA tests): from 16
rows the kernel is bound by loading x, once per block for its 16-64 features, and wider blocks alone leave too few
blocks (sixteenth session); split, a block reads x for its share of K only, so wider blocks keep the grid full."""


def tuner_variants(m: int, k: int, n: int) -> list[CudaMmaConfig]:
    """The launch shapes kernels.int4_tune times at m rows: TUNED's that fit, else the first compiled one that does
    (every K the backend takes has one: (4, 1, 1))."""
    mt = _token_tiles(m)
    if mt is None:
        return []
    out = [CudaMmaConfig(*s) for s in TUNED[mt] if CudaMmaConfig(*s).fits(m, k, n)]
    return out or variants(m, k, n)[:1]


def variants(m: int, k: int, n: int) -> list[CudaMmaConfig]:
    """Every compiled launch shape that fits m rows, K and N, whole and with K split in SPLITS (benchmarks/bench_int4.py
    sweeps them all)."""
    mt = _token_tiles(m)
    if mt is None:
        return []
    return [c for c in (CudaMmaConfig(*s, splits=sp) for sp in (1, *SPLITS) for s in _shapes_for(mt))
            if c.fits(m, k, n)]


# ----------------------------------------------------------------------------------------------------
# layout


def repack_cuda(qweight: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """GPTQ qweight [K/8, N] int32 -> [N/16, K/64, 32, 4] int32 (same device), `chunk` output features at a time.

    Lane l = 4 g + t of 16-feature tile b, chunk c, word j holds k0 = 64 c + 16 t + 4 j .. k0 + 3 of features
    n = 16 b + g (h = 0) and n + 8 (h = 1): nibble 4 (kk & 1) + 2 (kk >> 1) + h is W[k0 + kk, n + 8 h], so that
    (word >> 4p) & 0x000F000F holds A fragment p of MMA j (rows g / g + 8, k slots 2t, 2t + 1 / 2t + 8, 2t + 9).
    """
    from kernels.reference import unpack_int4_rows

    kw, n = qweight.shape
    k = kw * 8
    if k % CHUNK_K or n % 16:
        raise ValueError(f"the cuda_mma int4 layout needs K % 64 == 0 and N % 16 == 0, got K={k}, N={n}")
    out = torch.empty(n // 16, k // CHUNK_K, 32, 4, dtype=torch.int32, device=qweight.device)
    chunk = max(16, chunk - chunk % 16)
    for n0 in range(0, n, chunk):
        nc = min(chunk, n - n0)
        u = unpack_int4_rows(qweight[:, n0:n0 + nc]).to(torch.int32)  # [K, nc]
        u = u.view(k // CHUNK_K, 4, 4, 2, 2, nc // 16, 2, 8)  # c, t, j, kk_hi, kk_lo, b, h, g  (kk = 2 hi + lo)
        u = u.permute(5, 0, 7, 1, 2, 4, 3, 6)  # b, c, g, t, j, kk_lo, kk_hi, h: nibble 4 lo + 2 hi + h
        u = u.reshape(nc // 16, k // CHUNK_K, 32, 4, 8)
        w = u[..., 0]
        for p in range(1, 8):
            w = w | (u[..., p] << (4 * p))  # int32 shifts wrap: bit 31 set for nibble 7 >= 8
        out[n0 // 16:(n0 + nc) // 16] = w
    return out


def unpack_cuda(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of repack_cuda: [N/16, K/64, 32, 4] int32 -> GPTQ qweight [K/8, N] int32."""
    from kernels.reference import pack_int4_rows

    nb, kc = packed.shape[:2]
    w = packed.to(torch.int64) & 0xFFFFFFFF
    u = (w.unsqueeze(-1) >> torch.arange(0, 32, 4, device=w.device)) & 0xF  # b, c, lane, j, p
    u = u.view(nb, kc, 8, 4, 4, 2, 2, 2)  # b, c, g, t, j, kk_lo, kk_hi, h
    u = u.permute(1, 3, 4, 6, 5, 0, 7, 2).reshape(kc * CHUNK_K, nb * 16)  # c, t, j, hi, lo | b, h, g
    return pack_int4_rows(u)


# ----------------------------------------------------------------------------------------------------
# kernel (its CUDA C: kernels.int4_cuda_src; compiled and loaded through engine.device)



def _kernel_name(mt: int, warps: int, unroll: int, tiles: int) -> str:
    return f"w4a16_cuda_mt{mt}_w{warps}_u{unroll}_n{tiles}"


def _source() -> str:
    entries = []
    for mt in TOKEN_TILES:
        for w, u, nt in _shapes_for(mt):
            entries.append(
                f'extern "C" __global__ void __launch_bounds__({32 * w}) {_kernel_name(mt, w, u, nt)}('
                "const uint4* qw, const u32* meta, const u16* x, const u16* bias, u16* y, float* ws, int* cnt, "
                "int M, int K, int N, int x_stride, int group_shift, int has_bias, int splits) { "
                f"w4a16<{mt}, {nt}, {w}, {u}>(qw, meta, x, bias, y, ws, cnt, M, K, N, x_stride, group_shift, "
                "has_bias, splits); }")
    return SOURCE + "\n".join(entries) + "\n"


def _names() -> list[str]:
    return [_kernel_name(mt, *s) for mt in TOKEN_TILES for s in _shapes_for(mt)]


def supports_group(group_size: int) -> bool:
    """A group is a power-of-two number of 64-k chunks (the kernel finds a chunk's group by a shift)."""
    chunks = group_size // CHUNK_K
    return group_size % CHUNK_K == 0 and chunks & (chunks - 1) == 0


@functools.cache
def available() -> bool:
    """The kernels can be compiled and run here (engine.device.cuda_compiler_available)."""
    from engine.device import cuda_compiler_available  # here: the engine package imports this one's users

    return cuda_compiler_available()


def _binary(index: int, names: list[str]) -> bytes:
    """The compiled module, kept beside the tuned int4 tables (kernels.kernel_cache.cache_dir, keyed by source,
    architecture, CUDA and torch) so that every later process of this machine loads it in milliseconds."""
    import hashlib

    from engine.device import cuda_build_key

    src = _source()
    key = hashlib.sha256(f"{src}|{cuda_build_key(index)}".encode()).hexdigest()[:24]
    where = cache_dir()
    path = where / f"int4_cuda_{key}.bin" if where is not None else None
    if path is not None and path.is_file():
        return path.read_bytes()
    with cache_lock(COMPILE_LOCK):  # one process compiles; the others wait and load its file
        if path is not None and path.is_file():
            return path.read_bytes()
        return _compile_and_keep(src, names, index, path)


def _compile_and_keep(src: str, names: list[str], index: int, path: pathlib.Path | None) -> bytes:
    from engine.device import compile_cuda

    binary = compile_cuda(src, names[0], index)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(binary)
            tmp.replace(path)  # atomic: a concurrent process reads the old file or the whole new one
        except OSError as e:  # the cache is never required
            log.warning("int4 cuda_mma: could not keep the compiled kernels in %s (%s)", path.parent, e)
    return binary


@functools.cache
def _module(index: int) -> dict[str, Callable[..., None]]:
    """All launch shapes, compiled in one program and loaded once per process and device."""
    from engine.device import load_cuda

    names = _names()
    return load_cuda(_binary(index, names), names, index)


def compile_for(device: torch.device) -> None:
    """Compile (and load) the kernels before a graph capture needs them (device: a CUDA tensor's device)."""
    assert device.index is not None, "a GPU tensor's device has an index"
    _module(device.index)


def cuda_mm(x2: torch.Tensor, qw: torch.Tensor, meta: torch.Tensor, group_size: int, bias: torch.Tensor | None,
            config: CudaMmaConfig | None = None) -> torch.Tensor:
    """y = x2 @ W + bias, x2 [M, K] bf16 with M <= CUDA_MAX_ROWS; qw from repack_cuda, meta from mma_meta."""
    m, k = x2.shape
    nb, kc = qw.shape[:2]
    n = nb * 16
    if x2.dtype != torch.bfloat16:
        raise TypeError(f"int4 cuda_mma computes in bfloat16, got {x2.dtype}")
    if kc * CHUNK_K != k or tuple(qw.shape[2:]) != (32, 4) or qw.dtype != torch.int32:
        raise ValueError(f"int4 cuda_mma: weight {tuple(qw.shape)} {qw.dtype} does not match K={k}")
    if not supports_group(group_size) or tuple(meta.shape) != (k // group_size, n):
        raise ValueError(f"int4 cuda_mma: group {group_size} / meta {tuple(meta.shape)} do not fit K={k}, N={n}")
    if m > CUDA_MAX_ROWS:
        raise ValueError(f"int4 cuda_mma takes at most {CUDA_MAX_ROWS} rows, got {m}")
    c = config or cuda_config(m, k, n)
    if c is None or not c.fits(m, k, n):
        raise ValueError(f"int4 cuda_mma config {c} does not fit M={m}, K={k}, N={n}")
    if x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:  # the kernel loads x 16 bytes at a time
        x2 = x2.clone(memory_format=torch.contiguous_format)
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x2.device)
    mt = _token_tiles(m)
    assert mt is not None
    assert x2.device.index is not None, "a GPU tensor's device has an index"
    kernel = _module(x2.device.index)[_kernel_name(mt, c.warps, c.unroll, c.tiles)]
    shift = (group_size // CHUNK_K).bit_length() - 1
    # splits > 1: fp32 partials in ws, summed in split order by each column's last block (kernels.int4_triton's
    # counters: every launch leaves them at zero, and no two split launches run at once on the engine's one stream)
    if c.splits > 1 and nb // c.tiles > _MAX_TILES:
        raise ValueError(f"int4 cuda_mma: {nb // c.tiles} feature columns exceed the {_MAX_TILES} split-K counters")
    ws = torch.empty((c.splits, m, n), dtype=torch.float32, device=x2.device) if c.splits > 1 else y
    kernel(grid=(nb // c.tiles, c.splits, 1), block=(32 * c.warps, 1, 1),
           args=[qw, meta, x2, bias if bias is not None else y, y, ws, _counters(x2.device), m, k, n, x2.stride(0),
                 shift, int(bias is not None), c.splits])
    return y
