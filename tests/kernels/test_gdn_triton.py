"""The Gated DeltaNet kernels (kernels.gdn_triton) against the torch references of kernels.gdn (the recurrence is
checked against the token loop and transformers in test_gdn.py; the conv and the gated norm are the layer's torch
forms, which test_qwen35.py holds to transformers): the decode step's outputs, the updated slots, and the slots no
row names left untouched; the causal conv's output and shifted state; the gated RMSNorm. Inputs are views of one
wider projection, as the layer passes them. Compiled on an accelerator; on the CPU in a child pytest under
TRITON_INTERPRET=1 (test_kernels_under_interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gdn import causal_conv1d_decode, delta_rule_decode, gated_rms_norm, gdn_decode_out, gdn_gating
from tests.kernels.triton_env import DEV, assert_close_rel, needs_kernels, pytest_under_interpreter

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-5, 1e-5)}
"""Both compute in float32 from the same rounded inputs; only the sums' order differs."""


def _problem(b: int, hk: int, ratio: int, dk: int, dv: int, dtype: torch.dtype, slots: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    hv = hk * ratio
    qkv = torch.randn(b, 2 * hk * dk + hv * dv + 5, generator=g).to(dtype)  # 5 extra columns: rows are strided
    q, k, v, _ = qkv.split([hk * dk, hk * dk, hv * dv, 5], dim=-1)
    ab = torch.randn(b, 2 * hv, generator=g)
    beta, a = ab.split([hv, hv], dim=-1)  # strided like the layer's split of in_proj_ba
    return dict(q=q.view(b, hk, dk), k=k.view(b, hk, dk), v=v.view(b, hv, dv), g=-F.softplus(a) * 0.5,
                beta=beta.sigmoid().to(dtype), states=torch.randn(slots, hv, dk, dv, generator=g) * 0.1,
                index=torch.randperm(slots, generator=g)[:b])


def _on(p: dict, dev: torch.device) -> dict:
    return {n: x.to(dev) for n, x in p.items()}


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "hk", "ratio", "dk", "dv"), [(5, 2, 3, 32, 64), (3, 3, 1, 16, 16), (4, 1, 2, 24, 40),
                                                            (1, 2, 3, 128, 128)])
def test_decode_kernel_matches_reference(b: int, hk: int, ratio: int, dk: int, dv: int, dtype: torch.dtype) -> None:
    """Odd Dk / Dv (masked tiles), Hv = 1-3 Hk, float32 and bf16 inputs, slots in a shuffled order."""
    from kernels.gdn_triton import delta_rule_decode_triton

    assert DEV is not None
    p = _problem(b, hk, ratio, dk, dv, dtype, slots=b + 3)
    ref_states = p["states"].clone()
    ref = delta_rule_decode(p["q"], p["k"], p["v"], p["g"], p["beta"], ref_states, p["index"])
    d = _on(p, DEV)
    out = delta_rule_decode_triton(d["q"], d["k"], d["v"], d["g"], d["beta"], d["states"], d["index"])
    tol = TOLERANCES[dtype]
    assert_close_rel(out, ref, tol, "o")
    assert_close_rel(d["states"], ref_states, tol, "states")
    untouched = sorted(set(range(b + 3)) - set(p["index"].tolist()))
    assert torch.equal(d["states"][untouched].cpu(), p["states"][untouched]), "a slot no row names changed"


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "hk", "ratio", "dk", "dv"), [(5, 2, 3, 32, 64), (3, 3, 1, 16, 16), (4, 1, 2, 24, 40),
                                                            (2, 2, 3, 128, 128)])
def test_decode_out_kernel_matches_reference(b: int, hk: int, ratio: int, dk: int, dv: int, dtype: torch.dtype) -> None:
    """The recurrence with its gating, then the gated norm, against the three torch forms in a row; ab and z
    strided views; a + dt_bias on both sides of softplus's threshold."""
    from kernels.gdn_triton import decode_out_triton

    assert DEV is not None
    p = _problem(b, hk, ratio, dk, dv, dtype, slots=b + 3, seed=b + dk)
    g = torch.Generator().manual_seed(dv)
    hv = hk * ratio
    ab = (torch.randn(b, 2 * hv + 3, generator=g) * 12).to(dtype)[:, :2 * hv]
    z = torch.randn(b, hv * dv + 5, generator=g).to(dtype)[:, :hv * dv].view(b, hv, dv)
    a_log, dt_bias, w = torch.randn(hv, generator=g), torch.randn(hv, generator=g) * 4, torch.randn(dv, generator=g)
    w = w.to(dtype)
    assert ((ab[:, hv:].float() + dt_bias) > 20).any() or b * hv < 10, "the large branch is not exercised"
    ref_states = p["states"].clone()
    args = (ab, a_log, dt_bias, z, w, 1e-6)
    ref = gdn_decode_out(p["q"], p["k"], p["v"], *args, ref_states, p["index"], dtype)
    d = _on(p, DEV)
    out = decode_out_triton(d["q"], d["k"], d["v"], *(x.to(DEV) if isinstance(x, torch.Tensor) else x for x in args),
                            d["states"], d["index"], dtype)
    assert out.dtype == dtype
    assert_close_rel(out, ref, (1e-5, 1e-5) if dtype == torch.float32 else (1.6e-2, 1e-2), "y")
    assert_close_rel(d["states"], ref_states, TOLERANCES[dtype], "states")
    untouched = sorted(set(range(b + 3)) - set(p["index"].tolist()))
    assert torch.equal(d["states"][untouched].cpu(), p["states"][untouched]), "a slot no row names changed"


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "c", "k"), [(3, 40, 4), (1, 300, 4), (5, 17, 2), (2, 9, 3)])
def test_conv_decode_kernel_matches_reference(b: int, c: int, k: int, dtype: torch.dtype) -> None:
    """Channel counts across and inside one block, kernel widths 2-4; x a strided view; other slots untouched."""
    from kernels.gdn_triton import conv_decode_triton

    assert DEV is not None
    g = torch.Generator().manual_seed(c + k)
    slots = b + 2
    x = torch.randn(b, c + 7, generator=g).to(dtype)[:, 3:3 + c]
    states, w = torch.randn(slots, c, k - 1, generator=g).to(dtype), torch.randn(c, k, generator=g).to(dtype)
    index = torch.randperm(slots, generator=g)[:b]
    ref_states = states.clone()
    ref = causal_conv1d_decode(x, ref_states, index, w)
    d_states = states.to(DEV)
    out = conv_decode_triton(x.to(DEV), d_states, index.to(DEV), w.to(DEV))
    assert out.dtype == dtype
    assert_close_rel(out, ref, (1e-5, 1e-5) if dtype == torch.float32 else (1.6e-2, 1e-2), "y")
    assert torch.equal(d_states.cpu(), ref_states), "the shifted state is a copy: it must be exact"


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "hv", "dv"), [(4, 3, 128), (1, 2, 40), (7, 1, 16)])
def test_gated_norm_kernel_matches_reference(t: int, hv: int, dv: int, dtype: torch.dtype) -> None:
    from kernels.gdn_triton import gated_rms_norm_triton

    assert DEV is not None
    g = torch.Generator().manual_seed(t * hv + dv)
    o = torch.randn(t, hv, dv, generator=g) * 3
    z = torch.randn(t, hv * dv + 5, generator=g).to(dtype)[:, :hv * dv].view(t, hv, dv)  # rows strided
    w = torch.randn(dv, generator=g).to(dtype)
    ref = gated_rms_norm(o, z, w, 1e-6, dtype)
    out = gated_rms_norm_triton(o.to(DEV), z.to(DEV), w.to(DEV), 1e-6, dtype)
    assert out.dtype == dtype
    assert_close_rel(out, ref, (1e-5, 1e-5) if dtype == torch.float32 else (1.6e-2, 1e-2), "gated norm")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "hv"), [(5, 48), (1, 3), (9, 24)])
def test_gating_kernel_matches_reference(t: int, hv: int, dtype: torch.dtype) -> None:
    """a + dt_bias on both sides of softplus's threshold (20); ab a strided view."""
    from kernels.gdn_triton import gating_triton

    assert DEV is not None
    g = torch.Generator().manual_seed(t + hv)
    ab = (torch.randn(t, 2 * hv + 3, generator=g) * 12).to(dtype)[:, :2 * hv]
    a_log, dt_bias = torch.randn(hv, generator=g), torch.randn(hv, generator=g) * 4
    ref = gdn_gating(ab, a_log, dt_bias)
    got = gating_triton(ab.to(DEV), a_log.to(DEV), dt_bias.to(DEV))
    assert ((ab[:, hv:].float() + dt_bias) > 20).any() or t * hv < 10, "the large branch is not exercised"
    for name, x, r in zip(("g", "beta"), got, ref):
        assert x.dtype == torch.float32 and x.shape == (t, hv)
        assert_close_rel(x, r, (1e-5, 1e-5), name)


@needs_kernels
def test_backend_fla_decodes_with_the_kernel() -> None:
    """delta_rule_decode's "fla" backend is this kernel (fla-core is not needed for decode)."""
    assert DEV is not None
    p = _on(_problem(3, 2, 3, 32, 32, torch.float32, slots=5, seed=1), DEV)
    s1, s2 = p["states"].clone(), p["states"].clone()
    a = delta_rule_decode(p["q"], p["k"], p["v"], p["g"], p["beta"], s1, p["index"], "fla")
    from kernels.gdn_triton import delta_rule_decode_triton

    b = delta_rule_decode_triton(p["q"], p["k"], p["v"], p["g"], p["beta"], s2, p["index"])
    assert torch.equal(a, b) and torch.equal(s1, s2)


@needs_kernels
def test_bad_shapes_are_refused() -> None:
    from kernels.gdn_triton import delta_rule_decode_triton

    assert DEV is not None
    p = _on(_problem(3, 2, 3, 16, 16, torch.float32, slots=4), DEV)
    args = [p[n] for n in ("q", "k", "v", "g", "beta", "states", "index")]
    with pytest.raises(ValueError, match="need contiguous float32"):
        delta_rule_decode_triton(*args[:5], p["states"].to(torch.bfloat16), p["index"])
    with pytest.raises(ValueError, match=r"\[B, Hv\]"):
        delta_rule_decode_triton(*args[:3], p["g"][:2], *args[4:])
    with pytest.raises(ValueError, match="heads must be contiguous"):
        delta_rule_decode_triton(p["q"].transpose(1, 2).contiguous().transpose(1, 2), *args[1:])
    from kernels.gdn_triton import conv_decode_triton, decode_out_triton, gated_rms_norm_triton

    z, ab, hv1 = torch.zeros(3, 6, 16, device=DEV), torch.zeros(3, 12, device=DEV), torch.zeros(6, device=DEV)
    before = p["states"].clone()
    with pytest.raises(ValueError, match=r"ab \[B, 2 Hv\]"):
        decode_out_triton(*args[:3], ab[:, :6], hv1, hv1, z, torch.zeros(16, device=DEV), 1e-6, p["states"],
                          p["index"], torch.float32)
    with pytest.raises(ValueError, match="need z as v with each row contiguous"):
        decode_out_triton(*args[:3], ab, hv1, hv1, z.transpose(1, 2).contiguous().transpose(1, 2),
                          torch.zeros(16, device=DEV), 1e-6, p["states"], p["index"], torch.float32)
    assert torch.equal(p["states"], before), "a refused call changed the states"

    x, w = torch.zeros(2, 8, device=DEV), torch.zeros(8, 4, device=DEV)
    with pytest.raises(ValueError, match=r"need states \[S, C, K-1\]"):
        conv_decode_triton(x, torch.zeros(3, 8, 4, device=DEV), torch.zeros(2, dtype=torch.long, device=DEV), w)
    with pytest.raises(ValueError, match="need o contiguous float32"):
        gated_rms_norm_triton(torch.zeros(2, 1, 8, device=DEV, dtype=torch.bfloat16), torch.zeros(2, 1, 8, device=DEV),
                              torch.zeros(8, device=DEV), 1e-6, torch.float32)


def test_kernels_under_interpreter() -> None:
    pytest_under_interpreter(__file__, "not interpreter")
