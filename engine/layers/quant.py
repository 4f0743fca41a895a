"""Linear methods: how a linear layer stores its weight and computes y = x W^T (+ b).

Each method creates its parameters with sharding metadata (`ShardSpec`), and the parallel layer's
weight_loader uses that metadata to cut the checkpoint tensor. The quantization config decides,
per layer name, which method a layer gets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import torch
from torch import nn

from engine.device import Device
from engine.errors import QuantConfigError
from kernels.int4 import Int4Layout, PreparedInt4, dequant_mm, int4_mm, native_supported, prepare_int4
from kernels.int4_tune import DEQUANT, Shape, tune
from kernels.reference import unpack_int4_cols
from kernels.skinny_triton import skinny_linear

SUPPORTED_FORMATS = ("auto_round:auto_gptq", "auto_round", "auto_round:gptqmodel")
SMALL_M = {"native": 4, "triton": 64}
"""The fixed `auto:native_X` dispatch: rows up to which each memory-bound int4 kernel is used: torch's native op
(fastest at M = 1, but its time grows about linearly with M), then our split-K Triton kernel; above, dequantize
once and run a dense GEMM. Measured on an H200 before the tuned dispatch (`tuned`, kernels/int4_tune.py), which
measures on the device it runs on instead."""


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter maps onto the logical [out, in] weight.

    output_dim / input_dim: which tensor dim runs along the output / input features (None: absent).
    packed_dim: the dim on which `pack` logical elements share one stored element (int4 in int32).
    group_dim_size: for per-group tensors (scales, zeros) the input dim counts groups, not features.
    """

    output_dim: int | None
    input_dim: int | None
    packed_dim: int | None = None
    pack: int = 1
    group_size: int = 1

    def units(self, dim: int, logical: int) -> int:
        """Stored elements along `dim` for `logical` features."""
        n = logical
        if dim == self.input_dim and self.group_size > 1:
            n //= self.group_size
        if dim == self.packed_dim:
            n //= self.pack
        return n


def set_spec(param: nn.Parameter, spec: ShardSpec) -> nn.Parameter:
    param.shard_spec = spec  # read by the parallel layers' weight_loader
    return param


class LinearMethod(Protocol):
    input_multiple: int
    """A row-parallel shard's input features must be a multiple of this (the quantization group size)."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None: ...
    def process_after_loading(self, layer: nn.Module) -> None: ...
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...
    def device(self, layer: nn.Module) -> torch.device: ...
    def dense_weight(self, layer: nn.Module) -> torch.Tensor: ...


def create_gptq_weights(layer: nn.Module, in_features: int, out_features: int, group_size: int, bits: int) -> None:
    """Register the GPTQ tensors of one shard: qweight int32 [K*bits/32, N], qzeros int32 [K/G, N*bits/32],
    scales fp16 [K/G, N], with the sharding metadata the parallel layers cut them by."""
    pack, g = 32 // bits, group_size
    if in_features % g or out_features % pack or in_features % pack:
        raise QuantConfigError(f"{layer.prefix}: int{bits} shard [{out_features} x {in_features}] is not a multiple "
                               f"of the group size {g} (inputs) and of {pack} (outputs)")
    qw = nn.Parameter(torch.empty(in_features // pack, out_features, dtype=torch.int32), requires_grad=False)
    qz = nn.Parameter(torch.empty(in_features // g, out_features // pack, dtype=torch.int32), requires_grad=False)
    sc = nn.Parameter(torch.empty(in_features // g, out_features, dtype=torch.float16), requires_grad=False)
    layer.register_parameter("qweight", set_spec(qw, ShardSpec(1, 0, packed_dim=0, pack=pack)))
    layer.register_parameter("qzeros", set_spec(qz, ShardSpec(1, 0, packed_dim=1, pack=pack, group_size=g)))
    layer.register_parameter("scales", set_spec(sc, ShardSpec(1, 0, group_size=g)))


class UnquantizedLinearMethod:
    """16/32-bit weight stored as [out, in] (the Hugging Face layout)."""

    input_multiple = 1

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        w = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.register_parameter("weight", set_spec(w, ShardSpec(output_dim=0, input_dim=1)))

    def process_after_loading(self, layer: nn.Module) -> None:
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return nn.functional.linear(x, layer.weight, bias)

    def device(self, layer: nn.Module) -> torch.device:
        return layer.weight.device

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.data


class SkinnyLinearMethod(UnquantizedLinearMethod):
    """16-bit weights with few output features (Qwen3.5's [b | a] projection): decode rows in one Triton launch
    (kernels.skinny_triton), where cuBLAS splits K into two; other rows and devices F.linear."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return skinny_linear(x, layer.weight, bias, True)


def with_skinny(method: LinearMethod, on: bool) -> LinearMethod:
    """The 16-bit method's skinny form where `on` (the GDN backend runs Triton kernels); any other method as is."""
    return SkinnyLinearMethod() if on and type(method) is UnquantizedLinearMethod else method


@dataclass
class Int4LinearMethod:
    """GPTQ-layout int4 weight (qweight [K/8, N], qzeros [K/G, N/8], scales [K/G, N])."""

    group_size: int
    zero_offset: int
    """1 for GPTQ-v1 zeros (stored zp - 1, auto_round:auto_gptq), 0 for v2 (auto_round, gptqmodel)."""
    backend: str = "reference"

    @property
    def input_multiple(self) -> int:
        return self.group_size

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        create_gptq_weights(layer, in_features, out_features, self.group_size, bits=4)
        layer.int4_layout = Int4Layout(self.group_size, self.zero_offset, in_features, out_features)
        layer.compute_dtype = dtype

    def process_after_loading(self, layer: nn.Module) -> None:
        args = (layer.qweight.data, layer.qzeros.data, layer.scales.data, layer.int4_layout)
        layer.int4_paths: list[tuple[int | None, PreparedInt4 | None]] = []
        """(max rows or None for any, kernel or None for dequantize + dense GEMM) tried in order; rows above
        the last bound dequantize and run a dense GEMM (GPUs: one fused Triton pass)."""
        if self.backend.startswith("tuned:"):
            self._tuned_paths(layer)
            return
        if not self.backend.startswith("auto:"):
            layer.int4_paths.append((None, prepare_int4(*args, self.backend, dtype=layer.compute_dtype)))  # type: ignore[arg-type]
            return
        # GPUs: memory-bound kernels for small M (decode), and for large M (prefill) one fused
        # dequantization into a transient dense weight followed by the dense GEMM.
        native = self.backend.split(":", 1)[1]
        for name in (native, "triton"):
            if native_supported(name, layer.int4_layout, layer.compute_dtype):  # type: ignore[arg-type]
                w = prepare_int4(*args, name, dtype=layer.compute_dtype)  # type: ignore[arg-type]
                layer.int4_paths.append((SMALL_M["triton" if name == "triton" else "native"], w))
        if not layer.int4_paths:
            raise ValueError(f"{layer.prefix}: neither {native} nor triton can run this int4 layer here")
        last = layer.int4_paths[-1][1]
        if last is not None and last.backend != "triton":  # no Triton: no fused dequantization either
            layer.int4_paths[-1] = (None, last)

    def _tuned_paths(self, layer: nn.Module) -> None:
        """The tuned dispatch: this layer shape's table (kernels.int4_tune: timed once per shape and device, or
        read from the cache) over the checked candidates that can run it; each backend the table uses is
        prepared once, its launch shapes share the tensors."""
        lay, dtype = layer.int4_layout, layer.compute_dtype
        runs = [b for b in self.backend.split(":", 1)[1].split(",")
                if native_supported("triton" if b == DEQUANT else b, lay, dtype)]  # type: ignore[arg-type]
        if not runs:
            raise ValueError(f"{layer.prefix}: none of {self.backend} can run this int4 layer here")
        zq = unpack_int4_cols(layer.qzeros.data)
        shape = Shape(lay, dtype, sym=bool((zq == zq.flatten()[0]).all()))
        tdev = layer.qweight.device
        dev = Device(tdev.type, tdev.index or 0)  # type: ignore[arg-type]
        table = tune(shape, runs, dev.time_calls, tdev, dev.product_name(), release=dev.empty_cache)
        prepared: dict[str, PreparedInt4] = {}
        for max_rows, path in table.rows:
            if path.backend == DEQUANT:
                layer.int4_paths.append((max_rows, None))
                continue
            if path.backend not in prepared:
                prepared[path.backend] = prepare_int4(layer.qweight.data, layer.qzeros.data, layer.scales.data, lay,
                                                      path.backend, dtype=dtype)  # type: ignore[arg-type]
            layer.int4_paths.append((max_rows, replace(prepared[path.backend], config=path.config)))

    @staticmethod
    def _path(layer: nn.Module, rows: int) -> PreparedInt4 | None:
        """The kernel for this many rows, or None: dequantize + dense GEMM."""
        for max_rows, w in layer.int4_paths:
            if max_rows is None or rows <= max_rows:
                return w
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = self._path(layer, x.numel() // x.size(-1))
        if w is not None:
            return int4_mm(x, w, bias)
        y = dequant_mm(x.reshape(-1, x.size(-1)), layer.qweight, layer.qzeros, layer.scales, self.group_size,
                       self.zero_offset, bias)
        return y.reshape(*x.shape[:-1], y.size(-1))

    def device(self, layer: nn.Module) -> torch.device:
        return layer.qweight.device

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        from kernels.reference import dequant_int4

        w = dequant_int4(layer.qweight.data, layer.qzeros.data, layer.scales.data, self.group_size,
                         self.zero_offset, dtype=torch.float32)
        return w.t()


@dataclass
class Int8LinearMethod:
    """GPTQ-layout 8-bit weight (qweight [K/4, N], qzeros [K/G, N/4], scales [K/G, N]). Served by
    dequantizing once at load into the activation dtype: 8-bit is uncommon for AutoRound exports, and
    the packed tensors are freed once dequantized, so a layer costs what a 16-bit checkpoint's would."""

    group_size: int
    zero_offset: int

    @property
    def input_multiple(self) -> int:
        return self.group_size

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        create_gptq_weights(layer, in_features, out_features, self.group_size, bits=8)
        layer.compute_dtype = dtype

    def process_after_loading(self, layer: nn.Module) -> None:
        from kernels.reference import dequant_int8

        layer.dense = dequant_int8(layer.qweight.data, layer.qzeros.data, layer.scales.data, self.group_size,
                                   self.zero_offset, dtype=layer.compute_dtype).t().contiguous()
        for p in (layer.qweight, layer.qzeros, layer.scales):
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return nn.functional.linear(x, layer.dense, bias)

    def device(self, layer: nn.Module) -> torch.device:
        return layer.qweight.device

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.dense.float()


@dataclass(frozen=True)
class QuantConfig:
    """The checkpoint's quantization_config, resolved per layer name."""

    method: Literal["none", "int4", "int8"]
    group_size: int = 128
    zero_offset: int = 1
    sym: bool = True
    blocks: tuple[str, ...] = ()
    """Name prefixes whose linears are quantized (block_name_to_quantize); empty: all."""
    overrides: tuple[tuple[str, int], ...] = ()
    """(exact name or regex, bits) from extra_config."""

    @staticmethod
    def from_hf(qc: dict[str, Any] | None) -> QuantConfig:
        if not qc:
            return QuantConfig("none")
        qm = str(qc.get("quant_method", "")).lower().replace("_", "-")
        fmt = str(qc.get("packing_format", "auto_round:auto_gptq"))
        if qm not in ("auto-round", "intel/auto-round"):
            raise QuantConfigError(
                f"quantization method {qc.get('quant_method')!r} is not supported; this engine serves "
                f"AutoRound int4 checkpoints (quant_method 'auto-round', packing {', '.join(SUPPORTED_FORMATS)}) "
                "and unquantized bf16/fp16/fp32 ones")
        if fmt not in SUPPORTED_FORMATS:
            raise QuantConfigError(
                f"AutoRound packing_format {fmt!r} is not supported (supported: {', '.join(SUPPORTED_FORMATS)}); "
                "re-export with format='auto_round' or 'auto_round:auto_gptq'")
        bits = int(qc.get("bits", 4))
        dtype = str(qc.get("data_type", "int"))
        if bits not in (4, 8) or dtype != "int":
            raise QuantConfigError(f"AutoRound bits={bits} data_type={dtype!r} is not supported; 4-bit and 8-bit int "
                                   "weight-only (W4A16, W8A16) are served")
        act_bits = int(qc.get("act_bits", 16) or 16)
        if act_bits < 16:
            raise QuantConfigError(f"activation quantization (act_bits={act_bits}) is not supported; weight-only "
                                   "(W4A16, W8A16) only")
        group = int(qc.get("group_size", 128))
        if group <= 0:
            raise QuantConfigError(f"group_size {group} is not supported (per-channel -1 is not served); use 32..256")
        blocks = qc.get("block_name_to_quantize") or ()
        if isinstance(blocks, str):
            blocks = tuple(b.strip() for b in blocks.split(",") if b.strip())
        overrides = []
        for name, cfg in (qc.get("extra_config") or {}).items():
            b = int(cfg.get("bits", bits))
            if b not in (4, 8, 16, 32) or (b in (4, 8) and str(cfg.get("data_type", "int")) != "int"):
                raise QuantConfigError(f"extra_config for {name!r}: bits={b} is not supported (4, 8 or 16)")
            overrides.append((name, b))
        # v1 (auto_gptq) stores zp - 1; the auto_round and gptqmodel packings store zp itself.
        zero_offset = 1 if fmt == "auto_round:auto_gptq" else 0
        return QuantConfig("int4" if bits == 4 else "int8", group, zero_offset, bool(qc.get("sym", True)),
                           tuple(blocks), tuple(overrides))

    def bits_for(self, name: str) -> int:
        """Bits of the linear with this checkpoint name (e.g. model.layers.0.self_attn.q_proj)."""
        if self.method == "none":
            return 16
        for key, b in self.overrides:
            if key == name:
                return b
        for key, b in self.overrides:
            if any(c in key for c in "*[]()\\+?^$|") and re.fullmatch(key, name):
                return b
        if self.blocks and not any(name.startswith(p + ".") for p in self.blocks):
            return 16
        return 4 if self.method == "int4" else 8

    def method_for(self, names: list[str], backend: str) -> LinearMethod:
        """Method for a (possibly fused) layer; every fused part must agree."""
        bits = {self.bits_for(n) for n in names}
        if len(bits) > 1:
            raise QuantConfigError(f"{', '.join(names)} are fused into one layer here but quantized differently "
                                   f"({sorted(bits)} bits); this mix is not supported")
        b = bits.pop()
        if b == 4:
            return Int4LinearMethod(self.group_size, self.zero_offset, backend)
        if b == 8:
            return Int8LinearMethod(self.group_size, self.zero_offset)
        return UnquantizedLinearMethod()
