"""The small per-layer ops (RMSNorm with the residual add, silu-and-mul, the KV cache write, q / k's norm + rotary
with that write, and gated attention's output gate) behind one interface: `backend` is "reference"
(kernels.reference, any device) or "triton" (kernels.fused_triton, one launch per op). The caller (engine/device.py)
picks the backend. norm_rope alone is the reference's: the Triton backend only runs it joined with the cache write
(rope_write_kv)."""

from __future__ import annotations

import torch

from kernels import reference as ref
from kernels.attention import write_kv as write_kv_ref

FUSED_BACKENDS = ("reference", "triton")


def _check(backend: str) -> None:
    if backend not in FUSED_BACKENDS:
        raise ValueError(f"unknown fused-op backend {backend!r}; available: {', '.join(FUSED_BACKENDS)}")


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    """weight [D] contiguous for x [..., D]; a residual of x's shape and dtype."""
    if (weight.shape != (x.size(-1),) or not weight.is_contiguous()
            or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} (contiguous), "
                         f"residual {None if residual is None else (tuple(residual.shape), residual.dtype)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool,
             residual: torch.Tensor | None, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) of kernels.reference.rms_norm: h = x (+ residual), y = normed h."""
    _check(backend)
    check_rms_norm(x, weight, residual)
    if backend == "triton":
        from kernels.fused_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, zero_centered, residual)
    return ref.rms_norm(x, weight, eps, zero_centered, residual)


def _check_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int,
                weight: torch.Tensor | None) -> None:
    d = x.size(-1)
    if (x.dim() != 3 or rotary_dim % 2 or not 0 < rotary_dim <= d or cos_sin.dim() != 2
            or cos_sin.size(-1) != rotary_dim or not cos_sin.is_contiguous() or positions.shape != (x.size(0),)):
        raise ValueError(f"norm_rope: x {tuple(x.shape)}, positions {tuple(positions.shape)}, rotary_dim "
                         f"{rotary_dim}, cos_sin {tuple(cos_sin.shape)} (contiguous)")
    if weight is not None and (weight.shape != (d,) or not weight.is_contiguous()):
        raise ValueError(f"norm_rope: weight {tuple(weight.shape)} (contiguous) for head_dim {d}")


def norm_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int,
              weight: torch.Tensor | None, eps: float, zero_centered: bool) -> torch.Tensor:
    """rope_neox(rms_norm(x) if weight is given else x) per head: x [T, H, D] -> [T, H, D] (torch ops)."""
    _check_rope(x, positions, cos_sin, rotary_dim, weight)
    if weight is not None:
        x = ref.rms_norm(x, weight, eps, zero_centered)[0]
    return ref.rope_neox(x, cos_sin, positions, rotary_dim)


def silu_and_mul(x: torch.Tensor, backend: str) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:]."""
    _check(backend)
    if x.size(-1) % 2:
        raise ValueError(f"silu_and_mul: odd last dim {x.size(-1)}")
    if backend == "triton":
        from kernels.fused_triton import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return ref.silu_and_mul(x)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor, backend: str) -> torch.Tensor:
    """o * sigmoid(gate) for gated attention's output: o [T, H * D], gate [T, H, D] (a strided view of the query
    projection: the torch form copies it first). Triton: one launch where torch takes three."""
    _check(backend)
    t, h, d = gate.shape
    if o.shape != (t, h * d) or o.dtype != gate.dtype:
        raise ValueError(f"sigmoid_gate: o {tuple(o.shape)} {o.dtype}, gate {tuple(gate.shape)} {gate.dtype}")
    if backend == "triton":
        from kernels.fused_triton import sigmoid_gate_triton

        return sigmoid_gate_triton(o.contiguous(), gate if gate.stride(2) == 1 else gate.contiguous())
    return o * torch.sigmoid(gate.reshape(t, -1))


def _check_write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    if (v_cache.shape != k_cache.shape or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or slot_mapping.shape != (k.size(0),) or v.size(0) != k.size(0)):
        raise ValueError(f"write_kv: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} (contiguous), k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}, slot_mapping {tuple(slot_mapping.shape)}")


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, backend: str) -> None:
    """kernels.attention.write_kv: k_cache.flat[slot_mapping[t]] = k[t]; v likewise."""
    _check(backend)
    _check_write_kv(k_cache, v_cache, k, v, slot_mapping)
    if backend == "triton":
        from kernels.fused_triton import write_kv_triton

        write_kv_triton(k_cache, v_cache, k, v, slot_mapping)
    else:
        write_kv_ref(k_cache, v_cache, k, v, slot_mapping)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                  rotary_dim: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                  zero_centered: bool, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  backend: str) -> torch.Tensor:
    """Returns norm_rope(q); writes norm_rope(k) and v into the caches at slot_mapping (write_kv). q [T, Hq, D],
    k / v [T, Hkv, D], caches [blocks, block_size, Hkv, D], all in one dtype; both norms (one dtype) or neither.
    Triton: one launch where the separate ops take three (a decode step at batch 1 is mostly launches)."""
    _check(backend)
    _check_rope(q, positions, cos_sin, rotary_dim, q_weight)
    _check_rope(k, positions, cos_sin, rotary_dim, k_weight)
    _check_write_kv(k_cache, v_cache, k, v, slot_mapping)
    dtypes = {q.dtype, k.dtype, v.dtype, k_cache.dtype, v_cache.dtype}
    if (v.shape != k.shape or q.size(2) != k.size(2) or k_cache.shape[-2:] != k.shape[1:] or len(dtypes) != 1
            or (q_weight is None) != (k_weight is None)
            or (q_weight is not None and k_weight is not None and q_weight.dtype != k_weight.dtype)):
        raise ValueError(f"rope_write_kv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, caches "
                         f"{tuple(k_cache.shape)}, dtypes {sorted(map(str, dtypes))}, norm weights "
                         f"{[None if w is None else w.dtype for w in (q_weight, k_weight)]}")
    if backend == "triton":
        from kernels.fused_triton import rope_write_kv_triton

        return rope_write_kv_triton(q, k, v, positions, cos_sin, rotary_dim, q_weight, k_weight, eps, zero_centered,
                                    k_cache, v_cache, slot_mapping)
    write_kv(k_cache, v_cache, norm_rope(k, positions, cos_sin, rotary_dim, k_weight, eps, zero_centered), v,
             slot_mapping, backend)
    return norm_rope(q, positions, cos_sin, rotary_dim, q_weight, eps, zero_centered)
