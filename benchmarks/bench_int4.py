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
repeated calls that hit L2 (K*N/2 <= ~50 MB on an H200) can read above the HBM bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import default_device, device_sync, graph_time_us, time_us
from kernels.int4 import INT4_BACKENDS, Int4Layout, int4_mm, native_supported, prepare_int4
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


def triton_usable(dev: torch.device) -> bool:
    from kernels import int4

    if int4.triton is None:
        return False
    return int4._interpreting() if dev.type == "cpu" else True


def run_case(dev: torch.device, m_rows: int, layout: Int4Layout, dense: torch.Tensor, prepared: dict,
             methods: list[str], int4_weight_bytes: int, budget_s: float, no_graph: bool) -> dict:
    k, n = layout.in_features, layout.out_features
    sync = device_sync(dev)
    x = torch.randn(m_rows, k, device=dev, dtype=dense.dtype)
    act_bytes = (m_rows * k + m_rows * n) * x.element_size()
    rec: dict = dict(bench="int4", device=str(dev), dtype=str(dense.dtype).removeprefix("torch."), M=m_rows, K=k,
                     N=n, group=layout.group_size)
    runs: dict[str, tuple[Callable[[], object] | None, int]] = {
        "bf16": (lambda: x @ dense, k * n * dense.element_size() + act_bytes)}
    for m in methods:
        w = prepared.get(m)
        runs[m] = ((lambda w=w: int4_mm(x, w)), int4_weight_bytes + act_bytes) if w is not None else (None, 0)
    for name, (fn, nbytes) in runs.items():
        if fn is None:  # the backend does not support this layout / dtype here
            rec[f"{name}_us"] = rec[f"{name}_GBps"] = None
            continue
        us = time_us(fn, sync, budget_s)
        rec[f"{name}_us"] = round(us, 2)
        rec[f"{name}_GBps"] = float(f"{nbytes / us / 1e3:.4g}")
        if not no_graph:
            gus = graph_time_us(fn, dev, budget_s)
            rec[f"{name}_graph_us"] = round(gus, 2) if gus is not None else None
    for name in runs:
        if name != "bf16" and rec.get(f"{name}_us"):
            rec[f"{name}_speedup_vs_bf16"] = round(rec["bf16_us"] / rec[f"{name}_us"], 3)
            if rec.get(f"{name}_graph_us") and rec.get("bf16_graph_us"):
                rec[f"{name}_graph_speedup_vs_bf16"] = round(rec["bf16_graph_us"] / rec[f"{name}_graph_us"], 3)
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=default_device(), help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and short timings (CI smoke test)")
    p.add_argument("--budget-ms", type=float, default=None,
                   help="timing budget per measurement (default 50; --quick: 0, i.e. one timed call)")
    p.add_argument("--no-graph", action="store_true", help="skip the graph-replay timings")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    cfg = QUICK if args.quick or dev.type == "cpu" else FULL
    budget_s = (args.budget_ms if args.budget_ms is not None else (0.0 if args.quick else 50.0)) / 1e3
    dtype = torch.bfloat16
    native = f"native_{dev.type}"
    methods = ["triton"] if triton_usable(dev) else []
    if native in INT4_BACKENDS:
        methods.append(native)
    if "triton" not in methods:
        print(f"# triton not usable on {dev} (CPU: set TRITON_INTERPRET=1): no triton columns", file=sys.stderr)

    for k, n in cfg["shapes"]:
        layout = Int4Layout(group_size=GROUP, zero_offset=1, in_features=k, out_features=n)
        qweight, qzeros, scales = (t.to(dev) for t in random_checkpoint(k, n, seed=k + n))
        dense = prepare_int4(qweight, qzeros, scales, layout, "reference", dtype=dtype).weight  # [K, N] bf16
        prepared = {m: prepare_int4(qweight, qzeros, scales, layout, m, dtype=dtype)  # type: ignore[arg-type]
                    for m in methods if native_supported(m, layout, dtype)}  # type: ignore[arg-type]
        int4_weight_bytes = k * n // 2 + scales.numel() * scales.element_size() + qzeros.numel() * 4
        for m_rows in cfg["ms"]:
            rec = run_case(dev, m_rows, layout, dense, prepared, methods, int4_weight_bytes, budget_s, args.no_graph)
            print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
