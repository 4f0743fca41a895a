"""LoRA wrappers by composition over the parallel linear layers (any linear method: fp16 or int4).

A wrapper holds per-slot stacked buffers for each slice of its layer, A [slots, r_max, in_local]
and B [slots, out_local, r_max], zero-padded to max_lora_rank, plus each slot's true rank. It knows
module names (to pick an adapter's tensors) but never adapter names or ids.

Tensor parallel (DESIGN.md §5, default mode): a column layer keeps A whole and takes the rows of B
for its output shard; a row layer takes the columns of A for its input shard and keeps B whole,
adding its partial x_i A_i^T B^T before the base all-reduce, so no extra collective is needed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from engine.distributed import all_reduce
from engine.forward_context import get_context
from engine.layers.linear import ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, RowParallelLinear
from engine.lora.adapter import LoRAModule
from engine.lora.punica import add_lora


class BaseLayerWithLoRA(nn.Module):
    def __init__(self, base: LinearBase, module_names: list[str], max_loras: int, max_rank: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.base = base
        self.module_names = module_names
        self.max_loras, self.max_rank = max_loras, max_rank
        dev = base.device  # the base layer's own API, whatever its linear method
        self.lora_a = [torch.zeros(max_loras, max_rank, self.in_local, dtype=dtype, device=dev)
                       for _ in module_names]
        self.lora_b = [torch.zeros(max_loras, n, max_rank, dtype=dtype, device=dev) for n in self.out_local_sizes()]
        self.ranks: list[list[int]] = [[0] * max_loras for _ in module_names]

    # -- geometry (overridden per layer kind) ---------------------------------------------------------
    @property
    def in_local(self) -> int:
        return self.base.in_features

    def out_local_sizes(self) -> list[int]:
        return [self.base.out_features]

    def offsets(self) -> list[int]:
        return [0]

    def full_shapes(self) -> dict[str, tuple[int, int]]:
        """Checkpoint module name -> unsharded (in_features, out_features), for adapter validation."""
        raise NotImplementedError

    def shard_a(self, i: int, a: torch.Tensor) -> torch.Tensor:
        return a

    def shard_b(self, i: int, b: torch.Tensor) -> torch.Tensor:
        return b

    # -- slots ---------------------------------------------------------------------------------------------
    def set_slot(self, slot: int, modules: Mapping[str, LoRAModule]) -> None:
        """Copy an adapter's tensors for this layer into `slot` (absent modules get rank 0)."""
        self.clear_slot(slot)
        for i, name in enumerate(self.module_names):
            m = modules.get(name)
            if m is None:
                continue
            a, b = self.shard_a(i, m.a), self.shard_b(i, m.b)
            self.lora_a[i][slot, : m.rank].copy_(a)
            self.lora_b[i][slot, :, : m.rank].copy_(b)
            self.ranks[i][slot] = m.rank

    def clear_slot(self, slot: int) -> None:
        for i in range(len(self.module_names)):
            self.lora_a[i][slot].zero_()
            self.lora_b[i][slot].zero_()
            self.ranks[i][slot] = 0

    def _add(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        mapping = get_context().lora
        if mapping is None:
            return y
        return add_lora(y, x, self.lora_a, self.lora_b, self.ranks, self.offsets(), mapping, add_inputs=True)


class ColumnParallelLinearWithLoRA(BaseLayerWithLoRA):
    """Column, merged column (gate/up) and QKV layers: one LoRA slice per fused part."""

    base: ColumnParallelLinear

    @staticmethod
    def can_wrap(module: nn.Module) -> bool:
        return isinstance(module, ColumnParallelLinear)

    def out_local_sizes(self) -> list[int]:
        if isinstance(self.base, MergedColumnParallelLinear):
            return list(self.base.local_sizes)
        return [self.base.out_features]

    def offsets(self) -> list[int]:
        sizes = self.out_local_sizes()
        return [sum(sizes[:i]) for i in range(len(sizes))]

    def _source(self, i: int) -> tuple[int, int]:
        """(block index, block count) of this rank's rows in slice i's full output."""
        if isinstance(self.base, MergedColumnParallelLinear):
            return self.base.shard_source(i), self.base.num_sources(i)
        return self.base.tp_rank, self.base.tp_size

    def full_shapes(self) -> dict[str, tuple[int, int]]:
        sizes = self.out_local_sizes()
        return {name: (self.base.in_features, sizes[i] * self._source(i)[1])
                for i, name in enumerate(self.module_names)}

    def shard_b(self, i: int, b: torch.Tensor) -> torch.Tensor:
        n = self.out_local_sizes()[i]
        idx, _ = self._source(i)
        return b[idx * n:(idx + 1) * n]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add(self.base(x), x)


class RowParallelLinearWithLoRA(BaseLayerWithLoRA):
    """o_proj / down_proj: the LoRA partial product joins the base partial sum before the all-reduce."""

    base: RowParallelLinear

    @staticmethod
    def can_wrap(module: nn.Module) -> bool:
        return isinstance(module, RowParallelLinear)

    def full_shapes(self) -> dict[str, tuple[int, int]]:
        return {self.module_names[0]: (self.base.full_in, self.base.out_features)}

    def shard_a(self, i: int, a: torch.Tensor) -> torch.Tensor:
        k = self.base.in_features
        return a[:, self.base.tp_rank * k:(self.base.tp_rank + 1) * k]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.base.bias if self.base.tp_rank == 0 else None
        y = self._add(self.base.apply_base(x, bias), x)
        return all_reduce(y) if self.base.reduce_results else y


WRAPPERS: tuple[type[BaseLayerWithLoRA], ...] = (ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA)


def wrap_model(model: nn.Module, targets: Mapping[str, tuple[str, int]], max_loras: int, max_rank: int,
               dtype: torch.dtype) -> list[BaseLayerWithLoRA]:
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
        w = cls(module, names, max_loras, max_rank, dtype)  # type: ignore[arg-type]
        setattr(model.get_submodule(parent_path), leaf, w)
        wrapped.append(w)
    return wrapped
