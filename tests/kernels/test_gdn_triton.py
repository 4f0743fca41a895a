"""The Gated DeltaNet decode kernel (kernels.gdn_triton) against the torch reference (kernels.gdn.delta_rule_decode,
itself checked against the token recurrence and transformers in test_gdn.py): outputs, the updated slots, and the
slots no row names left untouched. Inputs are views of one wider projection, as the layer passes them. Compiled on
an accelerator; on the CPU in a child pytest under TRITON_INTERPRET=1 (test_kernels_under_interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels.gdn import delta_rule_decode
from tests.kernels.test_lora_triton import REPO, _env
from tests.kernels.triton_env import DEV, HAS_TRITON, INTERPRETING, assert_close_rel, needs_kernels

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


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(INTERPRETING or DEV is not None, reason="kernels run in this process already")
def test_kernels_under_interpreter() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "not interpreter"], cwd=REPO, env=_env(TRITON_INTERPRET="1"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout and " skipped" not in proc.stdout, \
        proc.stdout[-3000:]
