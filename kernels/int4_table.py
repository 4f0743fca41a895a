"""The int4 dispatch's tables as data (kernels.int4_tune measures and caches them): a path by name, a table of
buckets of rows, the layer shape a table is keyed by.

    Path.parse("cuda_mma[w4 u2 n2]").name == "cuda_mma[w4 u2 n2]"
    table.path_for(rows)    # a pure function of the row count (graph-safe)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.int4 import CudaMmaConfig, GemvConfig, Int4Layout, MmaConfig, TritonInt4Config
from kernels.int4_cuda import CUDA_MAX_ROWS

DEQUANT = "dequant"


@dataclass(frozen=True)
class Path:
    """One way to compute y = x @ W: a kernels.int4 backend (with a launch shape for the Triton ones), or dequant."""

    backend: str
    config: MmaConfig | TritonInt4Config | GemvConfig | CudaMmaConfig | None = None

    @property
    def name(self) -> str:
        if isinstance(self.config, CudaMmaConfig):
            c = self.config
            split = f" k{c.splits}" if c.splits > 1 else ""
            return f"{self.backend}[w{c.warps} u{c.unroll} n{c.tiles}{split}]"
        if isinstance(self.config, MmaConfig):
            c = self.config
            fold = " fold" if c.fold else ""
            return (f"{self.backend}[{c.block_n}x{c.block_t}x{c.block_k} s{c.split_k} w{c.num_warps} "
                    f"st{c.num_stages}{fold}]")
        if isinstance(self.config, TritonInt4Config):
            c = self.config
            return f"{self.backend}[{c.block_m}x{c.block_n}x{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}]"
        if isinstance(self.config, GemvConfig):
            c = self.config
            pf = "" if c.prefetch else " noprefetch"
            return f"{self.backend}[{c.block_n}x{c.block_kw} s{c.split_k} w{c.num_warps} st{c.num_stages}{pf}]"
        return self.backend

    @staticmethod
    def parse(name: str) -> Path:
        backend, _, rest = name.partition("[")
        if not rest:
            return Path(backend)
        if backend not in ("cuda_mma", "triton_gemv", "triton_mma", "triton"):  # the others take no launch shape
            raise ValueError(f"int4 dispatch: unknown path {name!r}")
        if backend == "cuda_mma":
            warps, unroll, tiles, *split = rest.rstrip("]").split(" ")
            if len(split) > 1 or (split and split[0][0] != "k"):
                raise ValueError(f"int4 dispatch: unknown path {name!r}")
            return Path(backend, CudaMmaConfig(int(warps[1:]), int(unroll[1:]), int(tiles[1:]),
                                               int(split[0][1:]) if split else 1))
        tile, split, warps, stages, *flags = rest.rstrip("]").split(" ")
        if backend == "triton_gemv" and flags in ([], ["noprefetch"]):
            bn, bkw = (int(v) for v in tile.split("x"))
            return Path(backend, GemvConfig(bn, bkw, int(split[1:]), int(warps[1:]), int(stages[2:]), not flags))
        a, b, c = (int(v) for v in tile.split("x"))
        args = (a, b, c, int(split[1:]), int(warps[1:]), int(stages[2:]))
        if backend == "triton_mma" and flags in ([], ["fold"]):
            return Path(backend, MmaConfig(*args, fold=bool(flags)))
        if flags:
            raise ValueError(f"int4 dispatch: unknown flags in path {name!r}")
        if backend == "triton":
            return Path(backend, TritonInt4Config(*args))
        raise ValueError(f"int4 dispatch: unknown path {name!r}")


@dataclass(frozen=True)
class TunedTable:
    """(max rows or None for any above, path) in increasing order; `timings` (µs per candidate per bucket) for
    the log."""

    rows: tuple[tuple[int | None, Path], ...]
    timings: tuple[tuple[int, tuple[tuple[str, float], ...]], ...] = ()

    def path_for(self, m: int) -> Path:
        for max_rows, path in self.rows:
            if max_rows is None or m <= max_rows:
                return path
        raise AssertionError("a tuned table ends with an open bucket")

    def describe(self) -> str:
        lo, out = 1, []
        for max_rows, path in self.rows:
            span = f"{lo}-{max_rows}" if max_rows is not None and max_rows > lo else f"{lo}" if max_rows else f">={lo}"
            out.append(f"{span}: {path.name}")
            lo = (max_rows or 0) + 1
        return ", ".join(out)


@dataclass(frozen=True)
class Shape:
    """What a tuned table depends on, besides the device and the candidates."""

    layout: Int4Layout
    dtype: torch.dtype
    sym: bool
    """Every group has the same zero point (the symmetric checkpoints): part of the key, as a backend may
    specialize on it (torch's native ops do not need to; a tuned table stays per kind to be safe)."""

    def key(self) -> str:
        lay = self.layout
        return (f"K{lay.in_features} N{lay.out_features} g{lay.group_size} zo{lay.zero_offset} "
                f"{str(self.dtype).removeprefix('torch.')} {'sym' if self.sym else 'asym'}")


def table_from_json(rows: list, shape: Shape) -> TunedTable:
    """A cached table (its [bound, path name] rows), checked to fit this shape: ValueError where it does not."""
    table = TunedTable(tuple((r[0], Path.parse(r[1])) for r in rows))
    if not table.rows or table.rows[-1][0] is not None:
        raise ValueError("a tuned table must end with an open bucket")
    k, n, g = shape.layout.in_features, shape.layout.out_features, shape.layout.group_size
    for bound, p in table.rows:
        c = p.config
        if isinstance(c, (MmaConfig, GemvConfig)) and not c.fits(1, k, n, g):
            raise ValueError(f"{p.name} does not fit this shape")
        # a launch shape of cuda_mma holds a fixed number of token tiles: its bucket's rows (<= 64) must fit it
        if isinstance(c, CudaMmaConfig) and (bound is None or bound > CUDA_MAX_ROWS or not c.fits(bound, k, n)):
            raise ValueError(f"{p.name} does not fit this shape and bucket")
        if isinstance(c, TritonInt4Config) and (g % c.block_k or k % (c.block_k * c.split_k) or c.block_k % 8):
            raise ValueError(f"{p.name} does not fit this shape")
    return table
