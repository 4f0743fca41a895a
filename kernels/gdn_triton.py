"""Gated DeltaNet in Triton (kernels.gdn's "fla" and "triton" backends): launches that each replace a chain of torch
ops. A decode step runs three: the conv, the recurrence with its gating, the gated norm (decode_out). Prompts'
steps run the gating and the gated norm (the recurrence is fla-core's or torch's).

    gating:          g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), from the [b | a] projection
    conv_decode:     y[b] = silu(sum_k [states[index[b]] | x[b]] * w); states[index[b]] shifts by one in place
    gated_rms_norm:  y[t, h] = (w * rms_norm(o[t, h])) * silu(z[t, h])
    delta_rule_decode, per sequence b, value head h (key head h // (Hv / Hk)), S = states[index[b], h] [Dk, Dv]:

    q = l2norm(q) / sqrt(Dk); k = l2norm(k); S *= exp(g); S += k (beta (v - S^T k))^T; o = S^T q

    decode_out:      gated_rms_norm(delta_rule_decode(q, k, v, gating(ab)), z): the gating inside the recurrence

fla-core's fused_recurrent kernel does the recurrence on a dense [B, Hv, Dk, Dv] state, so the caller gathered the
slots first (states[index]) and scattered them back after: two more passes over the whole state, which is
Qwen3.6-27B's largest decode read (3 MiB per sequence and layer). Here each program reads its tile of its slot,
updates it and writes it back (on an H100, 3.6x faster than the gathered form at batch 32:
benchmarks/bench_gdn_decode.py). Rows of one step must name distinct slots, or share one nothing reads (the graphs'
scratch slot for padding rows). The gating, the conv and the gated norm replace about 7, 9 and 12 small torch
launches per layer.
"""

from __future__ import annotations

import torch

from kernels.triton_env import tl, triton

__all__ = [
    "conv_decode_triton", "decode_out_triton", "delta_rule_decode_triton", "gated_rms_norm_triton", "gating_triton",
]

BLOCK_V = 32
"""Value columns per program: a [Dk, 32] float32 tile per program (16 KiB at Dk = 128) stays in registers."""

if triton is not None:

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, s_ptr, index_ptr, o_ptr, scale,
                       stride_q, stride_k, stride_v, stride_g, stride_beta,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, GATED: tl.constexpr):
        # GATED: g_ptr is the [b | a] projection, and the program computes its head's g and beta (_gating_kernel's
        # formulas); beta_ptr, a_log_ptr and dt_bias_ptr otherwise unused.
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
        if GATED:
            a = tl.load(g_ptr + b * stride_g + HV + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
            softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # torch's threshold
            g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus
            beta = 1.0 / (1.0 + tl.exp(-tl.load(g_ptr + b * stride_g + h).to(tl.float32)))
        else:
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

    @triton.jit
    def _conv_decode_kernel(x_ptr, s_ptr, w_ptr, index_ptr, y_ptr, C, stride_x, K: tl.constexpr,
                            BLOCK_C: tl.constexpr):
        b, cb = tl.program_id(0), tl.program_id(1)
        rc = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        mc = rc < C
        slot = tl.load(index_ptr + b).to(tl.int64)
        row = s_ptr + (slot * C + rc) * (K - 1)
        x = tl.load(x_ptr + b * stride_x + rc, mask=mc, other=0.0).to(s_ptr.dtype.element_ty)
        # One [BLOCK_C] vector per window position, all in one layout: each thread reads and then shifts its own
        # channels' state (a 2-D tile would let a thread read a position another thread has already overwritten).
        y = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K - 1):
            sj = tl.load(row + j, mask=mc, other=0.0)
            y += sj.to(tl.float32) * tl.load(w_ptr + rc * K + j, mask=mc, other=0.0).to(tl.float32)
            if j > 0:
                tl.store(row + j - 1, sj, mask=mc)
        y += x.to(tl.float32) * tl.load(w_ptr + rc * K + K - 1, mask=mc, other=0.0).to(tl.float32)
        tl.store(row + K - 2, x, mask=mc)
        tl.store(y_ptr + b * C + rc, (y / (1.0 + tl.exp(-y))).to(y_ptr.dtype.element_ty), mask=mc)

    @triton.jit
    def _gating_kernel(ab_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, stride_ab, HV: tl.constexpr,
                       BLOCK: tl.constexpr):
        t = tl.program_id(0)
        r = tl.arange(0, BLOCK)
        m = r < HV
        b = tl.load(ab_ptr + t * stride_ab + r, mask=m, other=0.0).to(tl.float32)
        a = tl.load(ab_ptr + t * stride_ab + HV + r, mask=m, other=0.0).to(tl.float32)
        a = a + tl.load(dt_bias_ptr + r, mask=m, other=0.0).to(tl.float32)
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # torch's threshold
        g = -tl.exp(tl.load(a_log_ptr + r, mask=m, other=0.0).to(tl.float32)) * softplus
        tl.store(g_ptr + t * HV + r, g, mask=m)
        tl.store(beta_ptr + t * HV + r, 1.0 / (1.0 + tl.exp(-b)), mask=m)

    @triton.jit
    def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, y_ptr, eps, stride_z, HV: tl.constexpr, DV: tl.constexpr,
                           BLOCK: tl.constexpr):
        t, h = tl.program_id(0), tl.program_id(1)
        r = tl.arange(0, BLOCK)
        m = r < DV
        o = tl.load(o_ptr + (t * HV + h) * DV + r, mask=m, other=0.0)
        o = o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps)
        dt = y_ptr.dtype.element_ty
        w = tl.load(w_ptr + r, mask=m, other=0.0).to(tl.float32)
        gated = (w * o.to(dt).to(tl.float32)).to(dt).to(tl.float32)  # rounded where the torch form rounds
        z = tl.load(z_ptr + t * stride_z + h * DV + r, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + (t * HV + h) * DV + r, (gated * (z / (1.0 + tl.exp(-z)))).to(dt), mask=m)


def _check_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, states: torch.Tensor, index: torch.Tensor) -> None:
    bsz, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if k.shape != q.shape or v.size(0) != bsz or hv % hk or index.shape != (bsz,):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, index {tuple(index.shape)}: "
                         f"need q == k, Hv % Hk == 0 and index [B]")
    if states.dtype != torch.float32 or not states.is_contiguous() or states.shape[1:] != (hv, dk, dv):
        raise ValueError(f"states {tuple(states.shape)} {states.dtype}: need contiguous float32 [S, {hv}, {dk}, {dv}]")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1 or x.stride(1) != x.size(2):
            raise ValueError(f"{name}: each row's heads must be contiguous, strides {x.stride()}")


def delta_rule_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """q, k [B, Hk, Dk] raw; v [B, Hv, Dv]; g, beta [B, Hv]; states [S, Hv, Dk, Dv] float32 contiguous, updated in
    place at rows index [B]. Returns o [B, Hv, Dv] float32. Rows may be strided (views of a wider projection);
    each row's heads must be contiguous."""
    if triton is None:
        raise RuntimeError("the Triton gated-delta-rule decode needs triton")
    bsz, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if g.shape != (bsz, hv) or beta.shape != (bsz, hv):
        raise ValueError(f"g {tuple(g.shape)}, beta {tuple(beta.shape)}: need [B, Hv] for B={bsz}, Hv={hv}")
    _check_decode(q, k, v, states, index)
    for name, x in (("g", g), ("beta", beta)):
        if x.stride(1) != 1:
            raise ValueError(f"{name}: heads must be contiguous, strides {x.stride()}")
    o = torch.empty(bsz, hv, dv, dtype=torch.float32, device=v.device)
    if bsz == 0:
        return o
    grid = (bsz, hv, triton.cdiv(dv, BLOCK_V))
    _decode_kernel[grid](q, k, v, g, beta, g, g, states, index, o, dk ** -0.5,
                         q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0),
                         HK=hk, HV=hv, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=BLOCK_V, GATED=False)
    return o


def decode_out_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ab: torch.Tensor, a_log: torch.Tensor,
                      dt_bias: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, eps: float, states: torch.Tensor,
                      index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """kernels.gdn.gdn_decode_out in two launches: the recurrence in place with its gating (each program computes
    its head's g and beta), then the gated norm. q, k [B, Hk, Dk] raw, v and z [B, Hv, Dv], ab [B, 2 Hv], A_log and
    dt_bias [Hv], norm_w [Dv], states as delta_rule_decode_triton's. Returns [B, Hv, Dv] in dtype.
    The norm stays apart: a program over a whole [Dk, Dv] slot (one per SM for its registers) was 4-18 % slower
    than the three launches on an H100 (bench_gdn_decode.py, thirty-first session)."""
    if triton is None:
        raise RuntimeError("the Triton gated-delta-rule decode needs triton")
    bsz, hv, dv = v.shape
    dk = q.size(2)
    if ab.shape != (bsz, 2 * hv) or a_log.shape != (hv,) or dt_bias.shape != (hv,) or ab.stride(1) != 1:
        raise ValueError(f"v {tuple(v.shape)}, ab {tuple(ab.shape)} strides {ab.stride()}, A_log "
                         f"{tuple(a_log.shape)}, dt_bias {tuple(dt_bias.shape)}: need ab [B, 2 Hv] with contiguous "
                         f"rows, A_log and dt_bias [Hv]")
    if z.shape != v.shape or z.stride(2) != 1 or z.stride(1) != dv or norm_w.shape != (dv,):
        raise ValueError(f"z {tuple(z.shape)} strides {z.stride()}, norm {tuple(norm_w.shape)}: need z as v with each "
                         f"row contiguous, norm [Dv]")  # before the launch that updates the states
    _check_decode(q, k, v, states, index)
    o = torch.empty(bsz, hv, dv, dtype=torch.float32, device=v.device)
    if bsz:
        _decode_kernel[(bsz, hv, triton.cdiv(dv, BLOCK_V))](
            q, k, v, ab, ab, a_log, dt_bias, states, index, o, dk ** -0.5, q.stride(0), k.stride(0), v.stride(0),
            ab.stride(0), ab.stride(0), HK=q.size(1), HV=hv, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk),
            BLOCK_V=BLOCK_V, GATED=True)
    return gated_rms_norm_triton(o, z, norm_w, eps, dtype)


def conv_decode_triton(x: torch.Tensor, states: torch.Tensor, index: torch.Tensor,
                       weight: torch.Tensor) -> torch.Tensor:
    """kernels.gdn.causal_conv1d_decode in one launch: y[b] = silu(sum_k [states[index[b]] | x[b]] * weight), the
    slot's state shifted by one in place. x [B, C] (rows may be strided), states [S, C, K-1] contiguous, weight
    [C, K] contiguous; returns y [B, C] in x's dtype."""
    if triton is None:
        raise RuntimeError("the Triton causal-conv decode needs triton")
    bsz, c = x.shape
    k = weight.size(1)
    if states.shape[1:] != (c, k - 1) or weight.shape != (c, k) or index.shape != (bsz,) or k < 2:
        raise ValueError(f"x {tuple(x.shape)}, states {tuple(states.shape)}, weight {tuple(weight.shape)}, index "
                         f"{tuple(index.shape)}: need states [S, C, K-1], weight [C, K], index [B]")
    if not (states.is_contiguous() and weight.is_contiguous() and x.stride(1) == 1):
        raise ValueError("states and weight must be contiguous, and each row of x")
    y = torch.empty(bsz, c, dtype=x.dtype, device=x.device)
    if bsz:
        block_c = 256
        _conv_decode_kernel[(bsz, triton.cdiv(c, block_c))](x, states, weight, index, y, c, x.stride(0), K=k,
                                                           BLOCK_C=block_c)
    return y


def gated_rms_norm_triton(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                          dtype: torch.dtype) -> torch.Tensor:
    """kernels.gdn.gated_rms_norm in one launch: per head, rms_norm(o) * weight * silu(z). o [T, Hv, Dv] float32
    contiguous, z [T, Hv, Dv] (rows may be strided), weight [Dv]; returns [T, Hv, Dv] in dtype."""
    if triton is None:
        raise RuntimeError("the Triton gated RMSNorm needs triton")
    t, hv, dv = o.shape
    if z.shape != o.shape or weight.shape != (dv,) or o.dtype != torch.float32 or not o.is_contiguous():
        raise ValueError(f"o {tuple(o.shape)} {o.dtype}, z {tuple(z.shape)}, weight {tuple(weight.shape)}: need o "
                         f"contiguous float32, z of its shape, weight [Dv]")
    if z.stride(2) != 1 or z.stride(1) != dv:
        raise ValueError(f"z: each row's heads must be contiguous, strides {z.stride()}")
    y = torch.empty(t, hv, dv, dtype=dtype, device=o.device)
    if t:
        _gated_norm_kernel[(t, hv)](o, z, weight, y, eps, z.stride(0), HV=hv, DV=dv,
                                    BLOCK=triton.next_power_of_2(dv))
    return y


def gating_triton(ab: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.gdn.gdn_gating in one launch: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) from
    ab = [b | a] [T, 2 Hv] (rows may be strided); A_log, dt_bias [Hv]. Returns (g, beta) [T, Hv] float32."""
    if triton is None:
        raise RuntimeError("the Triton GDN gating needs triton")
    t, two_hv = ab.shape
    hv = two_hv // 2
    if two_hv % 2 or a_log.shape != (hv,) or dt_bias.shape != (hv,) or ab.stride(1) != 1:
        raise ValueError(f"ab {tuple(ab.shape)} strides {ab.stride()}, A_log {tuple(a_log.shape)}, dt_bias "
                         f"{tuple(dt_bias.shape)}: need ab [T, 2 Hv] with contiguous rows, A_log and dt_bias [Hv]")
    g = torch.empty(t, hv, dtype=torch.float32, device=ab.device)
    beta = torch.empty_like(g)
    if t:
        _gating_kernel[(t,)](ab, a_log, dt_bias, g, beta, ab.stride(0), HV=hv, BLOCK=triton.next_power_of_2(hv))
    return g, beta
