"""int4 weight-only matmul (W4A16) for the AutoRound / GPTQ layout, behind one interface.

    w = prepare_int4(qweight, qzeros, scales, layout, backend)  # once, after loading and TP slicing
    y = int4_mm(x, w, bias)  # y = x @ W + bias, W as in kernels.reference

Backends (each checked against kernels.reference.int4_matmul by tests/kernels/test_int4.py):
  reference    dequantize once to a dense [K, N] weight; torch.matmul. Any device, any layout.
  native_cpu   torch._weight_int4pack_mm_for_cpu         (tinygemm-style: (q - 8) * scale + zero)
  native_cuda  torch._weight_int4pack_mm                 (tinygemm on tensor cores, bf16 only)
  native_xpu   torch._weight_int4pack_mm_with_scales_and_zeros  (oneDNN: (q - zp) * scale, int8 zp)
  triton       our Triton kernel, reading qweight / packed qzeros / scales as stored in the checkpoint
This module never picks a device: the caller (engine/device.py) chooses the backend; a native backend
only accepts tensors on the device its name says.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from kernels.reference import dequant_int4, unpack_int4_cols, unpack_int4_rows
from kernels.triton_env import FLOATS, interpreting, tl, triton, usable

__all__ = [
    "INT4_BACKENDS",
    "Int4Backend",
    "Int4Layout",
    "PreparedInt4",
    "TritonInt4Config",
    "int4_mm",
    "native_supported",
    "prepare_int4",
    "triton_config",
    "triton_mm",
]

Int4Backend = Literal["reference", "native_cpu", "native_cuda", "native_xpu", "triton"]
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
    [N/8, K/(16*t), 32, t/2]; native_xpu -> int32 [N, K/8]; triton -> the checkpoint's qweight [K/8, N].
    scales / zeros: triton -> scales [K/G, N] and packed qzeros [K/G, N/8]; native_xpu -> scales
    [K/G, N] (dtype) and int8 zero points [K/G, N]. scales_and_zeros: native_cpu/cuda [K/G, N, 2].
    """

    backend: Int4Backend
    layout: Int4Layout
    dtype: torch.dtype  # activation dtype the backend computes in (x is cast to it, y cast back)
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    scales_and_zeros: torch.Tensor | None = None

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
    reference:   always, for floating dtypes.
    """
    g, k, n = layout.group_size, layout.in_features, layout.out_features
    if dtype not in FLOATS:
        return False
    if backend == "reference":
        return True
    if backend == "triton":
        return g % 16 == 0 and usable()
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

    if backend == "triton":
        return PreparedInt4(
            backend,
            layout,
            dtype,
            weight=qweight.contiguous(),
            scales=scales.contiguous(),  # kept as stored (fp16 -> bf16 would lose bits); read as fp32
            zeros=qzeros.contiguous(),
        )

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
    """y[..., n] = sum_k x[..., k] * W[k, n] + bias[n]  (fp32 accumulate), returned in x.dtype."""
    k, n = w.layout.in_features, w.layout.out_features
    if x.shape[-1] != k:
        raise ValueError(f"int4_mm: x has {x.shape[-1]} input features, the weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty(*lead, n)

    if w.backend == "triton":
        y = triton_mm(x2, w, bias)
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


# ----------------------------------------------------------------------------------------------------
# Triton W4A16 kernel (GPTQ layout read directly)

if triton is not None:

    @triton.jit
    def _w4a16_gptq_kernel(
        x_ptr, qw_ptr, s_ptr, qz_ptr, b_ptr, out_ptr,
        M, N, K_PER_SPLIT,
        stride_xm, stride_qk, stride_sg, stride_zg,
        GROUP_SIZE: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
        FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """out[split, m, n] = sum_{k in split} x[m, k] * s[k//G, n] * (u(k, n) - zq(k//G, n))  (+ bias[n]).

        Grid (M tiles, N tiles, splits of K). PARTIAL: fp32 partial sums [splits, M, N], summed by the host
        in a fixed order (deterministic split-K for decode); else the result itself [M, N] in out's dtype.
        Each packed word is loaded once and unpacked to its 8 k rows in registers.
        """
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_w = tl.arange(0, BLOCK_K // 8)
        mask_m = offs_m < M
        mask_n = offs_n < N
        k_start = pid_k * K_PER_SPLIT
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + tl.arange(0, BLOCK_K))[None, :]
        qw_ptrs = qw_ptr + (k_start // 8 + offs_w)[:, None] * stride_qk + offs_n[None, :]
        shifts = (tl.arange(0, 8) * 4)[None, :, None]  # nibble j of a word holds k = 8 * row + j
        z_shift = (offs_n % 8) * 4

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The host guarantees GROUP_SIZE % BLOCK_K == 0 and K_PER_SPLIT % BLOCK_K == 0: one group per K
        # tile, so the scale applies to the tile's partial product of small integers (exact in bf16).
        for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
            g = k0 // GROUP_SIZE
            words = tl.load(qw_ptrs, mask=mask_n[None, :], other=0)
            u = tl.reshape((words[:, None, :] >> shifts) & 0xF, (BLOCK_K, BLOCK_N))  # & drops sign bits
            zw = tl.load(qz_ptr + g * stride_zg + offs_n // 8, mask=mask_n, other=0)
            zq = ((zw >> z_shift) & 0xF) + ZERO_OFFSET
            s = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            q = u - zq[None, :]  # integers in [-16, 15]
            if FP32_DOT:
                part = tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(x, q.to(x.dtype))  # fp32 accumulate
            acc += part * s[None, :]
            x_ptrs += BLOCK_K
            qw_ptrs += (BLOCK_K // 8) * stride_qk

        mask = mask_m[:, None] & mask_n[None, :]
        if PARTIAL:
            p_ptrs = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
            tl.store(p_ptrs, acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class TritonInt4Config:
    """Launch shape of the Triton W4A16 kernel for one (M, K, N)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


SPLIT_K_TARGET_CTAS = 512
"""Decode (small M) splits K until about this many programs run: one program per N tile leaves most of
a large GPU idle when N / BLOCK_N is near the SM count, and the weight read is the whole cost."""


@functools.lru_cache(maxsize=4096)  # called per layer per step
def triton_config(m: int, k: int, n: int, group_size: int) -> TritonInt4Config:
    """Best launch shapes measured on an H200 at Qwen3-8B shapes for M in {1, 16, 32, 64}
    (benchmarks/bench_int4.py --sweep; docs/PERFORMANCE.md): BLOCK_N 64, 4 warps, 3 stages, and K split
    until about 512 programs run (6144 columns: 4 splits; 4096: 8; 24576: none)."""
    block_k = max(b for b in (16, 32, 64, 128) if group_size % b == 0)
    if m <= 64:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_n = 64
        tiles = triton.cdiv(n, block_n)
        split = 1
        while (tiles * split * 2 <= SPLIT_K_TARGET_CTAS and k % (block_k * split * 2) == 0
               and k // (split * 2) >= 4 * block_k):
            split *= 2
        return TritonInt4Config(block_m, block_n, block_k, split, num_warps=4, num_stages=3)
    return TritonInt4Config(64, 128, min(block_k, 64), 1, num_warps=4, num_stages=3)


def triton_mm(x2: torch.Tensor, w: PreparedInt4, bias: torch.Tensor | None,
              config: TritonInt4Config | None = None) -> torch.Tensor:
    """int4_mm for the triton backend with an explicit launch shape (default: triton_config's)."""
    if triton is None:
        raise RuntimeError("int4 backend 'triton' needs the triton package")
    assert w.scales is not None and w.zeros is not None
    m, k = x2.shape
    n, g = w.layout.out_features, w.layout.group_size
    if x2.dtype not in FLOATS:
        raise TypeError(f"int4_mm: unsupported activation dtype {x2.dtype}")
    c = config or triton_config(m, k, n, g)
    if g % c.block_k or k % (c.block_k * c.split_k):
        raise ValueError(f"int4 triton config {c} does not fit K={k}, group {g}")
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    partial = c.split_k > 1
    out = torch.empty((c.split_k, m, n) if partial else (m, n), dtype=torch.float32 if partial else x2.dtype,
                      device=x2.device)
    b = bias.contiguous() if bias is not None else out  # dummy pointer when HAS_BIAS is False
    grid = (triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n), c.split_k)
    fp32_dot = x2.dtype == torch.float32 or (x2.dtype == torch.bfloat16 and interpreting())
    _w4a16_gptq_kernel[grid](
        x2, w.weight, w.scales, w.zeros, b, out,
        m, n, k // c.split_k,
        x2.stride(0), w.weight.stride(0), w.scales.stride(0), w.zeros.stride(0),
        GROUP_SIZE=g, ZERO_OFFSET=w.layout.zero_offset, HAS_BIAS=bias is not None, PARTIAL=partial,
        FP32_DOT=fp32_dot, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    if not partial:
        return out
    y = out.sum(0)  # a fixed-order reduction: the same bits on every run
    if bias is not None:
        y += bias.float()
    return y.to(x2.dtype)


# ----------------------------------------------------------------------------------------------------
# Fused dequantization (for large M: dequantize once into a transient dense weight, then a dense GEMM)

if triton is not None:

    @triton.jit
    def _dequant_gptq_kernel(qw_ptr, qz_ptr, sc_ptr, out_ptr, KW, N, GROUP_SIZE: tl.constexpr,
                             ZERO_OFFSET: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        """W[8r + j, n] = scales[(8r+j)//G, n] * (u_j(qweight[r, n]) - (z((8r+j)//G, n) + ZERO_OFFSET))."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < KW) & (cols[None, :] < N)
        words = tl.load(qw_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0)
        grp = (rows * 8) // GROUP_SIZE  # the 8 k of a word share a group (G is a multiple of 8)
        zw = tl.load(qz_ptr + grp[:, None] * (N // 8) + cols[None, :] // 8, mask=mask, other=0)
        z = ((zw >> ((cols[None, :] % 8) * 4)) & 0xF) + ZERO_OFFSET
        s = tl.load(sc_ptr + grp[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(8):
            u = (words >> (4 * j)) & 0xF
            w = (u - z).to(tl.float32) * s
            tl.store(out_ptr + (rows[:, None] * 8 + j) * N + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequant_triton(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                   zero_offset: int, dtype: torch.dtype) -> torch.Tensor:
    """kernels.reference.dequant_int4 in one Triton pass: W [K, N] in dtype."""
    if triton is None:
        raise RuntimeError("dequant_triton needs the triton package")
    kw, n = qweight.shape
    if group_size % 8 or qzeros.shape != (kw * 8 // group_size, n // 8) or scales.shape != (kw * 8 // group_size, n):
        raise ValueError(f"dequant_triton: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales "
                         f"{tuple(scales.shape)} do not fit group size {group_size}")
    out = torch.empty(kw * 8, n, dtype=dtype, device=qweight.device)
    block_r, block_n = 16, 128
    _dequant_gptq_kernel[(triton.cdiv(kw, block_r), triton.cdiv(n, block_n))](
        qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), out, kw, n, GROUP_SIZE=group_size,
        ZERO_OFFSET=zero_offset, BLOCK_R=block_r, BLOCK_N=block_n)
    return out
