"""LoRA wrappers by composition over the parallel linear layers (any linear method: fp16 or int4).

A wrapper holds per-slot stacked buffers for each slice of its layer, A [slots, rows, in_local] and
B [slots, out_local, r_max], zero-padded, plus each slot's true rank. It knows module names (to pick
an adapter's tensors) but never adapter names or ids.

Tensor parallel (DESIGN.md §5):
- default: a column layer keeps A whole and takes the rows of B for its output shard; a row layer
  takes the columns of A for its input shard and keeps B whole, adding its partial x_i A_i^T B^T
  before the base all-reduce. No extra collective.
- fully sharded: a column layer also splits A's rank dim at r_max/tp and all-gathers the T x r_max/tp
  shrink results; a row layer splits B's rows, all-reduces the T x r shrink result and expands into
  its own slice of the output before the base all-reduce.
The gather happens only in the fully sharded mode and only when tp > 1 (seed bug 2).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed import all_gather, all_reduce
from engine.forward_context import get_context
from engine.layers.activation import SiluAndMul
from engine.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    RowParallelLinear,
    SectionedColumnParallelLinear,
)
from engine.layers.norm import RMSNorm
from engine.lora.adapter import LoRAModule
from engine.lora.punica import Scales, SlotRanks
from engine.lora.slots import run_copies
from kernels.reference import fp8_rows


def shrink_needs_gather(fully_sharded: bool, tp_size: int) -> bool:
    """Whether a column layer all-gathers its shrink output: only when A's rank dim is sharded."""
    return fully_sharded and tp_size > 1


@dataclass(frozen=True)
class PackedLayer:
    """One wrapper's share of an adapter in host memory, laid out as its slot blocks want it: per block the
    rows a fill writes ([rows, width] in the block's dtype; rows 0 where the adapter writes nothing), and the
    ranks they stand for."""

    parts: list[torch.Tensor]
    ranks: list[int]
    a_ranks: list[int]


class BaseLayerWithLoRA(nn.Module):
    def __init__(self, base: LinearBase, module_names: list[str], max_loras: int, max_rank: int,
                 dtype: torch.dtype, fully_sharded: bool = False, weight_dtype: torch.dtype | None = None) -> None:
        """dtype: the model's; weight_dtype: how A and B are stored (default dtype; float8_e4m3fn: fp8 with a
        float32 scale per rank row of A and per output row of B, dequantized by the LoRA ops)."""
        super().__init__()
        self.base = base
        self.module_names = module_names
        self.max_loras, self.max_rank = max_loras, max_rank
        self.tp_rank, self.tp_size = base.tp_rank, base.tp_size
        self.fully_sharded = fully_sharded and base.tp_size > 1
        dev = base.device  # the base layer's own API, whatever its linear method
        n, k, sizes = len(module_names), self.base.in_features, self.b_sizes()
        wd = weight_dtype or dtype
        self.fp8 = wd == torch.float8_e4m3fn
        # Slot storage, rank rows outermost inside a slot: an adapter of rank r fills a contiguous prefix of
        # each block (one copy per block, the stale rows past it are one range), see engine/lora/slots.py.
        #   A block [S, a_rows, n*K]: slice i's A = columns [i*K, (i+1)*K).
        #   B block [S, r_max, sum n_i] rank-major (the Triton expand reads it ~2x faster than r-contiguous,
        #   measured on an H200, docs/PERFORMANCE.md): slice i's B^T = columns [off_i, off_i + n_i).
        #   rank block [S, 1, 2n] int32: the true ranks, then the valid A rows, of each slice.
        #   fp8 only: A scales [S, a_rows, n] (slice i's in column i), B scales [S, 1, sum n_i] float32.
        self.a_store = torch.zeros(max_loras, self.a_rows(), n * k, dtype=wd, device=dev)
        self.b_store = torch.zeros(max_loras, max_rank, sum(sizes), dtype=wd, device=dev)
        self.rank_store = torch.zeros(max_loras, 1, 2 * n, dtype=torch.int32, device=dev)
        self.blocks: list[torch.Tensor] = [self.a_store, self.b_store, self.rank_store]
        b_offs = [sum(sizes[:i]) for i in range(n)]
        self.scales: Scales | None = None
        """fp8: each slice's scale views (what the LoRA ops dequantize with); None otherwise."""
        if self.fp8:
            a_sc = torch.zeros(max_loras, self.a_rows(), n, dtype=torch.float32, device=dev)
            b_sc = torch.zeros(max_loras, 1, sum(sizes), dtype=torch.float32, device=dev)
            self.blocks += [a_sc, b_sc]
            self.scales = Scales([a_sc[:, :, i] for i in range(n)],
                                 [b_sc[:, 0, o:o + m] for o, m in zip(b_offs, sizes)])
        self.lora_a = [self.a_store[:, :, i * k:(i + 1) * k] for i in range(n)]
        """Slice i's A as [S, a_rows, K] (a view of a_store)."""
        self.lora_b = [self.b_store[:, :, o:o + m].transpose(1, 2) for o, m in zip(b_offs, sizes)]
        """Slice i's B as [S, n_i, r_max] (a transposed view of b_store)."""
        self.ranks: list[list[int]] = [[0] * max_loras for _ in module_names]
        """True rank of each slot per slice (what the expand reads)."""
        self.a_ranks: list[list[int]] = [[0] * max_loras for _ in module_names]
        """Valid rows of this rank's A buffer per slot (= ranks unless A's rank dim is sharded)."""
        # The same on the device ([n, S] views of rank_store), updated in place so that captured graphs see new slots.
        self.ranks_dev = self.rank_store[:, 0, :n].t()
        self.a_ranks_dev = self.rank_store[:, 0, n:].t()
        self.rows_written = [[0] * len(self.blocks) for _ in range(max_loras)]
        """Per slot and block: rows that may be non-zero (what a later fill of fewer rows must zero)."""

    # -- geometry, per layer kind ----------------------------------------------------------------------
    def a_rows(self) -> int:
        return self.max_rank

    def b_sizes(self) -> list[int]:
        return [self.base.out_features]

    def full_shapes(self) -> dict[str, tuple[int, int]]:
        """Checkpoint module name -> unsharded (in_features, out_features), for adapter validation."""
        raise NotImplementedError

    def shard_a(self, i: int, a: torch.Tensor) -> torch.Tensor:
        return a

    def shard_b(self, i: int, b: torch.Tensor) -> torch.Tensor:
        return b

    # -- packing an adapter (host) ---------------------------------------------------------------------
    def _shards(self, modules: Mapping[str, LoRAModule]) -> list[tuple[torch.Tensor, torch.Tensor, int] | None]:
        """Per slice: (this rank's A rows [ra, in_local], its B [n_local, rank], rank), None where absent."""
        out: list[tuple[torch.Tensor, torch.Tensor, int] | None] = []
        for i, name in enumerate(self.module_names):
            m = modules.get(name)
            out.append(None if m is None else (self.shard_a(i, m.a), self.shard_b(i, m.b), m.rank))
        return out

    def pack_rows(self, modules: Mapping[str, LoRAModule]) -> list[int]:
        """Rows of each block that an adapter fills (its packed form's shapes: pack_rows x block width)."""
        shards = [s for s in self._shards(modules) if s is not None]
        ra, rb = max((a.size(0) for a, _, _ in shards), default=0), max((r for _, _, r in shards), default=0)
        return [ra, rb, 1, ra, 1 if shards else 0] if self.fp8 else [ra, rb, 1]

    def pack_into(self, modules: Mapping[str, LoRAModule], parts: list[torch.Tensor]) -> PackedLayer:
        """Write the adapter's tensors for this layer into `parts` (zero-filled host tensors [pack_rows[j],
        width of block j] in the blocks' dtypes), converted (fp8: quantized per row), sharded and laid out as
        the slot blocks hold them."""
        a_part, b_part, r_part = parts[:3]
        k, sizes = self.base.in_features, self.b_sizes()
        n = len(sizes)
        ranks, a_ranks = [0] * n, [0] * n
        for i, s in enumerate(self._shards(modules)):
            if s is None:
                continue
            a, b, r = s
            off = sum(sizes[:i])
            if self.fp8:
                (a, sa), (b, sb) = fp8_rows(a), fp8_rows(b)
                parts[3][:a.size(0), i] = sa
                parts[4][0, off:off + sizes[i]] = sb
            a_part[:a.size(0), i * k:(i + 1) * k].copy_(a)
            b_part[:r, off:off + sizes[i]].copy_(b.t())
            ranks[i], a_ranks[i] = r, a.size(0)
        r_part.copy_(torch.tensor([ranks + a_ranks], dtype=torch.int32))
        return PackedLayer(parts, ranks, a_ranks)

    def pack(self, modules: Mapping[str, LoRAModule]) -> PackedLayer:
        """The adapter's packed form for this layer alone, in ordinary host memory."""
        rows = self.pack_rows(modules)
        parts = [torch.zeros(r, blk.size(-1), dtype=blk.dtype) for r, blk in zip(rows, self.blocks)]
        return self.pack_into(modules, parts)

    # -- slots ---------------------------------------------------------------------------------------------
    def slot_copies(self, slot: int, packed: PackedLayer) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                                                 list[torch.Tensor]]:
        """What filling `slot` with `packed` writes: (slot view, packed part) pairs and the views to zero (rows
        an earlier occupant wrote past the new one's). Records the new rows and the host ranks; the caller
        issues the copies (engine.lora.slots)."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        zeros: list[torch.Tensor] = []
        for j, (blk, part) in enumerate(zip(self.blocks, packed.parts)):
            rows, old = part.size(0), self.rows_written[slot][j]
            if rows:
                pairs.append((blk[slot, :rows], part))
            if old > rows:
                zeros.append(blk[slot, rows:old])
            self.rows_written[slot][j] = rows
        for i in range(len(self.module_names)):
            self.ranks[i][slot], self.a_ranks[i][slot] = packed.ranks[i], packed.a_ranks[i]
        return pairs, zeros

    def set_slot(self, slot: int, modules: Mapping[str, LoRAModule] | PackedLayer) -> None:
        """Copy an adapter's tensors for this layer into `slot` (absent modules get rank 0). The engine fills
        all layers at once through engine.lora.slots.SlotFiller instead."""
        pairs, zeros = self.slot_copies(slot, modules if isinstance(modules, PackedLayer) else self.pack(modules))
        run_copies(pairs, zeros)

    def clear_slot(self, slot: int) -> None:
        zeros = [blk[slot, :rows] for blk, rows in zip(self.blocks, self.rows_written[slot]) if rows]
        if zeros:
            torch._foreach_zero_(zeros)
        self.rows_written[slot] = [0] * len(self.blocks)
        for i in range(len(self.module_names)):
            self.ranks[i][slot] = self.a_ranks[i][slot] = 0

    def slot_ranks(self, a_side: bool = False) -> SlotRanks:
        """Per-slice ranks of every slot: B side (true ranks) or A side (valid rows of this rank's A)."""
        return SlotRanks(self.a_ranks, self.a_ranks_dev) if a_side else SlotRanks(self.ranks, self.ranks_dev)


class ColumnParallelLinearWithLoRA(BaseLayerWithLoRA):
    """Column, merged column (gate/up) and QKV layers: one LoRA slice per fused part."""

    base: ColumnParallelLinear

    @staticmethod
    def can_wrap(module: nn.Module) -> bool:
        return isinstance(module, ColumnParallelLinear)

    def a_rows(self) -> int:
        if not self.fully_sharded:
            return self.max_rank
        if self.max_rank % self.tp_size:
            raise ValueError(f"{self.base.prefix}: fully sharded LoRA needs max_lora_rank ({self.max_rank}) "
                             f"divisible by the tensor-parallel size ({self.tp_size})")
        return self.max_rank // self.tp_size

    @property
    def sectioned(self) -> bool:
        """One LoRA module spanning every section of the layer (Qwen3.5's in_proj_qkv)."""
        return isinstance(self.base, SectionedColumnParallelLinear)

    def b_sizes(self) -> list[int]:
        if self.sectioned:
            return [self.base.out_features]
        if isinstance(self.base, MergedColumnParallelLinear):
            return list(self.base.local_sizes)
        return [self.base.out_features]

    @functools.cached_property
    def offsets(self) -> list[int]:
        """Where each slice starts in this rank's output (fixed by the base layer: computed once)."""
        sizes = self.b_sizes()
        return [sum(sizes[:i]) for i in range(len(sizes))]

    def _source(self, i: int) -> tuple[int, int]:
        """(block index, block count) of this rank's rows in slice i's full output."""
        if isinstance(self.base, MergedColumnParallelLinear):
            return self.base.shard_source(i), self.base.num_sources(i)
        return self.tp_rank, self.tp_size

    def full_shapes(self) -> dict[str, tuple[int, int]]:
        if self.sectioned:
            return {self.module_names[0]: (self.base.in_features, self.base.full_out)}
        sizes = self.b_sizes()
        return {name: (self.base.in_features, sizes[i] * self._source(i)[1])
                for i, name in enumerate(self.module_names)}

    def shard_a(self, i: int, a: torch.Tensor) -> torch.Tensor:
        if not self.fully_sharded:
            return a
        rows = self.a_rows()  # this rank's rows of the zero-padded [r_max, in] A
        return a[self.tp_rank * rows:(self.tp_rank + 1) * rows]

    def shard_b(self, i: int, b: torch.Tensor) -> torch.Tensor:
        if self.sectioned:  # this rank's rows of each section, in section order (as the base weight)
            base: SectionedColumnParallelLinear = self.base  # type: ignore[assignment]
            parts = b.split(base.out_sizes, dim=0)
            return torch.cat([p[self.tp_rank * n:(self.tp_rank + 1) * n] for p, n in zip(parts, base.local_sizes)])
        n = self.b_sizes()[i]
        idx, _ = self._source(i)
        return b[idx * n:(idx + 1) * n]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mapping = get_context().lora
        if mapping is None:
            return self.base(x)
        if not shrink_needs_gather(self.fully_sharded, self.tp_size):
            return mapping.add_lora(self.base(x), x, self.lora_a, self.lora_b, self.slot_ranks(), self.offsets,
                                    scales=self.scales)
        y = self.base(x)
        ranks, a_ranks = self.slot_ranks(), self.slot_ranks(a_side=True)
        for i, off in enumerate(self.offsets):
            sa, sb = (self.scales.a[i], self.scales.b[i]) if self.scales is not None else (None, None)
            buf = all_gather(mapping.shrink(x, self.lora_a[i], a_ranks.slice(i), sa), dim=-1)  # [T, r_max]
            mapping.expand(y, buf, self.lora_b[i], ranks.slice(i), off, b_scale=sb)
        return y

    def forward_normed(self, norm: RMSNorm, h: torch.Tensor,
                       residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        mapping = get_context().lora
        if mapping is not None and norm.backend == "triton" and not shrink_needs_gather(self.fully_sharded,
                                                                                           self.tp_size):
            ranks = self.slot_ranks()
            joined = mapping.norm_shrink(h, residual, norm.weight, norm.eps, norm.zero_centered, self.lora_a, ranks,
                                         self.scales)
            if joined is not None:  # the shrink ran in the norm's launch
                x, residual, partials = joined
                return (mapping.finish_prologue(self.base(x), partials, self.lora_b, ranks, self.offsets, self.scales),
                        residual)
        x, residual = norm.pair(h, residual)
        return self(x), residual


class RowParallelLinearWithLoRA(BaseLayerWithLoRA):
    """o_proj / down_proj: the LoRA partial product joins the base partial sum before the all-reduce."""

    base: RowParallelLinear

    @staticmethod
    def can_wrap(module: nn.Module) -> bool:
        return isinstance(module, RowParallelLinear)

    def b_sizes(self) -> list[int]:
        out = self.base.out_features
        if not self.fully_sharded:
            return [out]
        if out % self.tp_size:
            raise ValueError(f"{self.base.prefix}: fully sharded LoRA needs {out} outputs divisible by tp")
        return [out // self.tp_size]

    def full_shapes(self) -> dict[str, tuple[int, int]]:
        return {self.module_names[0]: (self.base.full_in, self.base.out_features)}

    def shard_a(self, i: int, a: torch.Tensor) -> torch.Tensor:
        k = self.base.in_features
        return a[:, self.tp_rank * k:(self.tp_rank + 1) * k]

    def shard_b(self, i: int, b: torch.Tensor) -> torch.Tensor:
        n = self.b_sizes()[0]
        return b[self.tp_rank * n:(self.tp_rank + 1) * n] if self.fully_sharded else b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mapping = get_context().lora
        y = self.base.partial(x)
        if mapping is not None:
            ranks = self.slot_ranks()
            if self.fully_sharded:
                sa, sb = (self.scales.a[0], self.scales.b[0]) if self.scales is not None else (None, None)
                buf = all_reduce(mapping.shrink(x, self.lora_a[0], self.slot_ranks(a_side=True), sa))  # full x A^T
                mapping.expand(y, buf, self.lora_b[0], ranks, self.tp_rank * self.b_sizes()[0], b_scale=sb)
            else:  # each rank's partial shrink times the whole B: the all-reduce sums them right
                mapping.add_lora(y, x, self.lora_a, self.lora_b, ranks, [0], scales=self.scales)
        return self.base.reduce(y)

    def forward_act(self, act: SiluAndMul, x: torch.Tensor) -> torch.Tensor:
        mapping = get_context().lora
        if mapping is not None and act.backend == "triton" and not self.fully_sharded:
            ranks = self.slot_ranks()
            joined = mapping.act_shrink(x, self.lora_a, ranks, self.scales)
            if joined is not None:  # the shrink ran in the activation's launch
                y, partials = joined
                return self.base.reduce(mapping.finish_prologue(self.base.partial(y), partials, self.lora_b, ranks,
                                                                [0], self.scales))
        return self(act(x))


WRAPPERS: tuple[type[BaseLayerWithLoRA], ...] = (ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA)


def wrap_model(model: nn.Module, targets: Mapping[str, tuple[str, int]], max_loras: int, max_rank: int,
               dtype: torch.dtype, fully_sharded: bool = False, weight_dtype: torch.dtype | None = None
               ) -> list[BaseLayerWithLoRA]:
    """Replace every LoRA-targetable layer in place. targets: checkpoint leaf (q_proj) -> (our layer, slice)."""
    by_layer: dict[str, list[tuple[int, str]]] = {}
    for leaf, (layer, idx) in targets.items():
        by_layer.setdefault(layer, []).append((idx, leaf))
    wrapped: list[BaseLayerWithLoRA] = []
    for path, module in list(model.named_modules()):
        parent_path, _, leaf = path.rpartition(".")
        if leaf not in by_layer:
            continue
        cls = next((w for w in WRAPPERS if w.can_wrap(module)), None)
        if cls is None:
            raise TypeError(f"{path}: no LoRA wrapper for {type(module).__name__}")
        names = [f"{parent_path}.{ckpt}" for _, ckpt in sorted(by_layer[leaf])]
        w = cls(module, names, max_loras, max_rank, dtype, fully_sharded, weight_dtype)  # type: ignore[arg-type]
        setattr(model.get_submodule(parent_path), leaf, w)
        wrapped.append(w)
    return wrapped
