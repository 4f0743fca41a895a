"""int4 weight-only GEMM (issue 6 (a)): kernels.int4 backends vs a bf16 torch.matmul, Qwen3-8B shapes.

    python benchmarks/bench_int4.py                  # K,N in {(4096,6144),(4096,4096),(4096,24576),(12288,4096)},
                                                     # M in {1,16,64,256,1024}, on the default device
    python benchmarks/bench_int4.py --quick --device cpu   # tiny shapes, seconds (CI smoke test;
                                                            # TRITON_INTERPRET=1 adds the triton column)

One JSON line per (M, K, N): for each method its time per call in microseconds (`<m>_us`), its effective
bandwidth (`<m>_GBps` = bytes of weights (+ scales and zeros) + activations in and out, over the time),
and its speedup over bf16 (`<m>_speedup_vs_bf16` = bf16_us / <m>_us). Methods: `bf16` (x @ W, dense
bf16 weight), `triton` (our W4A16 kernel on the checkpoint layout), `native_<device>` (torch's int4
op for this device, where kernels.int4.native_supported says it runs). Times are the mean over repeated
calls after a warm-up (wall clock with a device sync at the end), and `<m>_graph_us` the same calls
replayed from a captured device graph (no Python launch cost) where supported. Weights are random int4
in the AutoRound/GPTQ-v1 layout (group 128, negative scales); bytes/time counts each byte once, so
each call reads one of several copies of the weights in turn (at least --rotate-mb MB in all), so the
weights come from HBM, not from the last call's L2 (an H200 has 50 MB of L2; a 4096 x 6144 int4 weight
is 12.6 MB). `dequant_gemm` is the engine's large-M path on GPUs: one fused Triton dequantization into a
transient bf16 weight, then the bf16 GEMM.

    python benchmarks/bench_int4.py --sweep          # time launch configs of the Triton kernel (--sweep-ms)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import default_device, device_sync, graph_time_us, time_us
from kernels import triton_env
from kernels.int4 import (
    INT4_BACKENDS,
    Int4Layout,
    TritonInt4Config,
    dequant_triton,
    int4_mm,
    native_supported,
    prepare_int4,
    triton_config,
    triton_mm,
)
from kernels.reference import pack_int4_cols, pack_int4_rows

FULL = dict(shapes=[(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)], ms=[1, 16, 64, 256, 1024])
QUICK = dict(shapes=[(256, 384), (512, 256)], ms=[1, 16])
GROUP = 128


def random_checkpoint(k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    qweight = pack_int4_rows(torch.randint(0, 16, (k, n), generator=g))
    qzeros = pack_int4_cols(torch.randint(6, 10, (k // GROUP, n), generator=g))
    sign = torch.where(torch.rand(k // GROUP, n, generator=g) < 0.5, -1.0, 1.0)
    scales = ((torch.rand(k // GROUP, n, generator=g) * 0.01 + 0.005) * sign).to(torch.float16)
    return qweight, qzeros, scales


def copies_for(nbytes: int, rotate_mb: float) -> int:
    return max(1, min(64, int(rotate_mb * 2**20 // max(nbytes, 1)) + 1)) if rotate_mb > 0 else 1


def over(fn: Callable[[object], object], items: list) -> Callable[[], None]:
    """One timed call: fn on each weight copy in turn."""
    def call() -> None:
        for it in items:
            fn(it)
    return call


def per_call(fn: Callable[[object], object], items: list, dev: torch.device, budget_s: float) -> float:
    """µs of fn on one weight copy: graph-replayed where the device has graphs."""
    call = over(fn, items)
    return (graph_time_us(call, dev, budget_s, reps=2) or time_us(call, device_sync(dev), budget_s)) / len(items)


def run_case(dev: torch.device, m_rows: int, layout: Int4Layout, dense: list[torch.Tensor], prepared: dict,
             methods: list[str], int4_weight_bytes: int, budget_s: float, no_graph: bool) -> dict:
    k, n = layout.in_features, layout.out_features
    sync = device_sync(dev)
    x = torch.randn(m_rows, k, device=dev, dtype=dense[0].dtype)
    act_bytes = (m_rows * k + m_rows * n) * x.element_size()
    rec: dict = dict(bench="int4", device=str(dev), dtype=str(dense[0].dtype).removeprefix("torch."), M=m_rows, K=k,
                     N=n, group=layout.group_size, weight_copies={"bf16": len(dense)})
    runs: dict[str, tuple[Callable[[], object] | None, int, int]] = {
        "bf16": (over(lambda d: x @ d, dense), k * n * dense[0].element_size() + act_bytes, len(dense))}
    for m in methods:
        ws = prepared.get(m)
        if ws is None:
            runs[m] = (None, 0, 1)
        elif m == "dequant_gemm":
            runs[m] = (over(lambda w: x @ dequant_triton(w.weight, w.zeros, w.scales, layout.group_size,
                                                         layout.zero_offset, x.dtype), ws),
                       int4_weight_bytes + act_bytes, len(ws))
        else:
            runs[m] = (over(lambda w: int4_mm(x, w), ws), int4_weight_bytes + act_bytes, len(ws))
        rec["weight_copies"][m] = len(ws) if ws else 0
    for name, (fn, nbytes, reps) in runs.items():
        if fn is None:  # the backend does not support this layout / dtype here
            rec[f"{name}_us"] = rec[f"{name}_GBps"] = None
            continue
        us = time_us(fn, sync, budget_s) / reps
        rec[f"{name}_us"] = round(us, 2)
        rec[f"{name}_GBps"] = float(f"{nbytes / us / 1e3:.4g}")
        if not no_graph:
            gus = graph_time_us(fn, dev, budget_s, reps=max(1, 20 // reps))
            rec[f"{name}_graph_us"] = round(gus / reps, 2) if gus is not None else None
    for name in runs:
        if name != "bf16" and rec.get(f"{name}_us"):
            rec[f"{name}_speedup_vs_bf16"] = round(rec["bf16_us"] / rec[f"{name}_us"], 3)
            if rec.get(f"{name}_graph_us") and rec.get("bf16_graph_us"):
                rec[f"{name}_graph_speedup_vs_bf16"] = round(rec["bf16_graph_us"] / rec[f"{name}_graph_us"], 3)
    return rec


# block_m 0: each M takes the heuristic's
SWEEP = [TritonInt4Config(0, bn, bk, split, warps, stages) for bn, bk in ((64, 128), (128, 64))
         for split in (1, 2, 4, 8) for warps, stages in ((4, 3), (4, 5), (8, 4))]


def sweep(dev: torch.device, shapes: list[tuple[int, int]], ms: list[int], budget_s: float, rotate_mb: float) -> None:
    """Graph-replayed time of each launch config of the Triton kernel; one line per (M, K, N) with the best five,
    the heuristic's choice (kernels.int4.triton_config) and torch's native op for comparison."""
    for k, n in shapes:
        layout = Int4Layout(group_size=GROUP, zero_offset=1, in_features=k, out_features=n)
        nbytes = k * n // 2
        ws = [prepare_int4(*(t.to(dev) for t in random_checkpoint(k, n, seed=i)), layout, "triton",
                           dtype=torch.bfloat16) for i in range(copies_for(nbytes, rotate_mb))]
        native = f"native_{dev.type}"
        nws = [prepare_int4(w.weight, w.zeros, w.scales, layout, native, dtype=torch.bfloat16)  # type: ignore[arg-type]
               for w in ws] if native in INT4_BACKENDS and native_supported(native, layout, torch.bfloat16) else []
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            chosen = triton_config(m, k, n, GROUP)
            configs = [replace(c, block_m=chosen.block_m) for c in SWEEP if k % (c.block_k * c.split_k) == 0]
            times = {c: per_call(lambda w, c=c, x=x: triton_mm(x, w, None, c), ws, dev, budget_s)
                     for c in {chosen, *configs}}
            best = sorted(times.items(), key=lambda t: t[1])[:5]
            rec = {"sweep": "int4 triton", "M": m, "K": k, "N": n, "copies": len(ws),
                   "heuristic_us": round(times[chosen], 2), "heuristic": chosen.__dict__,
                   "best": [{"us": round(t, 2), **c.__dict__} for c, t in best]}
            if nws:
                rec["native_us"] = round(per_call(lambda w, x=x: int4_mm(x, w), nws, dev, budget_s), 2)
            print(json.dumps(rec), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=default_device(), help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and short timings (CI smoke test)")
    p.add_argument("--budget-ms", type=float, default=None,
                   help="timing budget per measurement (default 50; --quick: 0, i.e. one timed call)")
    p.add_argument("--no-graph", action="store_true", help="skip the graph-replay timings")
    p.add_argument("--rotate-mb", type=float, default=256.0,
                   help="cycle through copies of the weights totalling at least this much (0: one copy)")
    p.add_argument("--sweep", action="store_true", help="time launch configs of the Triton kernel")
    p.add_argument("--sweep-ms", type=int, nargs="*", default=[16, 32, 64], help="rows to sweep")
    args = p.parse_args(argv)
    if args.quick:
        args.rotate_mb = 0.0
    dev = torch.device(args.device)
    cfg = QUICK if args.quick or dev.type == "cpu" else FULL
    budget_s = (args.budget_ms if args.budget_ms is not None else (0.0 if args.quick else 50.0)) / 1e3
    dtype = torch.bfloat16
    native = f"native_{dev.type}"
    if args.sweep:
        sweep(dev, cfg["shapes"], args.sweep_ms if not args.quick else [1], budget_s, args.rotate_mb)
        return 0
    methods = ["triton", "dequant_gemm"] if triton_env.usable_on(dev.type) else []
    if native in INT4_BACKENDS:
        methods.append(native)
    if "triton" not in methods:
        print(f"# triton not usable on {dev} (CPU: set TRITON_INTERPRET=1): no triton columns", file=sys.stderr)

    for k, n in cfg["shapes"]:
        layout = Int4Layout(group_size=GROUP, zero_offset=1, in_features=k, out_features=n)
        ckpts = [tuple(t.to(dev) for t in random_checkpoint(k, n, seed=k + n + i))
                 for i in range(copies_for(k * n // 2, args.rotate_mb))]
        dense = [prepare_int4(*c, layout, "reference", dtype=dtype).weight  # [K, N] bf16
                 for c in ckpts[:copies_for(k * n * 2, args.rotate_mb)]]
        prepared = {m: [prepare_int4(*c, layout, "triton" if m == "dequant_gemm" else m, dtype=dtype)  # type: ignore[arg-type]
                        for c in ckpts]
                    for m in methods if native_supported("triton" if m == "dequant_gemm" else m, layout, dtype)}  # type: ignore[arg-type]
        qzeros, scales = ckpts[0][1], ckpts[0][2]
        int4_weight_bytes = k * n // 2 + scales.numel() * scales.element_size() + qzeros.numel() * 4
        for m_rows in cfg["ms"]:
            rec = run_case(dev, m_rows, layout, dense, prepared, methods, int4_weight_bytes, budget_s, args.no_graph)
            print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
