"""fla-core's Triton gated-delta-rule kernels against our torch reference (kernels.gdn), on a GPU, with
the Qwen3.6-27B per-rank head counts at TP=2 (8 key heads, 24 value heads, head dim 128).
One JSON line per case with the max differences of outputs and final states, relative to their scale;
fla-core computes in bf16, so a case passes within 2e-2 of the scale (a wrong kernel is off by O(1)).
Exits 1 if any case fails (tools/checks.py)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.gdn import delta_rule_varlen
from tools.checks import Checks, exit_with

TOL = 2e-2


def case(lengths: list[int], hk: int = 8, hv: int = 24, d: int = 128, dtype: torch.dtype = torch.bfloat16) -> dict:
    g = torch.Generator(device="cuda").manual_seed(sum(lengths))
    t = sum(lengths)
    q = torch.randn(t, hk, d, generator=g, device="cuda").to(dtype)
    k = torch.randn(t, hk, d, generator=g, device="cuda").to(dtype)
    v = torch.randn(t, hv, d, generator=g, device="cuda").to(dtype)
    gate = -torch.nn.functional.softplus(torch.randn(t, hv, generator=g, device="cuda"))
    beta = torch.rand(t, hv, generator=g, device="cuda").to(dtype)
    s0 = torch.randn(len(lengths) + 2, hv, d, d, generator=g, device="cuda") * 0.05
    slots = list(range(len(lengths)))[::-1]  # state slots in a different order than the sequences
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    ref_states, fla_states = s0.clone(), s0.clone()
    ref = delta_rule_varlen(q, k, v.float(), gate, beta.float(), ref_states, slots, cu, "reference")
    out = delta_rule_varlen(q, k, v, gate, beta, fla_states, slots, cu, "fla")
    return {"lengths": lengths, "max_out_diff": float((out - ref).abs().max()), "out_scale": float(ref.abs().max()),
            "max_state_diff": float((fla_states - ref_states).abs().max()),
            "state_scale": float(ref_states.abs().max())}


if __name__ == "__main__":
    checks = Checks("check_fla")
    for lengths in ([1] * 32, [1, 1, 1], [100, 257, 31], [512], [7, 1, 64]):
        r = case(lengths)
        checks.expect(f"fla vs reference {lengths[:4]}", r["max_out_diff"] <= TOL * r["out_scale"]
                      and r["max_state_diff"] <= TOL * r["state_scale"], **r)
    exit_with(checks)
