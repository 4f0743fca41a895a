"""Tensor-parallel linear layers. Each shards its own weights in `weight_loader`; collectives are
explicit in `forward`. At tp=1 every layer is a plain linear.

ColumnParallelLinear splits the output features, RowParallelLinear the input features; the merged
variants pack several checkpoint tensors (gate/up, q/k/v) into one matmul.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.distributed import all_reduce, tp_rank, tp_size
from engine.errors import WeightShapeError
from engine.layers.quant import LinearMethod, ShardSpec, UnquantizedLinearMethod

if TYPE_CHECKING:
    from engine.layers.activation import SiluAndMul
    from engine.layers.norm import RMSNorm


def divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}: {a} is not divisible by the tensor-parallel size {b}")
    return a // b


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, where: str) -> None:
    if dst.shape != src.shape:
        raise WeightShapeError(f"{where}: checkpoint shard has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def _take_shard(loaded: torch.Tensor, dim: int, size: int, index: int, count: int, where: str) -> torch.Tensor:
    """Block `index` of `count` equal blocks of `loaded` along dim, after checking the full size."""
    if loaded.dim() <= dim or loaded.size(dim) != size * count:
        raise WeightShapeError(f"{where}: checkpoint tensor has shape {tuple(loaded.shape)}, expected "
                               f"{size * count} along dim {dim}")
    return loaded.narrow(dim, index * size, size)


class LinearBase(nn.Module):
    """A linear layer whose storage and matmul belong to a LinearMethod (fp16 or int4)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: LinearMethod | None,
                 dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.method: LinearMethod = method or UnquantizedLinearMethod()
        self.in_features, self.out_features = in_features, out_features  # this rank's shard
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.method.create_weights(self, in_features, out_features, dtype)
        for p in self.parameters(recurse=False):
            p.weight_loader = self.weight_loader
        if bias:
            b = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            b.shard_spec = ShardSpec(output_dim=0, input_dim=None)
            b.weight_loader = self.weight_loader
            self.bias = b
        else:
            self.register_parameter("bias", None)

    @property
    def device(self) -> torch.device:
        """Where the weights live, whatever the method (the LoRA wrappers place their buffers here)."""
        return self.method.device(self)

    def dense_weight(self) -> torch.Tensor:
        """This shard's weight as a dense [out, in] tensor (tests and oracles only)."""
        return self.method.dense_weight(self)

    def process_after_loading(self) -> None:
        self.method.process_after_loading(self)

    def apply_base(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.method.apply(self, x, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        raise NotImplementedError


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; y stays sharded (no collective)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None,
                 dtype: torch.dtype = torch.float32, prefix: str = "") -> None:
        self.full_out = out_features
        super().__init__(in_features, divide(out_features, tp_size(), prefix), bias, method, dtype, prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        spec: ShardSpec = param.shard_spec
        d = spec.output_dim
        if d is not None:
            loaded = _take_shard(loaded, d, param.size(d), self.tp_rank, self.tp_size, self.prefix)
        _copy_checked(param.data, loaded, self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_base(x, self.bias)

    def forward_normed(self, norm: RMSNorm, h: torch.Tensor,
                       residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer on norm(h (+ residual)), h (+ residual)): the LoRA wrapper joins its shrink to the norm."""
        x, residual = norm.pair(h, residual)
        return self(x), residual


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column layers with the same input in one matmul (gate_proj + up_proj)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, method: LinearMethod | None = None,
                 dtype: torch.dtype = torch.float32, prefix: str = "") -> None:
        self.out_sizes = list(out_sizes)
        self.local_sizes = [divide(n, tp_size(), prefix) for n in out_sizes]
        super().__init__(in_features, sum(out_sizes), bias, method, dtype, prefix)

    def shard_range(self, shard_id: int) -> tuple[int, int]:
        """(offset, size) of one slice in this rank's output features."""
        return sum(self.local_sizes[:shard_id]), self.local_sizes[shard_id]

    def shard_source(self, shard_id: int) -> int:
        """Which block of the checkpoint slice this rank reads (its rank, except for replicated kv heads)."""
        return self.tp_rank

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        spec: ShardSpec = param.shard_spec
        d = spec.output_dim
        if shard_id is None or d is None:
            raise WeightShapeError(f"{self.prefix}: fused layer needs a shard id for {tuple(loaded.shape)}")
        idx = self.shard_index(shard_id)
        off, size = self.shard_range(idx)
        off, size = spec.units(d, off), spec.units(d, size)
        where = f"{self.prefix} (part {shard_id})"
        loaded = _take_shard(loaded, d, size, self.shard_source(idx), self.num_sources(idx), where)
        _copy_checked(param.data.narrow(d, off, size), loaded, where)

    def num_sources(self, shard_id: int) -> int:
        """Into how many blocks the checkpoint slice is cut."""
        return self.tp_size

    def shard_index(self, shard_id: str | int | None) -> int:
        assert isinstance(shard_id, int)
        return shard_id


class SectionedColumnParallelLinear(MergedColumnParallelLinear):
    """One checkpoint tensor made of sections that are split over ranks separately (Qwen3.5's
    in_proj_qkv: all q rows, then all k rows, then all v rows; each rank takes its heads of each)."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        spec: ShardSpec = param.shard_spec
        d = spec.output_dim
        if d is None:
            _copy_checked(param.data, loaded, self.prefix)
            return
        units = [spec.units(d, n) for n in self.out_sizes]
        if loaded.dim() <= d or loaded.size(d) != sum(units):
            raise WeightShapeError(f"{self.prefix}: checkpoint tensor has shape {tuple(loaded.shape)}, expected "
                                   f"{sum(units)} along dim {d}")
        for i, part in enumerate(loaded.split(units, dim=d)):
            super().weight_loader(param, part, i)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matmul; heads split over ranks, kv heads replicated when tp > kv heads."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 method: LinearMethod | None = None, dtype: torch.dtype = torch.float32, prefix: str = "") -> None:
        tp = tp_size()
        self.num_heads = divide(num_heads, tp, f"{prefix} attention heads")
        if tp >= num_kv_heads:
            divide(tp, num_kv_heads, f"{prefix} (tp must be a multiple of the kv heads)")
            self.num_kv_heads, self.kv_replicas = 1, tp // num_kv_heads
        else:
            self.num_kv_heads, self.kv_replicas = divide(num_kv_heads, tp, f"{prefix} kv heads"), 1
        self.head_dim = head_dim
        # Sizes as if every rank held num_kv_heads (the replicated heads are counted per rank).
        sizes = [self.num_heads * head_dim * tp, self.num_kv_heads * head_dim * tp, self.num_kv_heads * head_dim * tp]
        super().__init__(hidden, sizes, bias, method, dtype, prefix)

    def shard_index(self, shard_id: str | int | None) -> int:
        return {"q": 0, "k": 1, "v": 2}[str(shard_id)]

    def shard_source(self, shard_id: int) -> int:
        return self.tp_rank if shard_id == 0 else self.tp_rank // self.kv_replicas

    def num_sources(self, shard_id: int) -> int:
        return self.tp_size if shard_id == 0 else self.tp_size // self.kv_replicas


class RowParallelLinear(LinearBase):
    """Input features split over ranks; the partial products are summed by an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None,
                 dtype: torch.dtype = torch.float32, prefix: str = "", reduce_results: bool = True) -> None:
        self.full_in = in_features
        self.reduce_results = reduce_results
        tp = tp_size()
        g = (method or UnquantizedLinearMethod()).input_multiple
        if in_features % tp or (in_features // tp) % g:
            valid = [t for t in range(1, 65) if in_features % t == 0 and (in_features // t) % g == 0]
            raise ValueError(f"{prefix}: {in_features} input features split over tensor-parallel size {tp} give "
                             f"shards that are not a multiple of the quantization group size {g}; valid sizes for this "
                             f"layer: {valid}")
        super().__init__(in_features // tp, out_features, bias, method, dtype, prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        spec: ShardSpec = param.shard_spec
        d = spec.input_dim
        if d is not None:
            loaded = _take_shard(loaded, d, param.size(d), self.tp_rank, self.tp_size, self.prefix)
        _copy_checked(param.data, loaded, self.prefix)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of y; the bias is added on rank 0 only, so the all-reduce sums it exactly once."""
        return self.apply_base(x, self.bias if self.tp_rank == 0 else None)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        return all_reduce(y) if self.reduce_results else y

    def forward_act(self, act: SiluAndMul, x: torch.Tensor) -> torch.Tensor:
        """This layer on act(x): the LoRA wrapper joins its shrink to the activation."""
        return self(act(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))  # the collective: all_reduce over the TP ranks
