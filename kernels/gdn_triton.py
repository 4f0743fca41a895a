"""Gated DeltaNet decode step in one Triton launch, on the state slots in place (kernels.gdn.delta_rule_decode's
"fla" backend). Per sequence b, value head h (key head h // (Hv / Hk)), state S = states[index[b], h] [Dk, Dv]:

    q = l2norm(q) / sqrt(Dk); k = l2norm(k); S *= exp(g); S += k (beta (v - S^T k))^T; o = S^T q

fla-core's fused_recurrent kernel does the same on a dense [B, Hv, Dk, Dv] state, so the caller gathered the slots
first (states[index]) and scattered them back after: two more passes over the whole state, which is Qwen3.6-27B's
largest decode read (3 MiB per sequence and layer). Here each program reads its [Dk, BV] tile of its slot, updates
it and writes it back. Rows of one step must name distinct slots, or share one nothing reads (the graphs' scratch
slot for padding rows).
"""

from __future__ import annotations

import torch

from kernels.triton_env import tl, triton

__all__ = ["delta_rule_decode_triton"]

BLOCK_V = 32
"""Value columns per program: a [Dk, 32] float32 tile per program (16 KiB at Dk = 128) stays in registers."""

if triton is not None:

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, index_ptr, o_ptr, scale,
                       stride_q, stride_k, stride_v, stride_g, stride_beta,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        hk = h // (HV // HK)
        rk = tl.arange(0, BLOCK_K)
        rv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        mk, mv = rk < DK, rv < DV
        q = tl.load(q_ptr + b * stride_q + hk * DK + rk, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * stride_k + hk * DK + rk, mask=mk, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(v_ptr + b * stride_v + h * DV + rv, mask=mv, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + b * stride_g + h).to(tl.float32)
        beta = tl.load(beta_ptr + b * stride_beta + h).to(tl.float32)
        slot = tl.load(index_ptr + b).to(tl.int64)
        tile = s_ptr + ((slot * HV + h) * DK + rk[:, None]) * DV + rv[None, :]
        mask = mk[:, None] & mv[None, :]
        s = tl.load(tile, mask=mask, other=0.0) * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        tl.store(tile, s, mask=mask)
        tl.store(o_ptr + (b * HV + h) * DV + rv, tl.sum(s * q[:, None], axis=0), mask=mv)


def delta_rule_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """q, k [B, Hk, Dk] raw; v [B, Hv, Dv]; g, beta [B, Hv]; states [S, Hv, Dk, Dv] float32 contiguous, updated in
    place at rows index [B]. Returns o [B, Hv, Dv] float32. Rows may be strided (views of a wider projection);
    each row's heads must be contiguous."""
    if triton is None:
        raise RuntimeError("the Triton gated-delta-rule decode needs triton")
    bsz, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if k.shape != q.shape or v.size(0) != bsz or hv % hk:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need q == k and Hv % Hk == 0")
    if g.shape != (bsz, hv) or beta.shape != (bsz, hv) or index.shape != (bsz,):
        raise ValueError(f"g {tuple(g.shape)}, beta {tuple(beta.shape)}, index {tuple(index.shape)}: need [B, Hv] "
                         f"and [B] for B={bsz}, Hv={hv}")
    if states.dtype != torch.float32 or not states.is_contiguous() or states.shape[1:] != (hv, dk, dv):
        raise ValueError(f"states {tuple(states.shape)} {states.dtype}: need contiguous float32 [S, {hv}, {dk}, {dv}]")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1 or x.stride(1) != x.size(2):
            raise ValueError(f"{name}: each row's heads must be contiguous, strides {x.stride()}")
    for name, x in (("g", g), ("beta", beta)):
        if x.stride(1) != 1:
            raise ValueError(f"{name}: heads must be contiguous, strides {x.stride()}")
    o = torch.empty(bsz, hv, dv, dtype=torch.float32, device=v.device)
    if bsz == 0:
        return o
    grid = (bsz, hv, triton.cdiv(dv, BLOCK_V))
    _decode_kernel[grid](q, k, v, g, beta, states, index, o, dk ** -0.5,
                         q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0),
                         HK=hk, HV=hv, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=BLOCK_V)
    return o
