"""Triton kernels for the small per-layer ops, one launch each where torch takes five to fifteen (a decode
step is mostly launches at batch 1). Semantics and rounding points are those of kernels.reference;
tests/kernels/test_fused.py checks each against it."""

from __future__ import annotations

import torch

from kernels.triton_env import tl, triton

__all__ = ["rms_norm_triton", "rope_write_kv_triton", "silu_and_mul_triton", "write_kv_triton"]

if triton is not None:

    @triton.jit
    def _residual_add(x_ptrs, r_ptrs, mask, HAS_RES: tl.constexpr):
        """h = x (+ r: summed in float32, rounded to x's dtype)."""
        h = tl.load(x_ptrs, mask=mask, other=0.0)
        if HAS_RES:
            h = (h.to(tl.float32) + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(h.dtype)
        return h

    @triton.jit
    def _inv_rms(h, D, eps):
        """1 / sqrt(mean(h^2) + eps) over a row of D values (h's masked lanes hold 0), in float32."""
        hf = h.to(tl.float32)
        return 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / D + eps)

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, D, stride_x, stride_r, eps,
                         HAS_RES: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_D: tl.constexpr):
        """h = x[row] (+ r[row], rounded to x's dtype); y[row] = h * rsqrt(mean(h^2) + eps) * w."""
        row = tl.program_id(0).to(tl.int64)  # row * stride may pass 2^31 elements
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        h = _residual_add(x_ptr + row * stride_x + offs, r_ptr + row * stride_r + offs, mask, HAS_RES)
        if HAS_RES:
            tl.store(h_ptr + row * D + offs, h, mask=mask)
        hf = h.to(tl.float32)
        inv = _inv_rms(h, D, eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w += 1.0
        tl.store(y_ptr + row * D + offs, (hf * inv * w).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_rope_head(src, w_ptr, cs_row, dst, D, RD, eps, HAS_NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                        HAS_PASS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
        """dst[:D] = rope(rms_norm(src[:D]) if HAS_NORM else src[:D]) with [cos, sin] = cs_row, on dims < RD.

        The head is read as three pieces: x1 = dims [0, RD/2), x2 = [RD/2, RD), pass = [RD, D).
        """
        half = RD // 2
        offs = tl.arange(0, BLOCK_H)
        m = offs < half
        dt = dst.dtype.element_ty
        x1 = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + offs, mask=m, other=0.0).to(tl.float32)
        offs_p = tl.arange(0, BLOCK_P)
        mp = offs_p < D - RD
        if HAS_PASS:
            xp = tl.load(src + RD + offs_p, mask=mp, other=0.0).to(tl.float32)
        if HAS_NORM:
            ss = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)
            if HAS_PASS:
                ss += tl.sum(xp * xp, axis=0)
            inv = 1.0 / tl.sqrt(ss / D + eps)
            w1 = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + half + offs, mask=m, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                w1 += 1.0
                w2 += 1.0
            # The norm's output is rounded to the model dtype before the rotation, as in two separate ops.
            x1 = (x1 * inv * w1).to(dt).to(tl.float32)
            x2 = (x2 * inv * w2).to(dt).to(tl.float32)
            if HAS_PASS:
                wp = tl.load(w_ptr + RD + offs_p, mask=mp, other=0.0).to(tl.float32)
                if ZERO_CENTERED:
                    wp += 1.0
                xp = xp * inv * wp
        c = tl.load(cs_row + offs, mask=m, other=0.0)
        s = tl.load(cs_row + half + offs, mask=m, other=0.0)
        tl.store(dst + offs, (x1 * c - x2 * s).to(dt), mask=m)
        tl.store(dst + half + offs, (x2 * c + x1 * s).to(dt), mask=m)
        if HAS_PASS:
            tl.store(dst + RD + offs_p, xp.to(dt), mask=mp)

    @triton.jit
    def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, out_ptr, kc_ptr, vc_ptr, slot_ptr,
                              HQ, D, RD, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, eps, HAS_NORM: tl.constexpr,
                              ZERO_CENTERED: tl.constexpr, HAS_PASS: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
        """h < HQ: out[t, h] = norm_rope(q[t, h]); else, with j = h - HQ: k_cache.flat[slot[t], j] =
        norm_rope(k[t, j]) and v_cache.flat[slot[t], j] = v[t, j] (the cache rows [kv_heads, D]). Grid (T, HQ + HKV):
        the query heads, the key rotation and both cache writes of a layer in one launch."""
        t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
        pos = tl.load(pos_ptr + t)
        hkv = tl.num_programs(1) - HQ
        if h < HQ:
            src = q_ptr + t * sq_t + h * sq_h
            w_ptr = qw_ptr
            dst = out_ptr + (t * HQ + h) * D
        else:
            j = h - HQ
            row = tl.load(slot_ptr + t).to(tl.int64) * hkv + j
            src = k_ptr + t * sk_t + j * sk_h
            w_ptr = kw_ptr
            dst = kc_ptr + row * D
            offs = tl.arange(0, BLOCK_D)
            md = offs < D
            tl.store(vc_ptr + row * D + offs, tl.load(v_ptr + t * sv_t + j * sv_h + offs, mask=md), mask=md)
        _norm_rope_head(src, w_ptr, cs_ptr + pos * RD, dst, D, RD, eps, HAS_NORM, ZERO_CENTERED, HAS_PASS, BLOCK_H,
                        BLOCK_P)

    @triton.jit
    def _silu_mul(g_ptrs, D, mask, out_dtype: tl.constexpr):
        """silu(g) * u with u = g_ptrs[D], the silu rounded to u's dtype first (as torch does), in out_dtype."""
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(g_ptrs + D, mask=mask, other=0.0)
        silu = (g / (1.0 + tl.exp(-g))).to(u.dtype).to(tl.float32)
        return (silu * u.to(tl.float32)).to(out_dtype)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, y_ptr, D, stride_x, BLOCK: tl.constexpr):
        """y[t, d] = silu(x[t, d]) * x[t, D + d], the silu rounded to x's dtype first (as torch does)."""
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < D
        tl.store(y_ptr + t * D + offs, _silu_mul(x_ptr + t * stride_x + offs, D, m, y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _sigmoid_gate_kernel(o_ptr, g_ptr, y_ptr, D, stride_gt, stride_gh, BLOCK: tl.constexpr):
        """y[t, h, :] = o[t, h, :] * sigmoid(g[t, h, :]), the sigmoid rounded to o's dtype first (as torch does)."""
        t, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < D
        row = (t * tl.num_programs(1) + h) * D
        g = tl.load(g_ptr + t * stride_gt + h * stride_gh + offs, mask=m, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + row + offs, mask=m, other=0.0)
        sig = (1.0 / (1.0 + tl.exp(-g))).to(o.dtype).to(tl.float32)
        tl.store(y_ptr + row + offs, (o.to(tl.float32) * sig).to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, W, stride_k, stride_v, BLOCK: tl.constexpr):
        """k_cache.flat[slot[t]] = k[t]; v likewise (W = kv_heads * head_dim elements per token)."""
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < W
        slot = tl.load(slot_ptr + t).to(tl.int64)
        k = tl.load(k_ptr + t * stride_k + offs, mask=m)
        v = tl.load(v_ptr + t * stride_v + offs, mask=m)
        tl.store(kc_ptr + slot * W + offs, k.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc_ptr + slot * W + offs, v.to(vc_ptr.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor, what: str) -> torch.Tensor:
    """x as [rows, D] with unit stride along D (a view where possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.reshape(-1, x.size(-1))
    if x2.stride(-1) != 1:
        raise ValueError(f"{what}: the last dim must be contiguous")
    return x2


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool,
                    residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.size(-1)
    x2 = _rows(x, "rms_norm")
    r2 = _rows(residual, "rms_norm residual") if residual is not None else x2
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if residual is not None else x
    if x2.size(0):
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(x2.size(0),)](x2, r2, weight, y, h, d, x2.stride(0), r2.stride(0), eps,
                                        HAS_RES=residual is not None, ZERO_CENTERED=zero_centered, BLOCK_D=block,
                                        num_warps=min(8, max(1, block // 512)))
    return y.view(x.shape), h.view(x.shape)


def rope_write_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos_sin: torch.Tensor, rotary_dim: int, q_weight: torch.Tensor | None,
                         k_weight: torch.Tensor | None, eps: float, zero_centered: bool, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D], k / v [T, Hkv, D] (any strides over T and heads) -> the rotated q, contiguous [T, Hq, D]."""
    t, hq, d = q.shape
    q, k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t:
        half = rotary_dim // 2
        _rope_write_kv_kernel[(t, hq + k.size(1))](
            q, k, v, positions, cos_sin, q if q_weight is None else q_weight, q if k_weight is None else k_weight,
            out, k_cache, v_cache, slot_mapping, hq, d, rotary_dim, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), eps, HAS_NORM=q_weight is not None, ZERO_CENTERED=zero_centered,
            HAS_PASS=rotary_dim < d, BLOCK_H=triton.next_power_of_2(half),
            BLOCK_P=triton.next_power_of_2(max(1, d - rotary_dim)), BLOCK_D=triton.next_power_of_2(d), num_warps=1)
    return out


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    d = x.size(-1) // 2
    x2 = _rows(x, "silu_and_mul")
    y = torch.empty((x2.size(0), d), dtype=x.dtype, device=x.device)
    if x2.size(0):
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.size(0), triton.cdiv(d, block))](x2, y, d, x2.stride(0), BLOCK=block, num_warps=4)
    return y.view(*x.shape[:-1], d)


def sigmoid_gate_triton(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o [T, H * D] contiguous, gate [T, H, D] with unit stride over D -> [T, H * D] (kernels.fused.sigmoid_gate)."""
    t, h, d = gate.shape
    y = torch.empty_like(o)
    if t:
        _sigmoid_gate_kernel[(t, h)](o, gate, y, d, gate.stride(0), gate.stride(1),
                                     BLOCK=triton.next_power_of_2(d), num_warps=1 if d <= 256 else 4)
    return y


def write_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    t = k.size(0)
    w = k_cache.size(-2) * k_cache.size(-1)
    k2, v2 = k.reshape(t, -1), v.reshape(t, -1)  # views: heads and dims are contiguous within a token
    if k2.size(1) != w or v2.size(1) != w or k2.stride(1) != 1 or v2.stride(1) != 1:
        raise ValueError(f"write_kv: k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache's {w} per token")
    if t:
        _write_kv_kernel[(t,)](k2, v2, k_cache, v_cache, slot_mapping, w, k2.stride(0), v2.stride(0),
                               BLOCK=triton.next_power_of_2(w), num_warps=4)
