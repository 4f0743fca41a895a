"""The small per-layer ops (kernels.fused): the torch references against independent formulas (torch's own
rms_norm, transformers' rotary), and the Triton backend against the references.

Compiled Triton needs an accelerator; on a CPU-only machine the kernel cases run in a child pytest with
TRITON_INTERPRET=1 (test_kernels_under_interpreter). Tolerances: float32 differs from the reference only
in the order of sums (checked at 1e-5); bf16 outputs may sit one rounding apart (two bf16 ulps, 1.6e-2).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import fused
from kernels import reference as ref
from kernels.attention import write_kv as write_kv_ref
from tests.kernels.triton_env import DEV, INTERPRETING, assert_close_rel, needs_kernels, pytest_under_interpreter

REPO = Path(__file__).resolve().parents[2]
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# -- the references against independent formulas (CPU) --------------------------------------------------


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_reference_matches_torch(zero_centered: bool) -> None:
    x, r, w = _rand(5, 96), _rand(5, 96, seed=1), _rand(96, seed=2)
    y, h = ref.rms_norm(x, w, 1e-6, zero_centered, r)
    want_w = w + 1 if zero_centered else w
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x + r, (96,), want_w, eps=1e-6))


@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_rope_reference_matches_transformers(rotary_dim: int) -> None:
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    t, h, d, theta = 6, 3, 64, 10000.0
    q, k = _rand(t, h, d), _rand(t, 2, d, seed=1)
    pos = torch.tensor([0, 5, 1, 300, 7, 2])
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.outer(torch.arange(512).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    emb = torch.cat([freqs[pos], freqs[pos]], -1)  # transformers' [T, rd] cos/sin layout (halves repeated)
    rot = [x[..., :rotary_dim].transpose(0, 1)[None] for x in (q, k)]  # [1, H, T, rd]
    q_hf, k_hf = apply_rotary_pos_emb(rot[0], rot[1], emb.cos()[None], emb.sin()[None])
    for got, x, want in ((ref.rope_neox(q, cos_sin, pos, rotary_dim), q, q_hf),
                         (ref.rope_neox(k, cos_sin, pos, rotary_dim), k, k_hf)):
        torch.testing.assert_close(got[..., :rotary_dim], want[0].transpose(0, 1))
        torch.testing.assert_close(got[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("rotary_dim,zero_centered,with_norm", [(64, False, True), (16, True, True), (64, False, False)])
def test_joint_qk_norm_rope_is_the_two_separate_ones(rotary_dim: int, zero_centered: bool, with_norm: bool) -> None:
    """kernels.reference.qk_norm_rope (the CPU path: q and k heads side by side in one pass, the rotation as
    x * [cos, cos] + [x2, x1] * [-sin, sin]) equals rms_norm then rope_neox on each tensor alone."""
    q, k = _rand(7, 4, 64), _rand(7, 2, 64, seed=1)
    wq, wk = _rand(64, seed=2), _rand(64, seed=3)
    cos_sin, pos = _rand(100, rotary_dim, seed=4), torch.tensor([0, 5, 99, 3, 3, 42, 7])
    got_q, got_k = ref.qk_norm_rope(q, k, ref.rope_tables(cos_sin, pos), rotary_dim, wq if with_norm else None,
                                    wk if with_norm else None, 1e-6, zero_centered)
    for got, x, w in ((got_q, q, wq), (got_k, k, wk)):
        normed = ref.rms_norm(x, w, 1e-6, zero_centered)[0] if with_norm else x
        torch.testing.assert_close(got, ref.rope_neox(normed, cos_sin, pos, rotary_dim), rtol=1e-6, atol=1e-6)


def test_silu_and_mul_reference_is_the_formula() -> None:
    x = _rand(4, 10)
    torch.testing.assert_close(ref.silu_and_mul(x), x[:, :5] * torch.sigmoid(x[:, :5]) * x[:, 5:])


def test_sigmoid_gate_reference_is_the_formula() -> None:
    qg = _rand(3, 2, 16) * 4  # [T, H, query | gate] as gated attention's projection holds them
    o = _rand(3, 16, seed=1)
    got = fused.sigmoid_gate(o, qg[:, :, 8:], "reference")
    torch.testing.assert_close(got, o * (1 / (1 + torch.exp(-qg[:, :, 8:].reshape(3, 16)))))
    with pytest.raises(ValueError, match="sigmoid_gate"):
        fused.sigmoid_gate(o[:, :8], qg[:, :, 8:], "reference")


def test_unknown_backend_and_bad_shapes_raise() -> None:
    x = _rand(2, 8)
    with pytest.raises(ValueError, match="unknown fused-op backend"):
        fused.silu_and_mul(x, "nope")
    with pytest.raises(ValueError, match="rms_norm"):
        fused.rms_norm(x, _rand(7), 1e-6, False, None, "reference")
    with pytest.raises(ValueError, match="norm_rope"):
        fused.norm_rope(_rand(2, 1, 8), torch.zeros(2, dtype=torch.long), _rand(16, 6), 4, None, 0.0, False)
    with pytest.raises(ValueError, match="positions"):  # one position per token, no broadcasting
        fused.norm_rope(_rand(2, 1, 8), torch.zeros(1, dtype=torch.long), _rand(16, 8), 8, None, 0.0, False)
    with pytest.raises(ValueError, match="contiguous"):
        fused.norm_rope(_rand(2, 1, 8), torch.zeros(2, dtype=torch.long), _rand(16, 16)[:, :8], 8, None, 0.0,
                        False)
    with pytest.raises(ValueError, match="residual"):
        fused.rms_norm(x, _rand(8), 1e-6, False, x.double(), "reference")
    cache = _rand(4, 2, 1, 8)
    with pytest.raises(ValueError, match="write_kv"):  # a strided cache view would scatter to wrong slots
        fused.write_kv(_rand(4, 2, 2, 8)[:, :, 0:1], cache, _rand(1, 1, 8), _rand(1, 1, 8),
                       torch.zeros(1, dtype=torch.long), "reference")
    with pytest.raises(ValueError, match="write_kv"):
        fused.write_kv(cache, cache.clone(), _rand(2, 1, 8), _rand(2, 1, 8), torch.zeros(1, dtype=torch.long),
                       "reference")


# -- Triton against the references -----------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [96, 1024])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_triton(dtype: torch.dtype, d: int, zero_centered: bool) -> None:
    assert DEV is not None
    x = _rand(7, 2 * d, dtype=dtype)[:, :d]  # strided rows, as a split of a wider output
    r, w = _rand(7, d, dtype=dtype, seed=1), _rand(d, dtype=dtype, seed=2)
    for res in (None, r):
        want_y, want_h = ref.rms_norm(x, w, 1e-6, zero_centered, res)
        y, h = fused.rms_norm(x.to(DEV), w.to(DEV), 1e-6, zero_centered, None if res is None else res.to(DEV),
                              "triton")
        assert_close_rel(y, want_y, TOL[dtype], "y")
        if INTERPRETING and dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16 instead of rounding
            assert_close_rel(h, want_h, TOL[dtype], "h")
        else:
            assert torch.equal(h.cpu(), want_h), "the residual sum is one rounding, as torch's"


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), [(3, 256), (2, 80), (1, 1024)])
def test_sigmoid_gate_triton(dtype: torch.dtype, heads: int, head_dim: int) -> None:
    assert DEV is not None
    qg = _rand(5, heads, 2 * head_dim, dtype=dtype) * 4
    gate = qg[:, :, head_dim:]  # strided: the query half sits between heads
    o = _rand(5, heads * head_dim, dtype=dtype, seed=1)
    got = fused.sigmoid_gate(o.to(DEV), qg.to(DEV)[:, :, head_dim:], "triton")
    assert_close_rel(got, fused.sigmoid_gate(o, gate, "reference"), TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_triton(dtype: torch.dtype) -> None:
    assert DEV is not None
    x = _rand(6, 2 * 1500, dtype=dtype) * 4  # d = 1500: two column blocks, the second partial
    assert_close_rel(fused.silu_and_mul(x.to(DEV), "triton"), ref.silu_and_mul(x), TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_triton(dtype: torch.dtype) -> None:
    assert DEV is not None
    blocks, bs, hk, d, t = 6, 4, 2, 64, 5
    kv = _rand(t, 3 * hk * d, dtype=dtype)  # k and v as strided slices of one qkv row
    k, v = kv[:, hk * d:2 * hk * d].view(t, hk, d), kv[:, 2 * hk * d:].view(t, hk, d)
    slots = torch.tensor([17, 2, 23, 0, 9])
    want_k, want_v = _rand(blocks, bs, hk, d, dtype=dtype, seed=4), _rand(blocks, bs, hk, d, dtype=dtype, seed=5)
    got_k, got_v = want_k.to(DEV), want_v.to(DEV)
    write_kv_ref(want_k, want_v, k, v, slots)
    fused.write_kv(got_k, got_v, k.to(DEV), v.to(DEV), slots.to(DEV), "triton")
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d", "rotary_dim"), [(128, 128), (256, 64), (64, 32), (80, 80), (96, 40)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_write_kv_triton(dtype: torch.dtype, d: int, rotary_dim: int, with_norm: bool) -> None:
    """The joint op (one launch) against the separate reference ops: the rotated q returned, the rotated k and v
    in the caches at their slots, every other cache row untouched."""
    assert DEV is not None
    t, hq, hkv, blocks, bs = 5, 4, 2, 6, 4
    # q strided as a gated query ([query, gate] per head); k, v strided as slices of one fused qkv row
    q = _rand(t, hq, 2 * d, dtype=dtype)[:, :, :d]
    kv = _rand(t, 3 * hkv * d, dtype=dtype, seed=1)
    k, v = kv[:, hkv * d:2 * hkv * d].view(t, hkv, d), kv[:, 2 * hkv * d:].view(t, hkv, d)
    wq, wk = (_rand(d, dtype=dtype, seed=s) if with_norm else None for s in (2, 3))
    pos = torch.tensor([0, 9, 3, 511, 40], dtype=torch.int32 if d == 96 else torch.long)
    inv = 1.0 / 1e6 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.outer(torch.arange(512).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    slots = torch.tensor([17, 2, 23, 0, 9])
    for zero_centered in (False, True):
        want_k, want_v = _rand(blocks, bs, hkv, d, dtype=dtype, seed=4), _rand(blocks, bs, hkv, d, dtype=dtype, seed=5)
        got_k, got_v = want_k.to(DEV), want_v.to(DEV)
        want_q = fused.rope_write_kv(q, k, v, pos, cos_sin, rotary_dim, wq, wk, 1e-6, zero_centered, want_k, want_v,
                                     slots, "reference")
        got_q = fused.rope_write_kv(*(x.to(DEV) for x in (q, k, v, pos, cos_sin)), rotary_dim,
                                    *(None if w is None else w.to(DEV) for w in (wq, wk)), 1e-6, zero_centered,
                                    got_k, got_v, slots.to(DEV), "triton")
        assert got_q.is_contiguous() and got_q.shape == want_q.shape
        assert_close_rel(got_q, want_q, TOL[dtype], f"q, zero_centered={zero_centered}")
        assert_close_rel(got_k, want_k, TOL[dtype], f"k cache, zero_centered={zero_centered}")
        assert torch.equal(got_v.cpu(), want_v), "v is copied, not computed"
        untouched = torch.ones(blocks * bs, dtype=torch.bool)
        untouched[slots] = False
        seed_k = _rand(blocks, bs, hkv, d, dtype=dtype, seed=4).view(-1, hkv, d)
        assert torch.equal(got_k.cpu().view(-1, hkv, d)[untouched], seed_k[untouched])


def test_rope_write_kv_rejects_mismatched_inputs() -> None:
    q, k = _rand(2, 4, 8), _rand(2, 2, 8)
    cache = _rand(2, 2, 2, 8)
    cos_sin, pos, slots = _rand(16, 8), torch.zeros(2, dtype=torch.long), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="rope_write_kv"):  # one norm without the other
        fused.rope_write_kv(q, k, k, pos, cos_sin, 8, _rand(8), None, 1e-6, False, cache, cache.clone(), slots,
                            "reference")
    with pytest.raises(ValueError, match="rope_write_kv"):  # a cache in another dtype than the projections
        fused.rope_write_kv(q, k, k, pos, cos_sin, 8, None, None, 1e-6, False, cache.double(), cache.double(), slots,
                            "reference")
    with pytest.raises(ValueError, match="rope_write_kv"):  # v heads unlike k's
        fused.rope_write_kv(q, k, _rand(2, 1, 8), pos, cos_sin, 8, None, None, 1e-6, False, cache, cache.clone(),
                            slots, "reference")


def test_kernels_under_interpreter() -> None:
    pytest_under_interpreter(__file__, "triton")
