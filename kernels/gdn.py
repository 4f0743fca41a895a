"""Gated DeltaNet (Qwen3.5 linear attention): pure-torch references, the CPU path and the oracle for
the fla-core Triton kernels used on GPUs.

Per value head, with q already l2-normalised and scaled by 1/sqrt(Dk) and k l2-normalised:
    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t
State S [H, Dk, Dv] is float32.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BACKENDS = ("reference", "fla", "triton")
"""delta_rule_varlen / delta_rule_decode backends (engine.device.Device.gdn_backend chooses)."""


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y = silu(depthwise causal conv over [state | x]); returns (y [n, C], new state [C, K-1]).

    x [n, C] new inputs, state [C, K-1] the previous K-1 inputs (zeros for a fresh sequence), weight [C, K].
    """
    k = weight.size(1)
    xx = torch.cat([state.t().to(x.dtype), x], dim=0)  # [K-1+n, C]
    windows = xx.unfold(0, k, 1)  # [n, C, K]
    y = (windows.float() * weight.float().unsqueeze(0)).sum(-1)
    return F.silu(y).to(x.dtype), xx[-(k - 1):].t().contiguous()


@functools.lru_cache(maxsize=8)  # every GDN layer of a step asks for the same plan
def _varlen_conv_plan(cu: tuple[int, ...], k: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Index tensors for causal_conv1d_varlen: where each row of the flat [K-1 previous | new] buffer comes
    from, which windows end at a new row, and which rows become each sequence's next state."""
    b = len(cu) - 1
    order: list[int] = []
    rows: list[int] = []
    tail: list[int] = []
    for i in range(b):
        n, start = cu[i + 1] - cu[i], cu[i] + i * (k - 1)  # this sequence's block in the flat buffer
        order += [*range(i * (k - 1), (i + 1) * (k - 1)), *range(b * (k - 1) + cu[i], b * (k - 1) + cu[i + 1])]
        rows += range(start, start + n)  # the window starting here ends at new row j
        tail += range(start + n, start + n + k - 1)
    return tuple(torch.tensor(v, dtype=torch.long, device=device) for v in (order, rows, tail))


def causal_conv1d_varlen(x: torch.Tensor, states: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                         cu: list[int]) -> torch.Tensor:
    """causal_conv1d for sequences laid end to end (sequence i owns rows cu[i]:cu[i+1] and state slot
    index[i]) in one pass, no per-sequence loop; states updated in place. x [T, C], states [S, C, K-1]."""
    k, b = weight.size(1), len(cu) - 1
    order, rows, tail = _varlen_conv_plan(tuple(cu), k, x.device)
    prev = states[index].transpose(1, 2).to(x.dtype).reshape(b * (k - 1), -1)  # [B(K-1), C]
    flat = torch.cat([prev, x])[order]  # per sequence: its K-1 previous inputs, then its new rows
    # Every window of the flat buffer (those straddling two sequences are computed and dropped), then the
    # ones ending at a new row: fewer copies than gathering windows first.
    y = (flat.unfold(0, k, 1).float() * weight.float()).sum(-1)[rows]
    states[index] = flat[tail].reshape(b, k - 1, -1).transpose(1, 2).to(states.dtype)
    return F.silu(y).to(x.dtype)


def causal_conv1d_decode(x: torch.Tensor, states: torch.Tensor, index: torch.Tensor,
                         weight: torch.Tensor, backend: str = "reference") -> torch.Tensor:
    """One new input per sequence: y[b] = silu(sum_k [states[index[b]] | x[b]] * weight); states[index[b]]
    shifts by one in place. x [B, C], states [S, C, K-1], index [B] long, weight [C, K]. No host sync.
    Backends as delta_rule_decode's: "fla" and "triton" run kernels.gdn_triton's one launch."""
    if uses_triton(backend):
        from kernels.gdn_triton import conv_decode_triton

        return conv_decode_triton(x, states, index, weight)
    window = torch.cat([states[index], x.to(states.dtype)[:, :, None]], dim=-1)  # [B, C, K]
    y = (window.float() * weight.float()).sum(-1)
    states[index] = window[:, :, 1:]
    return F.silu(y).to(x.dtype)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype,
                   backend: str = "reference") -> torch.Tensor:
    """Per head, the RMSNorm of the mixer's output gated by silu(z): (weight * rms_norm(o)) * silu(z), rounded to
    dtype after the norm, after the weight and at the end. o [T, Hv, Dv] float32, z [T, Hv, Dv], weight [Dv];
    returns dtype. Backends as delta_rule_decode's: "fla" and "triton" run kernels.gdn_triton's one launch."""
    if uses_triton(backend):
        from kernels.gdn_triton import gated_rms_norm_triton

        return gated_rms_norm_triton(o, z, weight, eps, dtype)
    n = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * n.to(dtype)).float() * F.silu(z.float())).to(dtype)


def gdn_gating(ab: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
               backend: str = "reference") -> tuple[torch.Tensor, torch.Tensor]:
    """The decay and the write strength from the [b | a] projection: g = -exp(A_log) * softplus(a + dt_bias),
    beta = sigmoid(b). ab [T, 2 Hv] (rows may be strided), A_log and dt_bias [Hv]; returns (g, beta) [T, Hv]
    float32. Backends as delta_rule_decode's: "fla" and "triton" run kernels.gdn_triton's one launch."""
    if uses_triton(backend):
        from kernels.gdn_triton import gating_triton

        return gating_triton(ab, a_log, dt_bias)
    b, a = ab.float().split(ab.size(1) // 2, dim=-1)
    return -a_log.float().exp() * F.softplus(a + dt_bias.float()), b.sigmoid()


def uses_triton(backend: str) -> bool:
    """The backend runs kernels.gdn_triton's kernels (decode steps, the conv and the gated norm)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown gated-delta-rule backend {backend!r} ({', '.join(BACKENDS)})")
    return backend != "reference"


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence. q, k [n, H, Dk]; v [n, H, Dv]; g, beta [n, H]; state [H, Dk, Dv] fp32.
    Returns (o [n, H, Dv] float32, new state)."""
    s = state.float().clone()
    q, k, v, g, beta = q.float(), k.float(), v.float(), g.float(), beta.float()
    out = torch.empty(q.size(0), q.size(1), v.size(-1), dtype=torch.float32, device=q.device)
    for t in range(q.size(0)):
        s = s * g[t].exp()[:, None, None]
        pred = torch.einsum("hkv,hk->hv", s, k[t])
        delta = (v[t] - pred) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out, s


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as delta_rule_recurrent, a chunk of tokens at a time (matmuls instead of a token loop).

    Inside a chunk with start state S0 and decay prefix G_t = sum_{s<=t} g_s, the updates d_t solve the
    unit lower-triangular system
        d_t + sum_{s<t} beta_t e^{G_t-G_s} (k_t.k_s) d_s = beta_t (v_t - e^{G_t} S0^T k_t),
    then
        o_t = e^{G_t} S0^T q_t + sum_{s<=t} e^{G_t-G_s} (q_t.k_s) d_s,
        S_C = e^{G_C} S0 + sum_s e^{G_C-G_s} k_s d_s^T.
    """
    s = state.float().clone()
    q, k, v, g, beta = (x.float().transpose(0, 1) for x in (q, k, v, g, beta))  # head-major: [H, n, ...]
    h, n, _ = q.shape
    out = torch.empty(h, n, v.size(-1), dtype=torch.float32, device=q.device)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        qc, kc, vc, bc = q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b]
        cum = g[:, a:b].cumsum(-1)  # [H, c]
        diff = cum[:, :, None] - cum[:, None, :]  # G_t - G_s
        c = b - a
        lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()  # e^{G_t-G_s}, s <= t
        strict = decay * (~torch.eye(c, dtype=torch.bool, device=q.device))
        system = torch.eye(c, device=q.device) + bc[:, :, None] * strict * (kc @ kc.transpose(1, 2))
        rhs_v = bc[:, :, None] * vc
        rhs_k = bc[:, :, None] * cum.exp()[:, :, None] * kc
        u = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, rhs_k, upper=False, unitriangular=True)
        d = u - w @ s  # [H, c, Dv]
        out[:, a:b] = (qc * cum.exp()[:, :, None]) @ s + (decay * (qc @ kc.transpose(1, 2))) @ d
        tail = (cum[:, -1:] - cum).exp()[:, :, None]  # e^{G_C - G_s}
        s = cum[:, -1].exp()[:, None, None] * s + (kc * tail).transpose(1, 2) @ d
    return out.transpose(0, 1), s


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      states: torch.Tensor, slots: list[int], cu: list[int], backend: str = "reference",
                      chunk_threshold: int = 16, index: torch.Tensor | None = None,
                      cu_dev: torch.Tensor | None = None) -> torch.Tensor:
    """Sequences laid end to end (sequence i owns rows cu[i]:cu[i+1] and state slot slots[i]); q, k raw
    [T, Hk, Dk] (l2-normalised here, q also scaled by 1/sqrt(Dk)), v [T, Hv, Dv], g and beta [T, Hv]; value
    head h reads key head h // (Hv / Hk). Updates `states` [slots, Hv, Dk, Dv] in place; returns o [T, Hv, Dv].
    backend: "reference" (torch, any device), "fla" (flash-linear-attention's chunked Triton kernels, decode steps
    by kernels.gdn_triton) or "triton" (decode steps by kernels.gdn_triton, the rest by the reference). index and
    cu_dev: the same slots and cu on the device where the caller has them (fla reads those, not the lists)."""
    uses_triton(backend)  # validates the name
    decode = all(cu[i + 1] - cu[i] == 1 for i in range(len(slots)))
    if backend == "fla" or (backend == "triton" and decode):
        idx = index if index is not None else torch.tensor(slots, dtype=torch.long, device=q.device)
        if decode:
            return delta_rule_decode(q, k, v, g, beta, states, idx, backend)
        cu_t = cu_dev.long() if cu_dev is not None else torch.tensor(cu, dtype=torch.long, device=q.device)
        return _delta_rule_fla_chunk(q, k, v, g, beta, states, idx, cu_t)
    ratio = v.size(1) // k.size(1)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for i, slot in enumerate(slots):
        lo, hi = cu[i], cu[i + 1]
        if hi == lo:
            continue
        qs = _l2norm(q[lo:hi].float()) * q.size(-1) ** -0.5
        ks = _l2norm(k[lo:hi].float())
        if ratio > 1:
            qs, ks = qs.repeat_interleave(ratio, dim=1), ks.repeat_interleave(ratio, dim=1)
        rule = delta_rule_chunked if hi - lo > chunk_threshold else delta_rule_recurrent
        out[lo:hi], states[slot] = rule(qs, ks, v[lo:hi], g[lo:hi], beta[lo:hi], states[slot])
    return out


def delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      states: torch.Tensor, index: torch.Tensor, backend: str = "reference") -> torch.Tensor:
    """One token per sequence (row b uses state slot index[b]); same inputs and update as
    delta_rule_varlen with every length 1, with the slots as a device tensor, so no host sync (graph-safe).
    The "fla" and "triton" backends run kernels.gdn_triton's in-place kernel: fla-core's recurrent kernel takes a
    dense state, which cost a gather and a scatter of every slot's state per layer."""
    if uses_triton(backend):
        from kernels.gdn_triton import delta_rule_decode_triton

        return delta_rule_decode_triton(q, k, v, g, beta, states, index)
    ratio = v.size(1) // k.size(1)
    qs = (_l2norm(q.float()) * q.size(-1) ** -0.5).repeat_interleave(ratio, dim=1)  # [B, Hv, Dk]
    ks = _l2norm(k.float()).repeat_interleave(ratio, dim=1)
    s = states[index] * g.float().exp()[:, :, None, None]  # [B, Hv, Dk, Dv]
    delta = (v.float() - torch.einsum("bhkv,bhk->bhv", s, ks)) * beta.float()[:, :, None]
    s = s + ks[:, :, :, None] * delta[:, :, None, :]
    states[index] = s
    return torch.einsum("bhkv,bhk->bhv", s, qs)


def gdn_decode_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ab: torch.Tensor, a_log: torch.Tensor,
                   dt_bias: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, eps: float, states: torch.Tensor,
                   index: torch.Tensor, dtype: torch.dtype, backend: str = "reference") -> torch.Tensor:
    """A decode step after the conv: g, beta = gdn_gating(ab); o = delta_rule_decode(q, k, v, g, beta) (states
    updated in place); returns gated_rms_norm(o, z) in dtype. The "fla" and "triton" backends run it in two launches
    (kernels.gdn_triton.decode_out_triton: the gating inside the recurrence's programs), where the three took three."""
    if uses_triton(backend):
        from kernels.gdn_triton import decode_out_triton

        return decode_out_triton(q, k, v, ab, a_log, dt_bias, z, norm_w, eps, states, index, dtype)
    g, beta = gdn_gating(ab, a_log, dt_bias)
    return gated_rms_norm(delta_rule_decode(q, k, v, g, beta, states, index), z, norm_w, eps, dtype)


def _delta_rule_fla_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          states: torch.Tensor, index: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    # Imported here: fla needs triton and a GPU at import time, and must stay off the CPU path.
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    dtype = v.dtype if v.dtype != torch.float32 else torch.bfloat16
    o, final = chunk_gated_delta_rule(
        q=q[None].to(dtype), k=k[None].to(dtype), v=v[None].to(dtype), g=g[None].float(), beta=beta[None].to(dtype),
        scale=q.size(-1) ** -0.5, initial_state=states[index].contiguous(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    states[index] = final.float()
    return o[0].float()
