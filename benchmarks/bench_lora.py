"""Batched multi-LoRA kernels against their bytes (issue 18), the torch reference and a per-adapter loop.

    python benchmarks/bench_lora.py                       # Qwen3-8B layers, decode and prefill, bf16 + fp8
    python benchmarks/bench_lora.py --sweep               # launch-parameter sweep on the decode cases
    python benchmarks/bench_lora.py --quick --device cpu  # tiny shapes (CI smoke test; TRITON_INTERPRET=1
                                                          # adds the triton columns)

Buffers are laid out as the engine's wrappers hold them (engine/lora/layers.py: A [slots, r_max, n*K], B
rank-major [slots, r_max, sum n], fp8 with float32 scales), one slot per distinct adapter, each adapter's
true rank `rank`, tokens dealt round-robin to the adapters. One JSON line per case (layer, tokens, adapters,
lora dtype, variant), times in microseconds per call of one wrapped layer (all its slices):
  graph_us     kernels.lora_triton.add_lora replayed from a captured device graph (20 calls per graph)
  eager_us     the same called from Python
  byte_us      the bytes the call must move once (the distinct adapters' A and B at their true rank and fp8
               scales, x read, y read and written) / the copy bandwidth measured in the same run
  graph_over_bytes  graph_us / byte_us (issue 18's bar: 1.5)
  reference_us engine.lora.punica.ReferenceLoRABatch (per slot, fp32 matmuls), and loop_us / loop_graph_us a
               per-adapter, per-slice loop of torch matmuls in the layer dtype (a naive engine), bf16 only
Variants: split (a K-split shrink launch + an expand launch), cols (the same with the column expand, kernels.
lora_cols, for steps of <= 64 tokens, fp8 B included: others run split) and fused (one launch). After the cases, one
"step" line per (tokens, adapters, lora dtype, variant): the four wrapped layers of a Qwen3 decoder layer
(qkv, o, gate_up, down) x --layers, graph time against byte time.
--sweep: each launch parameter of kernels.lora_triton.CONFIG_KEYS varied alone around the defaults, on the
decode step of 32 tokens over 32 and over 1 adapters; one line per setting with the step's time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import default_device, device_sync, graph_time_us, time_us
from engine.lora.punica import ReferenceLoRABatch, Scales, SlotRanks, group_tokens
from kernels import lora_triton, reference, triton_env

# Qwen3-8B: hidden 4096, 32 q heads / 8 kv heads of 128, intermediate 12288.
LAYERS = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate_up": (4096, [12288, 12288]),
          "down": (12288, [4096])}
QUICK = {"qkv": (64, [64, 16, 16]), "o": (64, [64]), "gate_up": (64, [96, 96]), "down": (96, [64])}
SWEEP = {"split": {"shrink_split_k": [2, 4, 8, 16], "shrink_block_k": [64, 256, 512], "shrink_warps": [8],
                   "shrink_stages": [2, 4], "expand_block_n": [128, 512], "expand_n_iters": [2, 4],
                   "expand_warps": [8], "expand_stages": [3], "run_m": [1, 32, 64]},
         "fused": {"fused_block_k": [64, 256, 512], "fused_block_n": [128, 512], "fused_n_iters": [1, 2, 4, 16],
                   "fused_warps": [8], "fused_stages": [2, 4], "run_m": [32, 64]},
         "cols": {"cols_block_n": [32, 64, 128], "cols_group": [1, 2, 8], "cols_warps": [2, 8],
                  "cols_stages": [2, 3, 5]}}


class Layer:
    """One wrapped layer's slot buffers, in the engine's layout and storage dtype."""

    def __init__(self, k: int, sizes: list[int], slots: int, r_max: int, rank: int, dtype: torch.dtype, fp8: bool,
                 dev: torch.device, g: torch.Generator) -> None:
        n, nt = len(sizes), sum(sizes)
        a = torch.randn(slots, r_max, n * k, generator=g) / k ** 0.5
        b = torch.randn(slots, r_max, nt, generator=g) / r_max ** 0.5
        a[:, rank:] = 0
        b[:, rank:] = 0
        self.scales: Scales | None = None
        if fp8:
            qa, sa = reference.fp8_rows(a.reshape(-1, k))  # per rank row of each slice
            qb, sb = reference.fp8_rows(b.transpose(1, 2).reshape(-1, r_max))  # per output row
            a_st = qa.view(slots, r_max, n * k).to(dev)
            b_st = qb.view(slots, nt, r_max).transpose(1, 2).contiguous().to(dev)
            sa_st, sb_st = sa.view(slots, r_max, n).to(dev), sb.view(slots, 1, nt).to(dev)
            offs = [sum(sizes[:i]) for i in range(n)]
            self.scales = Scales([sa_st[:, :, i] for i in range(n)],
                                 [sb_st[:, 0, o:o + m] for o, m in zip(offs, sizes)])
        else:
            a_st, b_st = a.to(dev, dtype), b.to(dev, dtype)
        self.offsets = [sum(sizes[:i]) for i in range(n)]
        self.a = [a_st[:, :, i * k:(i + 1) * k] for i in range(n)]
        self.b = [b_st[:, :, o:o + m].transpose(1, 2) for o, m in zip(self.offsets, sizes)]
        self.host = [[rank] * slots for _ in sizes]
        self.ranks = torch.tensor(self.host, dtype=torch.int32, device=dev)
        self.k, self.sizes, self.rank = k, sizes, rank
        self.el = 1 if fp8 else torch.empty(0, dtype=dtype).element_size()
        self.fp8 = fp8

    def bytes(self, adapters: int, tokens: int, act_el: int) -> int:
        w = self.rank * (len(self.sizes) * self.k + sum(self.sizes)) * self.el
        if self.fp8:
            w += (self.rank * len(self.sizes) + sum(self.sizes)) * 4
        return adapters * w + tokens * (self.k + 2 * sum(self.sizes)) * act_el


def copy_bandwidth(dev: torch.device) -> float:
    n = 1 << 30 if dev.type != "cpu" else 1 << 24
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    sync = device_sync(dev)
    for _ in range(3):
        b.copy_(a)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync()
    return 2 * n * 10 / (time.perf_counter() - t0)


def measure(lay: Layer, x: torch.Tensor, y: torch.Tensor, slot_ids: list[int], slots: int, dev: torch.device,
            budget_s: float, use_triton: bool, peers: bool) -> dict:
    rec: dict = {"graph_us": None, "eager_us": None}
    sync = device_sync(dev)
    if use_triton:
        info = group_tokens(slot_ids, slots, device=dev)
        sa = lay.scales.a if lay.scales is not None else None
        sb = lay.scales.b if lay.scales is not None else None

        def tri() -> None:
            lora_triton.add_lora(y, x, lay.a, lay.b, info, lay.offsets, lay.ranks, True, sa, sb)

        rec["eager_us"] = time_us(tri, sync, budget_s)
        rec["graph_us"] = graph_time_us(tri, dev, budget_s)
    if peers:
        ref = ReferenceLoRABatch.build(slot_ids, slots, dev)
        rec["reference_us"] = time_us(lambda: ref.add_lora(y, x, lay.a, lay.b, SlotRanks(lay.host, lay.ranks),
                                                           lay.offsets, scales=lay.scales), sync, budget_s)
        token_slots = torch.tensor(slot_ids, device=dev)
        groups = [(s, (token_slots == s).nonzero().flatten()) for s in sorted(set(slot_ids))]
        r = lay.rank

        def loop() -> None:
            for s, rows in groups:
                xs = x[rows]
                for a, b, off in zip(lay.a, lay.b, lay.offsets):
                    y[rows, off:off + b.size(1)] += (xs @ a[s, :r].t()) @ b[s, :, :r].t()

        if lay.scales is None:
            rec["loop_us"] = time_us(loop, sync, budget_s)
            rec["loop_graph_us"] = graph_time_us(loop, dev, budget_s)
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=default_device(), help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and short timings (CI smoke test)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--lora-dtypes", nargs="+", default=["model", "fp8"], choices=["model", "fp8"],
                   help="A/B storage: the layer dtype, fp8 e4m3 + scales")
    p.add_argument("--variants", nargs="+", default=["split", "fused"], choices=["split", "fused", "cols"],
                   help="split (K-split shrink, split expand), fused (one launch), cols (the column expand)")
    p.add_argument("--layer-kinds", default=None, help="comma-separated subset of qkv,o,gate_up,down")
    p.add_argument("--tokens", type=int, nargs="+", default=[32, 1024])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--r-max", type=int, default=16, help="max_lora_rank (bench_e2e's engines use 16)")
    p.add_argument("--layers", type=int, default=36, help="decoder layers of the per-step lines")
    p.add_argument("--sweep", action="store_true", help="the launch-parameter sweep (decode, 32 tokens)")
    p.add_argument("--no-peers", action="store_true", help="skip the reference and loop columns")
    p.add_argument("--budget-ms", type=float, default=None,
                   help="timing budget per measurement (default 30; --quick: 0, i.e. one timed call)")
    args = p.parse_args(argv)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shapes = QUICK if args.quick or dev.type == "cpu" else LAYERS
    budget_s = (args.budget_ms if args.budget_ms is not None else (0.0 if args.quick else 30.0)) / 1e3
    use_triton = triton_env.usable_on(dev.type)
    if not use_triton:
        print(f"# triton not usable on {dev} (CPU: set TRITON_INTERPRET=1): no triton columns", file=sys.stderr)
    kinds = args.layer_kinds.split(",") if args.layer_kinds else list(shapes)
    tokens, adapters = ([8], [1, 4]) if args.quick else (args.tokens, args.adapters)
    if args.sweep:
        tokens, adapters = [32], [32, 1]
    bw = copy_bandwidth(dev)
    print(json.dumps({"bench": "lora", "case": "copy_bandwidth", "bytes_per_s": bw, "device": str(dev)}), flush=True)
    g = torch.Generator().manual_seed(0)
    slots = max(adapters)
    buffers = {(kind, ld): Layer(*shapes[kind], slots, args.r_max, args.rank, dtype, ld == "fp8", dev, g)
               for kind in kinds for ld in args.lora_dtypes}
    act_el = torch.empty(0, dtype=dtype).element_size()

    def run(t: int, n: int, ld: str, variant: str, peers: bool, emit: bool) -> tuple[float, float]:
        """(graph µs, byte µs) of one decoder layer's four wrapped layers (one line per layer when emit)."""
        lora_triton.CONFIG_OVERRIDES["fused"] = int(variant == "fused")
        lora_triton.CONFIG_OVERRIDES["cols"] = 64 if variant == "cols" else 0
        slot_ids = [i % n for i in range(t)]
        total = total_bytes = 0.0
        for kind in kinds:
            lay = buffers[(kind, ld)]
            x = torch.randn(t, lay.k, generator=g).to(dev, dtype)
            y = torch.zeros(t, sum(lay.sizes), device=dev, dtype=dtype)
            rec = measure(lay, x, y, slot_ids, slots, dev, budget_s, use_triton, peers)
            byte_us = lay.bytes(min(n, t), t, act_el) / bw * 1e6
            gu = rec["graph_us"] if rec["graph_us"] is not None else rec["eager_us"]
            total += gu or 0.0
            total_bytes += byte_us
            if emit:
                out = {"bench": "lora", "case": "layer", "layer": kind, "k": lay.k, "n": lay.sizes, "tokens": t,
                       "adapters": n, "rank": args.rank, "r_max": args.r_max, "lora_dtype": ld, "variant": variant,
                       **rec, "byte_us": byte_us,
                       "graph_over_bytes": gu / byte_us if gu else None}
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}), flush=True)
        return total, total_bytes

    overrides = dict(lora_triton.CONFIG_OVERRIDES)
    for ld in args.lora_dtypes:
        for t in tokens:
            for n in adapters:
                if n > t:
                    continue
                for variant in args.variants:
                    if args.sweep:
                        lora_triton.CONFIG_OVERRIDES.clear()
                        lora_triton.CONFIG_OVERRIDES.update(overrides)
                        base, by = run(t, n, ld, variant, False, False)
                        settings = [(key, v) for key, vals in SWEEP[variant].items() for v in vals]
                        print(json.dumps({"bench": "lora", "case": "sweep", "variant": variant, "lora_dtype": ld,
                                          "tokens": t, "adapters": n, "setting": "default",
                                          "step_ms": round(base * args.layers / 1e3, 4),
                                          "over_bytes": round(base / by, 3)}), flush=True)
                        for key, v in settings:
                            lora_triton.CONFIG_OVERRIDES.clear()
                            lora_triton.CONFIG_OVERRIDES.update({**overrides, key: v})
                            us, by = run(t, n, ld, variant, False, False)
                            print(json.dumps({"bench": "lora", "case": "sweep", "variant": variant, "lora_dtype": ld,
                                              "tokens": t, "adapters": n, "setting": f"{key}={v}",
                                              "step_ms": round(us * args.layers / 1e3, 4),
                                              "over_bytes": round(us / by, 3)}), flush=True)
                        continue
                    us, by = run(t, n, ld, variant, not args.no_peers and variant == args.variants[0], True)
                    print(json.dumps({"bench": "lora", "case": "step", "tokens": t, "adapters": n, "lora_dtype": ld,
                                      "variant": variant, "layers": args.layers,
                                      "lora_ms_per_step": round(us * args.layers / 1e3, 4),
                                      "byte_ms_per_step": round(by * args.layers / 1e3, 4),
                                      "over_bytes": round(us / by, 3) if by else None}), flush=True)
    lora_triton.CONFIG_OVERRIDES.clear()
    lora_triton.CONFIG_OVERRIDES.update(overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
