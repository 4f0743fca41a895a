"""The int4 dispatch chosen by measurement: per layer shape, the fastest checked path for each bucket of rows.

    table = tune(shape, backends, timer, device_name)   # timed here, or read from the cache file
    path = table.path_for(rows)                          # a pure function of the row count (graph-safe)

A path is a backend of kernels.int4 with a launch shape (`triton_mma[64x16x128 s4 w4 st3]`), or `dequant` (one
fused dequantization into a transient dense weight, then the dense GEMM). Each bucket of rows (1, 2, 3-4, ...,
257-512, above) is timed at its largest row count on random weights of the layer's shape, several copies in
turn so that they come from device memory rather than the last call's cache, with the caller's timer (the
engine's times graph replays where the device has graphs: what decode steps run). The table is logged and kept
in a JSON file keyed by device name, torch and triton versions, dtype, shape, group, zero-point kind and the
candidate backends ($XPULORA_KERNEL_CACHE_DIR, else $XDG_CACHE_HOME/xpulora, else ~/.cache/xpulora;
XPULORA_KERNEL_CACHE_DIR=off keeps nothing). The cache is never required: unreadable or unwritable means timing.
Processes that start together time a shape once: the first holds that shape's lock file (cache_lock), the others
wait and read its table.
Only backends that passed the start-up check vs the reference (kernels.checks) are ever candidates, and each launch
shape's output is checked against the fp32 reference (TOLERANCE) before it is timed: a wrong one is never picked.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path as FsPath

import torch

from kernels.int4 import (
    GemvConfig,
    Int4Layout,
    MmaConfig,
    PreparedInt4,
    dequant_mm,
    gemv_config,
    int4_mm,
    mma_config,
    prepare_int4,
    triton_config,
)
from kernels.int4_cuda import CUDA_MAX_ROWS
from kernels.int4_cuda import tuner_variants as cuda_variants
from kernels.int4_mma import split_for
from kernels.int4_table import DEQUANT, Path, Shape, TunedTable, table_from_json
from kernels.kernel_cache import cache_dir, cache_lock, read_json, update_json
from kernels.reference import dequant_int4
from kernels.registry import mismatch
from kernels.triton_env import triton

log = logging.getLogger(__name__)

BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 512)
"""Upper row counts of the tuned buckets; rows above the last form one more bucket, timed at LARGE_M. 192: the
mixed-step graphs of 160 and 192 tokens (64 decodes and a prompt or two) are 3 token tiles of 64 but 4 at 256."""
LARGE_M = 1024
CACHE_FILE = "int4_dispatch.json"
TABLE_VERSION = 10
"""Part of the cache key: bump it when the kernels or their candidates change, so that old tables are timed again."""
TIMED_BYTES = 256 * 2**20
"""Weight copies timed in turn add up to at least this (several times a large GPU's last-level cache)."""

TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4), torch.float16: (8e-3, 8e-3), torch.bfloat16: (3e-2, 2e-2)}
"""(rtol, atol relative to max|ref|) of an int4 output against the fp32 dequantized reference: the start-up check's
(kernels.checks) and the tuner's own check of every launch shape it times. A wrong nibble, zero point or scale
moves outputs by ~10 % of their scale."""

Timer = Callable[[Sequence[Callable[[], object]]], float]
"""µs per call of the given calls (each on its own weight copy), timed as the engine will run them."""


# ----------------------------------------------------------------------------------------------------
# candidates

def _mma_variants(m: int, k: int, n: int, g: int, fold: bool = False) -> list[MmaConfig]:
    """The rule's launch shape and a few neighbours (wider N tile, half / double the K split, more stages); a
    token tile of 128 for large M; with `fold` (16-bit activations), up to 16 rows, the rule's shape and its double
    split also with the zero points off the accumulator (kernels.int4_mma's FOLD: 1-20 % faster there on the H200,
    slower at 32 and 64 rows on every shape measured, docs/PERFORMANCE.md)."""
    base = mma_config(m, k, n, g)
    out = [base, replace(base, block_n=128, split_k=max(1, base.split_k // 2)), replace(base, num_stages=4),
           replace(base, split_k=base.split_k * 2)]
    if m > 64:
        # Token tiles of 128 (each weight tile unpacked once for up to 128 rows) with 64 output features, K split
        # for their own grid and 2x / 4x less: on the H200 these won the 128- and 256-row buckets on 7 of the 8
        # (Qwen3-8B shape, bucket) points measured, with half of split_for's split where it had one to halve;
        # 128 x 128 tiles (4 or 8 warps, K tiles of 64 or 128, any split) won none (docs/PERFORMANCE.md, ninth
        # session).
        split = split_for(m, k, n, base.block_n, 128, base.block_k)
        out += [replace(base, block_t=128, split_k=max(1, split >> i)) for i in range(3)]
        out.append(replace(base, block_t=128, block_n=128, num_warps=8))
    elif fold and m <= 16:
        out += [replace(base, fold=True), replace(base, split_k=base.split_k * 2, fold=True)]
    return list(dict.fromkeys(c for c in out if c.fits(m, k, n, g)))


def _gemv_variants(k: int, n: int, g: int) -> list[GemvConfig]:
    """The one-row kernel's rule shape and neighbours: wider and narrower N tiles, half / double the K split, 8 warps,
    and the rule without the register prefetch."""
    base = gemv_config(1, k, n, g)
    out = [base, replace(base, block_n=256), replace(base, block_n=64), replace(base, split_k=base.split_k * 2),
           replace(base, split_k=max(1, base.split_k // 2)), replace(base, block_n=256, num_warps=8),
           replace(base, prefetch=False)]
    return list(dict.fromkeys(c for c in out if c.fits(1, k, n, g)))


def candidates(backends: Sequence[str], m: int, layout: Int4Layout, dtype: torch.dtype) -> list[Path]:
    """The paths timed at m rows with activations of `dtype`. The memory-bound Triton kernels are not timed past
    256 rows (their cost grows with M; dequant + GEMM wins there), the one-row kernel (triton_gemv) only at one row,
    the CUDA one (cuda_mma: kernels.int4_cuda.tuner_variants) up to its 64 rows, dequant not below 8 rows (it writes
    the whole dense weight)."""
    k, n, g = layout.in_features, layout.out_features, layout.group_size
    out: list[Path] = []
    for b in backends:
        if b == "triton_mma" and m <= 256:
            out.extend(Path(b, c) for c in _mma_variants(m, k, n, g, fold=dtype != torch.float32))
        elif b == "triton" and m <= 256:
            out.append(Path(b, triton_config(m, k, n, g)))
        elif b == "triton_gemv" and m == 1:
            out.extend(Path(b, c) for c in _gemv_variants(k, n, g))
        elif b == "cuda_mma" and m <= CUDA_MAX_ROWS:
            out.extend(Path(b, c) for c in cuda_variants(m, k, n))
        elif (b == DEQUANT and m >= 8) or b not in ("triton_mma", "triton", "triton_gemv", "cuda_mma", DEQUANT):
            out.append(Path(b))
    return out


# ----------------------------------------------------------------------------------------------------
# timing


def _random_checkpoint(layout: Int4Layout, sym: bool, device: torch.device,
                       gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k, n, g = layout.in_features, layout.out_features, layout.group_size
    qw = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen, dtype=torch.int32)
    zero = 0x77777777 if layout.zero_offset else 0x88888888 - 2**32  # every zero point 8
    qz = (torch.full((k // g, n // 8), zero, dtype=torch.int32) if sym else
          torch.randint(-2**31, 2**31 - 1, (k // g, n // 8), generator=gen, dtype=torch.int32))
    sc = ((torch.rand(k // g, n, generator=gen) + 0.5) * 1e-3).half()
    return qw.to(device), qz.to(device), sc.to(device)


def _call(path: Path, x: torch.Tensor, w: PreparedInt4) -> Callable[[], object]:
    if path.backend == DEQUANT:
        lay = w.layout
        return lambda: dequant_mm(x, w.weight, w.zeros, w.scales, lay.group_size, lay.zero_offset)  # type: ignore[arg-type]
    wc = replace(w, config=path.config)
    return lambda: int4_mm(x, wc)


def _references(ckpt: tuple[torch.Tensor, torch.Tensor, torch.Tensor], lay: Int4Layout,
                xs: dict[int, torch.Tensor], chunk: int = 4096) -> dict[int, torch.Tensor]:
    """x @ W in fp32 for each x, W dequantized from ckpt `chunk` output features at a time (a whole fp32 copy of a
    large layer is hundreds of MB)."""
    qw, qz, sc = ckpt
    n = lay.out_features
    out = {m: torch.empty(m, n, dtype=torch.float32, device=x.device) for m, x in xs.items()}
    for n0 in range(0, n, chunk):
        n1 = min(n, n0 + chunk)
        w = dequant_int4(qw[:, n0:n1], qz[:, n0 // 8:n1 // 8], sc[:, n0:n1], lay.group_size, lay.zero_offset,
                         dtype=torch.float32)
        for m, x in xs.items():
            out[m][:, n0:n1] = x.float() @ w
    return out


def measure(shape: Shape, backends: Sequence[str], timer: Timer, device: torch.device,
            buckets: Sequence[int] = (*BUCKETS, LARGE_M)) -> TunedTable:
    """Time every candidate path at each bucket's row count; the fastest per bucket, neighbours merged."""
    lay = shape.layout
    k, n = lay.in_features, lay.out_features
    copies = max(2, min(16, -(-TIMED_BYTES // (k * n // 2))))
    gen = torch.Generator().manual_seed(0)
    ckpts = [_random_checkpoint(lay, shape.sym, device, gen) for _ in range(copies)]
    xs = {m: torch.randn(m, k, generator=gen).to(shape.dtype).to(device) for m in buckets}
    refs = _references(ckpts[0], lay, xs)
    times: dict[int, dict[Path, float]] = {m: {} for m in buckets}
    for b in backends:  # one backend's copies at a time
        name = "triton" if b == DEQUANT else b  # dequant reads the checkpoint layout, as the triton backend keeps it
        try:
            ws = [prepare_int4(*c, lay, name, dtype=shape.dtype) for c in ckpts]  # type: ignore[arg-type]
        except Exception as e:  # its layout or kernels cannot be made here (e.g. the CUDA C does not compile)
            log.warning("int4 tuning %s: backend %s could not prepare its weights (%s: %s); not a candidate",
                        shape.key(), b, type(e).__name__, str(e)[:200])
            continue
        for m in buckets:
            for path in candidates([b], m, lay, shape.dtype):
                try:
                    # every launch shape's output is checked before it is timed: the start-up check saw only
                    # each backend's rule, and the table may pick any of its shapes
                    err = mismatch(_call(path, xs[m], ws[0])(), refs[m], TOLERANCE[shape.dtype])  # type: ignore[arg-type]
                    if err is not None:
                        log.warning("int4 tuning %s: %s at %d rows differs from the reference (%s); not a candidate",
                                    shape.key(), path.name, m, err)
                        continue
                    times[m][path] = timer([_call(path, xs[m], w) for w in ws])
                except Exception as e:  # a launch shape that does not run here (resources) is no candidate
                    log.warning("int4 tuning %s: %s at %d rows failed (%s: %s)", shape.key(), path.name, m,
                                type(e).__name__, str(e)[:200])
        del ws
    chosen: list[tuple[int, Path]] = []
    timings: list[tuple[int, tuple[tuple[str, float], ...]]] = []
    for m in buckets:
        if not times[m]:
            raise RuntimeError(f"int4 tuning {shape.key()}: no candidate ran at {m} rows")
        chosen.append((m, min(times[m], key=times[m].__getitem__)))
        timings.append((m, tuple((p.name, round(t, 2)) for p, t in sorted(times[m].items(), key=lambda kv: kv[1]))))
    rows: list[tuple[int | None, Path]] = []
    for i, (m, path) in enumerate(chosen):
        bound = None if i == len(chosen) - 1 else m
        if rows and rows[-1][1] == path:
            rows[-1] = (bound, path)
        else:
            rows.append((bound, path))
    return TunedTable(tuple(rows), tuple(timings))


# ----------------------------------------------------------------------------------------------------
# cache


def cache_key(shape: Shape, backends: Sequence[str], device_name: str) -> str:
    triton_version = getattr(triton, "__version__", "none")
    return (f"v{TABLE_VERSION} | {device_name} | torch {torch.__version__} | triton {triton_version} | {shape.key()} | "
            f"{','.join(backends)}")


def _from_cache(file: FsPath, key: str, shape: Shape, backends: Sequence[str]) -> TunedTable | None:
    if key not in (cached := read_json(file)):
        return None
    try:
        table = table_from_json(cached[key], shape)
    except (ValueError, TypeError, IndexError) as e:
        log.warning("int4 dispatch cache %s: entry for %s unreadable (%s); timing again", file, shape.key(), e)
        return None
    if not {p.backend for _, p in table.rows} <= set(backends):
        return None
    log.info("int4 dispatch %s (cached in %s): %s", shape.key(), file, table.describe())
    return table


_TABLES: dict[str, TunedTable] = {}
"""Tables of this process (each distinct layer shape is tuned or read once)."""


def tune(shape: Shape, backends: Sequence[str], timer: Timer, device: torch.device, device_name: str,
         use_cache: bool = True, release: Callable[[], None] | None = None) -> TunedTable:
    """The tuned table for this shape and these (checked) backends: from this process, the cache file, or
    measured now under the cache folder's lock (then logged and written to the cache; `release` is called after
    measuring, to give the transient weight copies' memory back)."""
    key = cache_key(shape, backends, device_name)
    if key in _TABLES:
        return _TABLES[key]
    folder = cache_dir() if use_cache else None
    if folder is None:
        table = _measure_logged(shape, backends, timer, device, device_name, release)
    elif (table := _from_cache(folder / CACHE_FILE, key, shape, backends)) is None:
        # One process times a shape while the others wait and read its table, instead of timing the same shape
        # beside it (test workers, engines side by side, TP ranks with identical shards); other shapes go on.
        with cache_lock(f".int4_dispatch.{hashlib.sha256(key.encode()).hexdigest()[:16]}.lock"):
            # another process may have timed this shape while this one waited
            if (table := _from_cache(folder / CACHE_FILE, key, shape, backends)) is None:
                table = _measure_logged(shape, backends, timer, device, device_name, release)
                try:
                    update_json(folder / CACHE_FILE, key, [[b, p.name] for b, p in table.rows])
                except OSError as e:
                    log.warning("int4 dispatch cache %s not written (%s): the next start times again", folder, e)
    _TABLES[key] = table
    return table


def _measure_logged(shape: Shape, backends: Sequence[str], timer: Timer, device: torch.device, device_name: str,
                    release: Callable[[], None] | None) -> TunedTable:
    t0 = time.perf_counter()
    table = measure(shape, backends, timer, device)
    if release is not None:
        release()
    log.info("int4 dispatch %s on %s, measured in %.1f s: %s", shape.key(), device_name, time.perf_counter() - t0,
             table.describe())
    for m, times in table.timings:
        log.info("  int4 %s M=%d: %s", shape.key(), m, ", ".join(f"{n} {t}us" for n, t in times))
    return table
