"""The LoRA shrink joined to the op before its layer (kernels.lora_prologue) against the separate launches, on the
Qwen3-8B layer shapes: per decoder layer, the three sites it applies to, each replayed from a device graph
(--layers distinct adapter stores, so 32 adapters stream their bytes from memory as in a step):

  separate: rms_norm (+ residual) -> shrink -> base GEMM -> expand   (qkv, gate_up)
            silu_and_mul -> shrink -> base GEMM -> expand            (down)
  joined:   norm_shrink -> base GEMM -> expand;  act_shrink -> base GEMM -> expand
  base:     the same without LoRA (norm / act -> GEMM), for the LoRA's added time
  shrink:   joined without the expand (norm_shrink / act_shrink -> GEMM): what the joined op itself adds

The base GEMM is a bf16 torch.mm shared by the layers (it separates the prologue from the expand as the int4 GEMM
does in the engine). Prints one JSON line per (tokens, adapters) with us per decoder layer and the ratio; exits 1
when the two forms' outputs differ beyond bf16 rounding.
Run: python benchmarks/bench_prologue.py [--tokens 32] [--adapters 1 32]   (--quick: tiny shapes, CPU interpreter)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import default_device, device_sync, graph_time_us, time_us
from engine.lora.punica import group_tokens
from kernels import lora_triton
from kernels.fused import rms_norm, silu_and_mul
from kernels.lora_prologue import act_shrink, norm_shrink
from kernels.lora_triton import TokenGroups

# (K, slice widths) of qkv, gate_up and down in Qwen3-8B at TP=1; QUICK: small enough for the interpreter
SHAPES = {"qkv": (4096, [4096, 1024, 1024]), "gate_up": (4096, [12288, 12288]), "down": (12288, [4096])}
QUICK = {"qkv": (64, [64, 16, 16]), "gate_up": (64, [96, 96]), "down": (96, [64])}


class Site:
    """One wrapped layer's LoRA stores (A as one [S, r_max, n*K] store, B rank-major) and its base weight."""

    def __init__(self, k: int, sizes: list[int], slots: int, r_max: int, dtype: torch.dtype, dev: torch.device,
                 w: torch.Tensor) -> None:
        self.k, self.sizes, self.w = k, sizes, w
        self.a_store = (torch.randn(slots, r_max, len(sizes) * k, device=dev) / k**0.5).to(dtype)
        self.a = [self.a_store[:, :, i * k:(i + 1) * k] for i in range(len(sizes))]
        b_store = (torch.randn(slots, r_max, sum(sizes), device=dev) / 4).to(dtype)
        offs = [sum(sizes[:i]) for i in range(len(sizes))]
        self.b = [b_store[:, :, o:o + n].transpose(1, 2) for o, n in zip(offs, sizes)]
        self.offsets = offs
        self.ranks = torch.full((len(sizes), slots), r_max, dtype=torch.int32, device=dev)


def layer(site: dict[str, Site], mode: str, x: torch.Tensor, res: torch.Tensor, gu: torch.Tensor,
          norm_w: torch.Tensor, info: TokenGroups) -> list[torch.Tensor]:
    """One decoder layer's three sites in one mode (base, separate, joined, shrink); returns their outputs."""
    outs = []
    joins = mode in ("joined", "shrink")
    for name in ("qkv", "gate_up"):
        s = site[name]
        if joins:
            y, _, buf = norm_shrink(x, norm_w, 1e-6, False, res, s.a, info, s.ranks)
        else:
            y, _ = rms_norm(x, norm_w, 1e-6, False, res, "triton")
        out = y @ s.w
        if mode == "separate":  # what the engine runs where nothing joins
            lora_triton.add_lora(out, y, s.a, s.b, info, s.offsets, s.ranks)
        elif mode == "joined":
            lora_triton.expand_partials(out, buf, s.b, info, s.offsets, s.ranks)
        outs.append(out)
    s = site["down"]
    if joins:
        y, buf = act_shrink(gu, s.a[0], info, s.ranks)
    else:
        y = silu_and_mul(gu, "triton")
    out = y @ s.w
    if mode == "separate":
        lora_triton.add_lora(out, y, s.a, s.b, info, s.offsets, s.ranks)
    elif mode == "joined":
        lora_triton.expand_partials(out, buf, s.b, info, s.offsets, s.ranks)
    return [*outs, out]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=default_device())
    p.add_argument("--quick", action="store_true", help="tiny shapes, one timed call (CI smoke test)")
    p.add_argument("--tokens", type=int, nargs="+", default=[32])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 32])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--r-max", type=int, default=16)
    p.add_argument("--budget-ms", type=float, default=200.0)
    args = p.parse_args(argv)
    dev, dtype = torch.device(args.device), torch.bfloat16
    shapes = QUICK if args.quick else SHAPES
    layers, tokens, adapters = (2, [8], [1, 4]) if args.quick else (args.layers, args.tokens, args.adapters)
    budget_s = 0.0 if args.quick else args.budget_ms / 1e3
    slots = max(adapters)
    weights = {name: torch.randn(k, sum(sizes), device=dev).to(dtype) / k**0.5 for name, (k, sizes) in shapes.items()}
    sites = [{name: Site(k, sizes, slots, args.r_max, dtype, dev, weights[name]) for name, (k, sizes) in shapes.items()}
             for _ in range(layers)]
    hidden, inter = shapes["qkv"][0], shapes["down"][0]
    norm_w = torch.ones(hidden, device=dev, dtype=dtype)
    bad = 0
    for t in tokens:
        g = torch.Generator(device="cpu").manual_seed(t)
        x = torch.randn(t, hidden, generator=g).to(dev, dtype)
        res = torch.randn(t, hidden, generator=g).to(dev, dtype)
        gu = torch.randn(t, 2 * inter, generator=g).to(dev, dtype)
        for n in adapters:
            info = group_tokens([i % n for i in range(t)], slots, device=dev)
            inputs = (x, res, gu, norm_w, info)

            for a, b in zip(layer(sites[0], "separate", *inputs), layer(sites[0], "joined", *inputs)):
                ref = a.float()
                err = (b.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
                bad += err > 2e-2
            rec: dict[str, object] = {"bench": "prologue", "tokens": t, "adapters": n, "layers": layers,
                                      "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)}
            for mode in ("base", "separate", "joined", "shrink"):
                def step(mode: str = mode, inputs: tuple = inputs) -> None:
                    for site in sites:
                        layer(site, mode, *inputs)

                us = graph_time_us(step, dev, budget_s, reps=1)
                if us is None:
                    us = time_us(step, device_sync(dev), budget_s)
                rec[f"{mode}_us_per_layer"] = round(us / layers, 2)
            sep, joined, base = rec["separate_us_per_layer"], rec["joined_us_per_layer"], rec["base_us_per_layer"]
            rec["lora_added_separate"] = round(sep - base, 2)  # type: ignore[operator]
            rec["lora_added_joined"] = round(joined - base, 2)  # type: ignore[operator]
            rec["joined_over_separate"] = round(joined / sep, 3)  # type: ignore[operator]
            rec["joined_op_added"] = round(rec["shrink_us_per_layer"] - base, 2)  # type: ignore[operator]
            rec["expand_added"] = round(joined - rec["shrink_us_per_layer"], 2)  # type: ignore[operator]
            print(json.dumps(rec), flush=True)
    if bad:
        print(f"bench_prologue: {bad} outputs differ between the separate and the joined forms", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
