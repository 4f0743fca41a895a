"""Gated DeltaNet decode step of one layer, Qwen3.6-27B's heads at TP=1 (Hk 16, Hv 48, Dk = Dv = 128): the in-place
kernel (kernels.gdn_triton) against what the engine ran before it, fla-core's fused_recurrent kernel on the slots
gathered into a dense state and scattered back. Both in a device graph (as decode runs), side by side, with the
state's byte floor (read + write of each row's slot at the copy bandwidth). Then the step's causal conv, gated
RMSNorm, gating and [b | a] projection (hidden 5120 -> 96), each kernel against the torch form it replaced (`conv_*`,
`norm_*`, `gating_*`, `proj_*`; the projection also per launch shape, `proj_cfg_*`), and the recurrence with its
gating + the norm against the three launches (`joined_*`). Exits 1 where two forms disagree.

    python benchmarks/bench_gdn_decode.py                # on a GPU with fla-core installed
    TRITON_INTERPRET=1 python benchmarks/bench_gdn_decode.py --quick   # smoke test, CPU: the kernel alone
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_e2e import copy_bandwidth
from benchmarks.timing import device_sync, graph_time_us, time_us
from kernels.gdn import causal_conv1d_decode, delta_rule_decode, gated_rms_norm, gdn_gating
from kernels.gdn_triton import (
    conv_decode_triton,
    decode_out_triton,
    delta_rule_decode_triton,
    gated_rms_norm_triton,
    gating_triton,
)
from kernels.skinny_triton import skinny_linear_triton

PROJ_CONFIGS = ((1, 1, 2048, 4), (1, 2, 2048, 4), (1, 4, 1024, 4), (2, 2, 2048, 4), (4, 2, 1024, 4), (4, 4, 512, 4),
                (4, 2, 2048, 8), (8, 2, 512, 4))
"""skinny_linear's launch shapes (BLOCK_M, BLOCK_N, BLOCK_K, warps) swept on the [b | a] projection (`proj_cfg_*`)."""


def fla_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The engine's decode before the in-place kernel (kernels/gdn.py at c203b60)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    o, final = fused_recurrent_gated_delta_rule(
        q=q[:, None], k=k[:, None], v=v[:, None], g=g[:, None].float(), beta=beta[:, None], scale=q.size(-1) ** -0.5,
        initial_state=states[index], output_final_state=True, use_qk_l2norm_in_kernel=True)
    states[index] = final.float()
    return o[:, 0].float()


def glue_pairs(qkv: torch.Tensor, index: torch.Tensor, conv_w: torch.Tensor, o: torch.Tensor, z: torch.Tensor,
               norm_w: torch.Tensor, ab: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, x: torch.Tensor,
               w_ba: torch.Tensor) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], ...]]:
    """part -> (kernel, the torch form it replaced), each a function of the conv state (only the conv uses it)."""
    return {"proj": (lambda st: skinny_linear_triton(x, w_ba), lambda st: F.linear(x, w_ba)),
            "conv": (lambda st: conv_decode_triton(qkv, st, index, conv_w),
                     lambda st: causal_conv1d_decode(qkv, st, index, conv_w)),
            "norm": (lambda st: gated_rms_norm_triton(o, z, norm_w, 1e-6, torch.bfloat16),
                     lambda st: gated_rms_norm(o, z, norm_w, 1e-6, torch.bfloat16)),
            "gating": (lambda st: torch.stack(gating_triton(ab, a_log, dt_bias)),
                       lambda st: torch.stack(gdn_gating(ab, a_log, dt_bias)))}


def joined_pair(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ab: torch.Tensor, a_log: torch.Tensor,
                dt_bias: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, index: torch.Tensor
                ) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """(decode_out_triton: the gating inside the recurrence, then the norm; the three launches it replaces), functions
    of the state."""
    def joined(st: torch.Tensor) -> torch.Tensor:
        return decode_out_triton(q, k, v, ab, a_log, dt_bias, z, norm_w, 1e-6, st, index, torch.bfloat16)

    def chain(st: torch.Tensor) -> torch.Tensor:
        g, beta = gating_triton(ab, a_log, dt_bias)
        o = delta_rule_decode_triton(q, k, v, g, beta, st, index)
        return gated_rms_norm_triton(o, z, norm_w, 1e-6, torch.bfloat16)

    return joined, chain


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64])
    ap.add_argument("--quick", action="store_true", help="tiny heads on the CPU (TRITON_INTERPRET=1), no peer")
    ap.add_argument("--budget", type=float, default=0.2, help="seconds of timing per form and batch")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    hk, hv, dk, dv = (2, 6, 32, 32) if a.quick else (16, 48, 128, 128)
    batches = [1, 3] if a.quick else a.batches
    forms = {"in_place": delta_rule_decode_triton}
    if dev.type != "cpu":
        forms["fla_gathered"] = fla_gathered
    bw = copy_bandwidth(dev)
    g = torch.Generator().manual_seed(0)
    bad = 0
    for b in batches:
        slots = 2 * b + 1
        qkv = torch.randn(b, 2 * hk * dk + hv * dv, generator=g).to(torch.bfloat16).to(dev)
        q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.view(b, hk, dk), k.view(b, hk, dk), v.view(b, hv, dv)
        gate = (-F.softplus(torch.randn(b, hv, generator=g)) * 0.5).to(dev)
        beta = torch.rand(b, hv, generator=g).to(torch.bfloat16).to(dev)
        s0 = (torch.randn(slots, hv, dk, dv, generator=g) * 0.1).to(dev)
        index = torch.randperm(slots, generator=g)[:b].to(dev)
        ref_states = s0.clone()
        ref = delta_rule_decode(q, k, v, gate, beta, ref_states, index)
        row: dict[str, object] = {"batch": b, "state_floor_us": 2 * b * hv * dk * dv * 4 / bw * 1e6}
        for name, fn in forms.items():
            states = s0.clone()
            out = fn(q, k, v, gate, beta, states, index)
            err = max((out - ref).abs().max().item(), (states - ref_states).abs().max().item())
            row[f"{name}_max_err"] = err
            bad += err > 1e-3

            call = functools.partial(fn, q, k, v, gate, beta, states, index)
            us = graph_time_us(call, dev, a.budget)
            row[f"{name}_us"] = us if us is not None else time_us(call, device_sync(dev), a.budget)
        if "fla_gathered_us" in row:
            row["in_place_speedup"] = row["fla_gathered_us"] / row["in_place_us"]  # type: ignore[operator]
        # The conv over q|k|v's channels (width 4, bf16 state) and the gated norm: kernel vs torch, same inputs.
        conv0 = torch.randn(slots, qkv.size(1), 3, generator=g).to(torch.bfloat16).to(dev)
        conv_w = torch.randn(qkv.size(1), 4, generator=g).to(torch.bfloat16).to(dev)
        o = torch.randn(b, hv, dv, generator=g).to(dev)
        z = torch.randn(b, hv * dv, generator=g).to(torch.bfloat16).to(dev).view(b, hv, dv)
        norm_w = torch.randn(dv, generator=g).to(torch.bfloat16).to(dev)
        ab = (torch.randn(b, 2 * hv, generator=g) * 4).to(torch.bfloat16).to(dev)
        a_log, dt_bias = torch.randn(hv, generator=g).to(dev), torch.randn(hv, generator=g).to(dev)
        hidden = 5120 if not a.quick else 320
        x = torch.randn(b, hidden, generator=g).to(torch.bfloat16).to(dev)
        w_ba = (torch.randn(2 * hv, hidden, generator=g) * hidden ** -0.5).to(torch.bfloat16).to(dev)
        pairs = glue_pairs(qkv, index, conv_w, o, z, norm_w, ab, a_log, dt_bias, x, w_ba)
        for part, (kernel, torch_form) in pairs.items():
            got = [(f(st), st) for f, st in ((kernel, conv0.clone()), (torch_form, conv0.clone()))]
            err = (got[0][0].float() - got[1][0].float()).abs().max().item() / got[1][0].float().abs().max().item()
            row[f"{part}_max_rel_err"] = err
            bad += err > 2e-2 or not torch.equal(got[0][1], got[1][1])  # bf16 outputs: an ulp; the state a copy
            for name, f in (("kernel", kernel), ("torch", torch_form)):
                call = functools.partial(f, conv0.clone())
                us = graph_time_us(call, dev, a.budget)
                row[f"{part}_{name}_us"] = us if us is not None else time_us(call, device_sync(dev), a.budget)
        # The [b | a] projection's launch shapes (the `proj` pair above runs skinny_config's).
        for cfg in PROJ_CONFIGS if dev.type != "cpu" else ():
            call = functools.partial(skinny_linear_triton, x, w_ba, None, cfg)
            err = (call().float() - F.linear(x, w_ba).float()).abs().max().item()
            bad += err > 2e-2
            row["proj_cfg_{}x{}x{}w{}_us".format(*cfg)] = graph_time_us(call, dev, a.budget)
        # The gating joined to the recurrence (then the gated norm), against the three launches.
        joined, chain = joined_pair(q, k, v, ab, a_log, dt_bias, z, norm_w, index)
        (y1, st1), (y2, st2) = ((f(st), st) for f, st in ((joined, s0.clone()), (chain, s0.clone())))
        row["joined_max_rel_err"] = (y1.float() - y2.float()).abs().max().item() / y2.float().abs().max().item()
        row["joined_state_err"] = (st1 - st2).abs().max().item()
        bad += row["joined_max_rel_err"] > 2e-2 or row["joined_state_err"] > 1e-5  # type: ignore[operator]
        for name, f in (("kernel", joined), ("three", chain)):
            call = functools.partial(f, s0.clone())
            us = graph_time_us(call, dev, a.budget)
            row[f"joined_{name}_us"] = us if us is not None else time_us(call, device_sync(dev), a.budget)
        print(json.dumps(row), flush=True)
    print("bench_gdn_decode: " + ("FAIL (a form disagrees with the reference)" if bad else "PASS"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
