"""int4 weight-only matmul (W4A16) for the AutoRound / GPTQ layout, behind one interface.

    w = prepare_int4(qweight, qzeros, scales, layout, backend)  # once, after loading and TP slicing
    y = int4_mm(x, w, bias)  # y = x @ W + bias, W as in kernels.reference

Backends (each checked against kernels.reference.int4_matmul by tests/kernels/test_int4.py):
  reference    dequantize once to a dense [K, N] weight; torch.matmul. Any device, any layout.
  native_cpu   torch._weight_int4pack_mm_for_cpu         (tinygemm-style: (q - 8) * scale + zero)
  native_cuda  torch._weight_int4pack_mm                 (tinygemm on tensor cores, bf16 only)
  native_xpu   torch._weight_int4pack_mm_with_scales_and_zeros  (oneDNN: (q - zp) * scale, int8 zp)
  triton       our Triton kernels (kernels.int4_triton), reading qweight / packed qzeros / scales as stored
  triton_mma   our Triton kernel for decode batches (kernels.int4_mma) on weights repacked at prepare time into
               MMA-fragment order, zero points unpacked to uint8
  triton_gemv  our Triton kernel for one row on CUDA cores (kernels.int4_gemv) on the "triton" tensors as stored;
               more rows go to the "triton" kernel on the same tensors
  cuda_mma     our CUDA C kernel for 1-64 rows on tensor cores (kernels.int4_cuda, NVRTC-compiled, bf16, CUDA only)
               on weights repacked for it and triton_mma's scale/zero words; more rows run 64 at a time
This module never picks a device: the caller (engine/device.py) chooses the backend; a native backend
only accepts tensors on the device its name says.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from kernels.int4_cuda import CUDA_MAX_ROWS, CudaMmaConfig, cuda_mm, repack_cuda
from kernels.int4_cuda import available as cuda_mma_available
from kernels.int4_cuda import compile_for as cuda_mma_compile
from kernels.int4_cuda import supports_group as cuda_mma_group
from kernels.int4_gemv import GEMV_MAX_ROWS, GemvConfig, gemv_config, gemv_mm
from kernels.int4_mma import MmaConfig, mma_config, mma_meta, mma_mm, repack_mma
from kernels.int4_triton import TritonInt4Config, dequant_mm, dequant_triton, triton_config, triton_mm
from kernels.reference import dequant_int4, unpack_int4_cols, unpack_int4_rows
from kernels.triton_env import FLOATS, usable

__all__ = [
    "INT4_BACKENDS",
    "CudaMmaConfig",
    "GemvConfig",
    "Int4Backend",
    "Int4Layout",
    "MmaConfig",
    "PreparedInt4",
    "TritonInt4Config",
    "dequant_mm",
    "dequant_triton",
    "gemv_config",
    "int4_mm",
    "mma_config",
    "native_supported",
    "prepare_int4",
    "triton_config",
    "triton_mm",
]

Int4Backend = Literal["reference", "native_cpu", "native_cuda", "native_xpu", "triton", "triton_mma", "triton_gemv",
                      "cuda_mma"]
INT4_BACKENDS: tuple[Int4Backend, ...] = get_args(Int4Backend)

_TINYGEMM_GROUPS = (32, 64, 128, 256)  # what the CPU and CUDA int4pack ops accept (TORCH_CHECK in aten)


@dataclass(frozen=True)
class Int4Layout:
    """One quantized Linear: W is [in_features=K, out_features=N] in groups of group_size along K.

    group_size is the real group length (map AutoRound's -1, "per channel", to in_features before).
    zero_offset: 1 for GPTQ-v1 ("auto_round:auto_gptq", stored zero = zp - 1), 0 for v2.
    """

    group_size: int
    zero_offset: int
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        k, n, g = self.in_features, self.out_features, self.group_size
        if g <= 0 or k <= 0 or n <= 0:
            raise ValueError(f"int4 layout needs positive sizes, got K={k}, N={n}, group_size={g}")
        if k % g or k % 8 or n % 8:
            raise ValueError(
                f"int4 layout needs K % group_size == 0, K % 8 == 0 and N % 8 == 0; got K={k}, N={n}, "
                f"group_size={g}"
            )
        if self.zero_offset not in (0, 1):
            raise ValueError(f"zero_offset must be 0 (GPTQ v2) or 1 (GPTQ v1), got {self.zero_offset}")

    @property
    def num_groups(self) -> int:
        return self.in_features // self.group_size


@dataclass
class PreparedInt4:
    """What one backend needs for y = x @ W; built by prepare_int4, read only by int4_mm.

    weight: reference -> dense W [K, N] (dtype); native_cpu -> uint8 [N, K/2]; native_cuda -> int32
    [N/8, K/(16*t), 32, t/2]; native_xpu -> int32 [N, K/8]; triton -> the checkpoint's qweight [K/8, N];
    triton_mma -> int32 [N/16, K/32, 2, 32] (kernels.int4_mma.repack_mma); cuda_mma -> int32 [N/16, K/64, 32, 4]
    (kernels.int4_cuda.repack_cuda).
    scales / zeros: triton -> scales [K/G, N] and packed qzeros [K/G, N/8]; native_xpu -> scales
    [K/G, N] (dtype) and int8 zero points [K/G, N]; triton_gemv -> the triton tensors.
    scales_and_zeros: native_cpu/cuda [K/G, N, 2];
    triton_mma and cuda_mma int32 [K/G, N], the fp16 scale's bits | zero point << 16 (kernels.int4_mma.mma_meta).
    """

    backend: Int4Backend
    layout: Int4Layout
    dtype: torch.dtype  # activation dtype the backend computes in (x is cast to it, y cast back)
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    scales_and_zeros: torch.Tensor | None = None
    config: MmaConfig | TritonInt4Config | GemvConfig | CudaMmaConfig | None = None
    """Launch shape of the Triton backends (None: the backend's rule); a tuned dispatch keeps copies of one
    PreparedInt4 that differ only here (dataclasses.replace shares the tensors)."""

    @property
    def device(self) -> torch.device:
        """Where the prepared tensors live (the LoRA wrappers ask this instead of guessing)."""
        return self.weight.device


# ----------------------------------------------------------------------------------------------------
# capability checks


def _device_type(backend: Int4Backend) -> str:
    # The device a native backend runs on is part of its name ("native_cpu" -> "cpu").
    return backend.removeprefix("native_")


def _aten_has(op: str) -> bool:
    try:
        getattr(torch.ops.aten, op)
    except (AttributeError, RuntimeError):
        return False
    return True


@functools.cache
def _device_available(device_type: str) -> bool:
    mod = getattr(torch, device_type, None)
    is_available = getattr(mod, "is_available", None)
    try:
        return bool(is_available()) if callable(is_available) else False
    except RuntimeError:
        return False


def native_supported(backend: Int4Backend, layout: Int4Layout, dtype: torch.dtype) -> bool:
    """True where `backend` can run `layout` with activations of `dtype` in this process.

    native_cpu:  group 32/64/128/256, N % 16 == 0, dtype f32/bf16/f16 (found by experiment, torch 2.13).
    native_cuda: group 32/64/128/256, K % 32 == 0, N % 8 == 0, dtype bf16 only, sm80+ (tinygemm).
    native_xpu:  group % 32 == 0, dtype f16/bf16 (oneDNN u4 weights, s8 zero points).
    triton:      group % 16 == 0 (a K tile never straddles two groups), dtype f32/bf16/f16.
    triton_mma:  group % 32 == 0, N % 16 == 0 (the repacked block is 16 outputs x 32 inputs), dtype f32/bf16/f16.
    triton_gemv: as triton (whose kernel takes its rows above one).
    cuda_mma:    group a power-of-two multiple of 64, K % 256 == 0 (its smallest block: 4 warps of 64 k), N % 16 == 0,
                 dtype bf16, CUDA sm80+ with NVRTC.
    reference:   always, for floating dtypes.
    """
    g, k, n = layout.group_size, layout.in_features, layout.out_features
    if dtype not in FLOATS:
        return False
    if backend == "reference":
        return True
    if backend in ("triton", "triton_gemv"):
        return g % 16 == 0 and usable()
    if backend == "triton_mma":
        return g % 32 == 0 and n % 16 == 0 and usable()
    if backend == "cuda_mma":
        return cuda_mma_group(g) and k % 256 == 0 and n % 16 == 0 and dtype == torch.bfloat16 and cuda_mma_available()
    if backend not in INT4_BACKENDS:
        raise ValueError(f"unknown int4 backend {backend!r}; expected one of {INT4_BACKENDS}")
    if not _device_available(_device_type(backend)):
        return False
    if backend == "native_cpu":
        return (
            g in _TINYGEMM_GROUPS
            and n % 16 == 0
            and _aten_has("_weight_int4pack_mm_for_cpu")
            and _aten_has("_convert_weight_to_int4pack_for_cpu")
        )
    if backend == "native_cuda":
        mod = getattr(torch, _device_type(backend))
        return (
            g in _TINYGEMM_GROUPS
            and k % 32 == 0
            and n % 8 == 0
            and dtype == torch.bfloat16
            and tuple(mod.get_device_capability()) >= (8, 0)
        )
    # native_xpu
    return (
        g % 32 == 0
        and dtype in (torch.bfloat16, torch.float16)
        and _aten_has("_weight_int4pack_mm_with_scales_and_zeros")
    )


# ----------------------------------------------------------------------------------------------------
# prepare


def _check_inputs(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, layout: Int4Layout
) -> None:
    k, n, ng = layout.in_features, layout.out_features, layout.num_groups
    want = {"qweight": (k // 8, n), "qzeros": (ng, n // 8), "scales": (ng, n)}
    got = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    for name, shape in want.items():
        if tuple(got[name].shape) != shape:
            raise ValueError(f"int4 {name} has shape {tuple(got[name].shape)}, expected {shape} for {layout}")
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise TypeError(f"qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
    if not scales.is_floating_point():
        raise TypeError(f"scales must be floating point, got {scales.dtype}")


def _zq(qzeros: torch.Tensor, layout: Int4Layout) -> torch.Tensor:
    """zq[g, n] = z(g, n) + zero_offset as int16 (0..16)."""
    return unpack_int4_cols(qzeros) + layout.zero_offset


def _tinygemm_scales_and_zeros(
    qzeros: torch.Tensor, scales: torch.Tensor, layout: Int4Layout, dtype: torch.dtype
) -> torch.Tensor:
    # tinygemm dequantizes (q - 8) * s + zero; GPTQ is s * (q - zq), so zero = s * (8 - zq).
    # Computed in fp32 then rounded once; valid for negative scales too.
    s = scales.to(torch.float32)
    zero = s * (8.0 - _zq(qzeros, layout).to(torch.float32))
    return torch.stack([s, zero], dim=-1).to(dtype).contiguous()  # [K/G, N, 2]


def _inner_k_tiles(k: int) -> int:
    # The CUDA/XPU packers need K % (16 * inner_k_tiles) == 0; bigger tiles mean wider loads.
    for t in (8, 4, 2):
        if k % (16 * t) == 0:
            return t
    raise ValueError(f"K={k} is not a multiple of 32")


def prepare_int4(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    layout: Int4Layout,
    backend: Int4Backend,
    dtype: torch.dtype | None = None,
) -> PreparedInt4:
    """PreparedInt4 such that int4_mm(x, w) == x @ dequant_int4(qweight, qzeros, scales, G, zero_offset).

    dtype is the activation dtype to compute in (default scales.dtype). Tensors must already be on the
    device the backend runs on; the checkpoint tensors may be freed afterwards except for "triton",
    which keeps them (contiguous) as its operands.
    """
    _check_inputs(qweight, qzeros, scales, layout)
    dtype = dtype or scales.dtype
    if not native_supported(backend, layout, dtype):
        raise ValueError(
            f"int4 backend {backend!r} does not support {layout} with {dtype} here "
            "(see kernels.int4.native_supported); use 'triton' or 'reference'"
        )
    if backend.startswith("native_") and qweight.device.type != _device_type(backend):
        raise ValueError(
            f"int4 backend {backend!r} needs tensors on {_device_type(backend)!r}, got {qweight.device}"
        )
    g, k = layout.group_size, layout.in_features

    if backend == "reference":
        dense = dequant_int4(qweight, qzeros, scales, g, layout.zero_offset, dtype=dtype)
        return PreparedInt4(backend, layout, dtype, weight=dense.contiguous())

    if backend in ("triton", "triton_gemv"):
        return PreparedInt4(
            backend,
            layout,
            dtype,
            weight=qweight.contiguous(),
            scales=scales.contiguous(),  # kept as stored (fp16 -> bf16 would lose bits); read as fp32
            zeros=qzeros.contiguous(),
        )

    if backend == "triton_mma":
        return PreparedInt4(backend, layout, dtype, weight=repack_mma(qweight.contiguous()),
                            scales_and_zeros=mma_meta(scales, _zq(qzeros, layout)))

    if backend == "cuda_mma":
        if not qweight.is_cuda:
            raise ValueError(f"int4 backend 'cuda_mma' needs tensors on the GPU, got {qweight.device}")
        cuda_mma_compile(qweight.device)  # before any graph capture can need the module
        return PreparedInt4(backend, layout, dtype, weight=repack_cuda(qweight.contiguous()),
                            scales_and_zeros=mma_meta(scales, _zq(qzeros, layout)))

    u_nk = unpack_int4_rows(qweight).t().to(torch.int32)  # [N, K], values 0..15

    if backend == "native_cpu":
        # The CPU packer takes plain int32 [N, K] codes (inner_k_tiles is ignored on CPU).
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u_nk.contiguous(), 2)
        sz = _tinygemm_scales_and_zeros(qzeros, scales, layout, dtype)
        return PreparedInt4(backend, layout, dtype, weight=packed, scales_and_zeros=sz)

    if backend == "native_cuda":
        # CUDA packer input: uint8 [N, K/2], byte i = (u[2i] << 4) | u[2i+1] (even k in the HIGH nibble).
        u8 = ((u_nk[:, 0::2] << 4) | u_nk[:, 1::2]).to(torch.uint8).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack(u8, _inner_k_tiles(k))
        sz = _tinygemm_scales_and_zeros(qzeros, scales, layout, dtype)
        return PreparedInt4(backend, layout, dtype, weight=packed, scales_and_zeros=sz)

    # native_xpu: oneDNN reads u4 weights [N, K/8] int32 (k contiguous, LSB nibble first), scales
    # [K/G, N] in the activation dtype and s8 zero points [K/G, N]: W = (u - zp) * scale, i.e. GPTQ as is.
    # XPU packer input: uint8 [N, K/2], byte i = (u[2i+1] << 4) | u[2i] (even k in the LOW nibble).
    u8 = ((u_nk[:, 1::2] << 4) | u_nk[:, 0::2]).to(torch.uint8).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack(u8, _inner_k_tiles(k))
    zp = _zq(qzeros, layout).to(torch.int8).contiguous()
    return PreparedInt4(backend, layout, dtype, weight=packed, scales=scales.to(dtype).contiguous(), zeros=zp)


# ----------------------------------------------------------------------------------------------------
# matmul


def int4_mm(x: torch.Tensor, w: PreparedInt4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[..., n] = sum_k x[..., k] * W[k, n] + bias[n] (fp32 accumulate), returned in x.dtype."""
    k, n = w.layout.in_features, w.layout.out_features
    if x.shape[-1] != k:
        raise ValueError(f"int4_mm: x has {x.shape[-1]} input features, the weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty(*lead, n)

    if w.backend == "triton":
        assert w.config is None or isinstance(w.config, TritonInt4Config)
        y = triton_mm(x2, w, bias, w.config)
        return y.reshape(*lead, n)
    if w.backend == "triton_gemv":
        assert w.config is None or isinstance(w.config, GemvConfig)
        y = gemv_mm(x2, w, bias, w.config) if x2.shape[0] <= GEMV_MAX_ROWS else triton_mm(x2, w, bias)
        return y.reshape(*lead, n)
    if w.backend == "cuda_mma":
        assert w.scales_and_zeros is not None
        assert w.config is None or isinstance(w.config, CudaMmaConfig)
        xb = x2.to(torch.bfloat16)
        parts = [cuda_mm(xb[i:i + CUDA_MAX_ROWS], w.weight, w.scales_and_zeros, w.layout.group_size, bias,
                         w.config if xb.shape[0] <= CUDA_MAX_ROWS else None)
                 for i in range(0, xb.shape[0], CUDA_MAX_ROWS)]
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        return y.to(x.dtype).reshape(*lead, n)
    if w.backend == "triton_mma":
        assert w.scales_and_zeros is not None
        assert w.config is None or isinstance(w.config, MmaConfig)
        y = mma_mm(x2, w.weight, w.scales_and_zeros, w.layout.group_size, bias, w.config)
        return y.reshape(*lead, n)

    xc = x2.to(w.dtype).contiguous()  # the native ops require a contiguous 2-D A in their dtype
    if w.backend == "reference":
        y = xc @ w.weight
    elif w.backend == "native_cpu":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xc, w.weight, w.layout.group_size, w.scales_and_zeros)
    elif w.backend == "native_cuda":
        y = torch.ops.aten._weight_int4pack_mm(xc, w.weight, w.layout.group_size, w.scales_and_zeros)
    elif w.backend == "native_xpu":
        y = torch.ops.aten._weight_int4pack_mm_with_scales_and_zeros(
            xc, w.weight, w.layout.group_size, w.scales, w.zeros
        )
        y = y[:, :n]  # the XPU op may pad N to its tile width
    else:
        raise ValueError(f"unknown int4 backend {w.backend!r}")
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).reshape(*lead, n)
