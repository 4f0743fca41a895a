"""Why the int4 decode kernels stop at ~1.3-1.8 TB/s: one launch of each, for Nsight Compute (issue 18).

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section LaunchStats --section MemoryWorkloadAnalysis --csv --page details \
        python benchmarks/ncu_int4.py > ncu.csv

Each case warms up (Triton compiles, cuBLAS picks its kernel), then runs once between cudaProfilerStart and
cudaProfilerStop, so ncu records exactly the kernels of that one call (ncu flushes the caches before each
kernel by default, so weights come from HBM). The cases, in order, are printed to stderr as JSON lines:
the plain copy of the int4 bytes (the bandwidth a streaming kernel gets on this size), bf16 F.linear, torch's
native int4 op and the mma kernel (its rule's launch shape, and with the zero points folded) at M = 1 and 16.
Every int4 output is compared with the dense reference first (exit 1 on a mismatch), as bench_int4 does.
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

from benchmarks.bench_int4 import GROUP, Checker, random_checkpoint
from kernels.int4 import Int4Layout, int4_mm, mma_config, prepare_int4
from kernels.reference import dequant_int4


def profiled(name: str, fn: Callable[[], object], meta: dict) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    print(json.dumps({"case": name, **meta}), file=sys.stderr, flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="4096x24576,4096x6144", help="KxN,... layer shapes")
    p.add_argument("--ms", type=int, nargs="*", default=[1, 16])
    a = p.parse_args()
    dev, dtype, checker = torch.device("cuda"), torch.bfloat16, Checker()
    for shape in a.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        layout = Int4Layout(group_size=GROUP, zero_offset=1, in_features=k, out_features=n)
        ck = tuple(t.to(dev) for t in random_checkpoint(k, n, seed=k + n))
        ref_w = dequant_int4(*ck, GROUP, 1, dtype=torch.float32)
        dense = ref_w.t().to(dtype).contiguous()
        src = torch.empty(k * n // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        profiled("copy int4 bytes", lambda d=dst, s=src: d.copy_(s), dict(K=k, N=n, bytes=src.numel()))
        native = prepare_int4(*ck, layout, "native_cuda", dtype=dtype)
        mma = prepare_int4(*ck, layout, "triton_mma", dtype=dtype)
        for m in a.ms:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = x.float() @ ref_w
            meta = dict(K=k, N=n, M=m)
            profiled("bf16", lambda x=x, d=dense: torch.nn.functional.linear(x, d), meta)
            rule = mma_config(m, k, n, GROUP)
            cases = {"native": native, "mma rule": replace(mma, config=rule),
                     "mma fold": replace(mma, config=replace(rule, fold=True)),
                     "mma rule st4": replace(mma, config=replace(rule, num_stages=4))}
            for name, w in cases.items():
                if checker.check(f"{name} K{k} N{n} M{m}", int4_mm(x, w), ref):
                    profiled(name, lambda x=x, w=w: int4_mm(x, w), {**meta, "config": str(w.config)})
    print(json.dumps({"checked": checker.checked, "failures": checker.failures}), file=sys.stderr)
    return 1 if checker.failures else 0


if __name__ == "__main__":
    sys.exit(main())
