"""The start-up checks of the ops chosen once per engine (int4 GEMM, paged attention with the KV write, the
fused norm/rotary/activation ops): each runs a few tokens of the served model's real shapes with every
candidate and lets kernels.registry.choose keep the first that matches the torch reference.
(The LoRA check lives with its implementations, engine/lora/punica.py.)"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels import fused
from kernels.attention import paged_attention
from kernels.gdn import (
    causal_conv1d_decode,
    delta_rule_decode,
    delta_rule_varlen,
    gated_rms_norm,
    gdn_decode_out,
    gdn_gating,
    uses_triton,
)
from kernels.int4 import Int4Layout, dequant_mm, int4_mm, native_supported, prepare_int4
from kernels.int4_tune import DEQUANT
from kernels.int4_tune import TOLERANCE as INT4_TOLERANCE
from kernels.registry import REFERENCE, Choice, Result, choose
from kernels.skinny_triton import skinny_linear


@dataclass(frozen=True)
class CheckShapes:
    """What the checks need of the served model."""

    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    zero_centered: bool
    """RMSNorm weights are stored as w - 1 (Qwen3.5)."""
    qk_norm: bool
    """Per-head q/k RMSNorm before the rotary embedding (Qwen3, Qwen3.5)."""
    block_size: int
    """KV-cache block size (tokens)."""
    int4_group: int | None
    """int4 group size; None: the model has no int4 layers (no int4 check)."""
    int4_zero_offset: int = 0
    gdn: tuple[int, int, int, int] | None = None
    """Gated DeltaNet (key heads, value heads, key head dim, value head dim); None: no GDN layers."""


Tol = dict[torch.dtype, tuple[float, float]]
TOLERANCE: dict[str, Tol] = {
    # (rtol, atol relative to max|ref|). 16-bit: the fast kernels round intermediates differently.
    "fused": {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (1.6e-2, 1.6e-2)},
    "attention": {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (1.6e-2, 1e-2)},
    # int4: the reference rounds the dense weight to the activation dtype, the kernels keep fp32 scales.
    "int4": INT4_TOLERANCE,
    # fla-core computes in bf16 whatever the dtype (as benchmarks/check_fla.py: 2e-2 of the scale).
    "gdn": dict.fromkeys((torch.float32, torch.float16, torch.bfloat16), (0.0, 2e-2)),
}
TOKENS = 3


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def candidates_for(chosen: str) -> list[str]:
    """What to try, in order, for an op configured as `chosen`: itself, then (int4's fixed device dispatch) the
    Triton kernel alone, then the reference. (A `tuned:` int4 dispatch is checked part by part: check_int4.)"""
    if chosen == REFERENCE:
        return [REFERENCE]
    return [chosen, "triton", REFERENCE] if chosen.startswith("auto:") else [chosen, REFERENCE]


def _choose(op: str, chosen: str, run: Callable[[str], Result], dtype: torch.dtype) -> Choice:
    return choose(op, candidates_for(chosen), run, TOLERANCE[op][dtype])


def check_int4(chosen: str, s: CheckShapes, dtype: torch.dtype, device: torch.device) -> Choice:
    """A [hidden -> intermediate] int4 layer of random codes on a few tokens. An `auto:native_X` candidate is
    checked on every kernel its dispatch uses (the native op, the Triton GEMM, the Triton dequantization); a
    `tuned:A,B,...` one on each of its candidates alone, and keeps those that pass (the tuner picks among them)."""
    assert s.int4_group is not None
    k, n = s.hidden, s.intermediate
    layout = Int4Layout(s.int4_group, s.int4_zero_offset, k, n)
    g = _gen()
    words = (k // 8, n), (k // s.int4_group, n // 8)
    qw, qz = (torch.randint(-2**31, 2**31 - 1, w, generator=g, dtype=torch.int32).to(device) for w in words)
    scales = ((torch.rand(k // s.int4_group, n, generator=g) + 0.5) / (8 * k ** 0.5)).half().to(device)
    x = _randn(g, TOKENS, k, dtype=dtype, device=device)

    def mm(backend: str) -> torch.Tensor:
        if backend == DEQUANT:
            return dequant_mm(x, qw, qz, scales, s.int4_group, s.int4_zero_offset)
        w = prepare_int4(qw, qz, scales, layout, backend, dtype=dtype)  # type: ignore[arg-type]
        if backend == "triton_gemv":  # its own kernel takes one row (more go to the triton kernel): row by row
            return torch.cat([int4_mm(x[i:i + 1], w) for i in range(x.shape[0])])
        return int4_mm(x, w)

    def runs_here(backend: str) -> bool:
        return native_supported("triton" if backend == DEQUANT else backend, layout, dtype)  # type: ignore[arg-type]

    if chosen.startswith("tuned:"):
        return _check_tuned(chosen, mm, runs_here, dtype)

    def run(name: str) -> Result:
        if name == REFERENCE:
            y = mm(REFERENCE)
            return {"native": y, "triton": y, "dequant": y}
        if not name.startswith("auto:"):
            return {"triton" if name == "triton" else "native": mm(name)}
        native = name.split(":", 1)[1]
        parts = {part: mm(b) for part, b in (("native", native), ("triton", "triton")) if runs_here(b)}
        if not parts:
            raise ValueError(f"neither {native} nor triton can run an int4 layer of {layout} here")
        if "triton" in parts:
            parts["dequant"] = mm(DEQUANT)
        return parts

    return _choose("int4", chosen, run, dtype)


def _check_tuned(chosen: str, mm: Callable[[str], torch.Tensor], runs_here: Callable[[str], bool],
                 dtype: torch.dtype) -> Choice:
    """Each candidate of a tuned dispatch alone against the reference; the dispatch keeps the ones that pass (in
    their order), and is the reference when none does. Candidates that cannot run this layer here are left out."""
    passed: list[str] = []
    rejected: list[tuple[str, str]] = []
    for part in chosen.split(":", 1)[1].split(","):
        if part == REFERENCE:
            passed.append(part)
            continue
        if not runs_here(part):
            continue
        c = choose("int4", [part, REFERENCE], mm, TOLERANCE["int4"][dtype])
        if c.checked:
            passed.append(part)
        else:
            rejected.extend(c.rejected)
    if not [p for p in passed if p != REFERENCE]:
        return Choice("int4", REFERENCE, tuple(rejected), False)
    return Choice("int4", "tuned:" + ",".join(passed), tuple(rejected), True)


def check_attention(chosen: str, s: CheckShapes, dtype: torch.dtype, device: torch.device) -> Choice:
    """The KV write of two sequences' keys into a paged cache (one spans two blocks), then a prefill step
    (3 queries), a decode step (one query each) and a mixed step (3 queries and one: the Triton backend's two
    kernels in one call), grouped-query as the model."""
    bs, hq, hkv, d = s.block_size, s.num_heads, s.num_kv_heads, s.head_dim
    ctx = [bs + 2, 3]
    g = _gen()
    k, v = (_randn(g, sum(ctx), hkv, d, dtype=dtype, device=device) for _ in range(2))
    q = _randn(g, TOKENS + 2, hq, d, dtype=dtype, device=device)
    tables = torch.tensor([[0, 1], [3, 2]], dtype=torch.int32)
    slots = [int(tables[i, t // bs]) * bs + t % bs for i, c in enumerate(ctx) for t in range(c)]
    tables, slot_mapping = tables.to(device), torch.tensor(slots, dtype=torch.long, device=device)

    def attend(name: str, kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor, cu: list[int], lens: list[int],
               max_q: int) -> torch.Tensor:
        cu_t, lens_t = (torch.tensor(a, dtype=torch.int32, device=device) for a in (cu, lens))
        return paged_attention(q, kc, vc, tables[:len(lens)], cu_t, lens_t, cu, lens, max_q, d ** -0.5, name)

    def run(name: str) -> Result:
        kc, vc = (torch.zeros(4, bs, hkv, d, dtype=dtype, device=device) for _ in range(2))
        fused.write_kv(kc, vc, k, v, slot_mapping, name)
        return {"kv_write": torch.stack([kc, vc]),
                "prefill": attend(name, kc, vc, q[:TOKENS], [0, TOKENS], ctx[:1], TOKENS),
                "decode": attend(name, kc, vc, q[TOKENS:], [0, 1, 2], ctx, 1),
                "mixed": attend(name, kc, vc, q[:TOKENS + 1], [0, TOKENS, TOKENS + 1], ctx, TOKENS)}

    return _choose("attention", chosen, run, dtype)


def check_fused(chosen: str, s: CheckShapes, dtype: torch.dtype, device: torch.device) -> Choice:
    """RMSNorm with and without the residual add, per-head q/k norm + rotary with the KV write, silu-and-mul, and
    gated attention's output gate (its gate a strided view, as in the query projection)."""
    g = _gen()
    x, res = (_randn(g, TOKENS, s.hidden, dtype=dtype, device=device) for _ in range(2))
    w = (1.0 + 0.1 * torch.randn(s.hidden, generator=g)).to(dtype).to(device)
    heads = _randn(g, TOKENS, s.num_heads, s.head_dim, dtype=dtype, device=device)
    hw = (1.0 + 0.1 * torch.randn(s.head_dim, generator=g)).to(dtype).to(device) if s.qk_norm else None
    gate_up = _randn(g, TOKENS, 2 * s.intermediate, dtype=dtype, device=device)
    qg = _randn(g, TOKENS, s.num_heads, 2 * s.head_dim, dtype=dtype, device=device) * 4
    half = s.rotary_dim // 2
    angles = torch.arange(64).float()[:, None] * 10000.0 ** (-torch.arange(half).float() / half)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
    positions = torch.tensor([0, 7, 63], device=device)[:TOKENS]
    k, v = (_randn(g, TOKENS, s.num_kv_heads, s.head_dim, dtype=dtype, device=device) for _ in range(2))
    slots = torch.tensor([s.block_size + 1, 0, 2], device=device)[:TOKENS]

    def run(name: str) -> Result:
        y, h = fused.rms_norm(x, w, 1e-6, s.zero_centered, res, name)
        kc, vc = (torch.zeros(2, s.block_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=device) for _ in "kv")
        q_rot = fused.rope_write_kv(heads, k, v, positions, cos_sin, s.rotary_dim, hw, hw, 1e-6, s.zero_centered, kc,
                                    vc, slots, name)
        return {"rms_norm": y, "residual_add": h, "rms_norm_alone": fused.rms_norm(x, w, 1e-6, s.zero_centered, None,
                                                                                   name)[0],
                "rope_write_kv": torch.cat([q_rot.flatten(), kc.flatten(), vc.flatten()]),
                "silu_and_mul": fused.silu_and_mul(gate_up, name),
                "sigmoid_gate": fused.sigmoid_gate(heads.reshape(TOKENS, -1), qg[:, :, s.head_dim:], name)}

    return _choose("fused", chosen, run, dtype)


def check_gdn(chosen: str, s: CheckShapes, dtype: torch.dtype, device: torch.device) -> Choice:
    """The gated delta rule of a prefill step (two sequences, 3 and 2 tokens, from random states in swapped
    slots) then a decode step: outputs and updated states; a second decode step with its gating and gated norm
    (gdn_decode_out); the decode step's causal conv (output and shifted state), the gating, the gated RMSNorm and the
    [b | a] projection (kernels.skinny_triton where the candidate runs Triton)."""
    assert s.gdn is not None
    hk, hv, dk, dv = s.gdn
    g = _gen()
    t = 5
    q, k = (_randn(g, t + 2, hk, dk, dtype=dtype, device=device) for _ in range(2))
    v = _randn(g, t + 2, hv, dv, dtype=dtype, device=device)
    gate = -torch.nn.functional.softplus(torch.randn(t + 2, hv, generator=g)).to(device)
    beta = torch.rand(t + 2, hv, generator=g).to(dtype).to(device)
    s0 = (torch.randn(2, hv, dk, dv, generator=g) * 0.05).to(device)
    index = torch.tensor([1, 0], device=device)
    c = 2 * hk * dk + hv * dv
    x, conv0 = _randn(g, 2, c, dtype=dtype, device=device), _randn(g, 2, c, 3, dtype=dtype, device=device)
    conv_w = _randn(g, c, 4, dtype=dtype, device=device)
    o, z = _randn(g, t, hv, dv, dtype=torch.float32, device=device), _randn(g, t, hv, dv, dtype=dtype, device=device)
    norm_w = _randn(g, dv, dtype=dtype, device=device)
    ab, a_log, dt_bias = (_randn(g, *shape, dtype=dt, device=device) for shape, dt in
                          (((t, 2 * hv), dtype), ((hv,), torch.float32), ((hv,), torch.float32)))
    hidden, w_ba = _randn(g, 3, s.hidden, dtype=dtype, device=device), _randn(g, 2 * hv, s.hidden, dtype=dtype,
                                                                             device=device)

    def run(name: str) -> Result:
        states, conv = s0.clone(), conv0.clone()
        pre = delta_rule_varlen(q[:t], k[:t], v[:t], gate[:t], beta[:t], states, [1, 0], [0, 3, t], name)
        pre_states = states.clone()
        dec = delta_rule_decode(q[t:], k[t:], v[t:], gate[t:], beta[t:], states, index, name)
        dec_states = states.clone()
        out = gdn_decode_out(q[t:], k[t:], v[t:], ab[:2] * 8, a_log, dt_bias, z[:2], norm_w, 1e-6, states, index,
                             dtype, name)
        return {"prefill": pre, "prefill_states": pre_states, "decode": dec, "decode_states": dec_states,
                "decode_out": out, "decode_out_states": states,
                "conv": causal_conv1d_decode(x, conv, index, conv_w, name), "conv_states": conv,
                "norm": gated_rms_norm(o, z, norm_w, 1e-6, dtype, name),
                "gating": torch.stack(gdn_gating(ab * 8, a_log, dt_bias, name)),  # * 8: large a too
                "proj": skinny_linear(hidden, w_ba, None, uses_triton(name))}

    # fla-core that fails here (not installed, or broken on this device) still leaves the Triton decode kernel.
    candidates = [chosen, "triton", REFERENCE] if chosen == "fla" else candidates_for(chosen)
    return choose("gdn", candidates, run, TOLERANCE["gdn"][dtype])


CHECKS: dict[str, Callable[[str, CheckShapes, torch.dtype, torch.device], Choice]] = {
    "attention": check_attention, "fused": check_fused, "gdn": check_gdn, "int4": check_int4}
"""Op -> its check."""


def check_ops(chosen: Sequence[tuple[str, str]], s: CheckShapes, dtype: torch.dtype,
              device: torch.device) -> list[Choice]:
    """(op, configured implementation) -> the checked choices, in order; int4 only for an int4 model, gdn
    only for a model with GDN layers."""
    return [CHECKS[op](name, s, dtype, device) for op, name in chosen
            if not (op == "int4" and s.int4_group is None) and not (op == "gdn" and s.gdn is None)]
