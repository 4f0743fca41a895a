"""Where the LoRA kernels' decode time goes: one add_lora call (a K-split shrink launch, then an expand launch) per
Qwen3-8B wrapped layer, for Nsight Compute (issue 18: 32 rank-16 adapters at batch 32 add ~2.7x their bytes' time).

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section LaunchStats --section MemoryWorkloadAnalysis --csv --page details \
        python benchmarks/ncu_lora.py > ncu.csv

For each wrapped layer (qkv, o, gate_up, down) in the engine's buffer layout (benchmarks/bench_lora.Layer, bf16):
the plain copy of the bytes the call must read (the bandwidth a streaming kernel gets on that size), then add_lora
with the tokens dealt round-robin over each adapter count (default 32 and 1), once per variant (split; cols: the
column expand of kernels.lora_cols). Each case warms up, then runs once
between cudaProfilerStart and cudaProfilerStop; the cases, in order, are JSON lines on stderr. Every add_lora
result is first compared with the torch reference (engine.lora.punica.ReferenceLoRABatch): exit 1 on a mismatch.
`--quick --device cpu` (TRITON_INTERPRET=1): tiny shapes, float32, no profiler: the script's smoke test.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_lora import LAYERS, QUICK, Layer
from engine.lora.punica import ReferenceLoRABatch, SlotRanks, group_tokens
from kernels import lora_triton

RANK = 16


def profiled(name: str, fn: Callable[[], object], meta: dict, dev: torch.device) -> None:
    for _ in range(3):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(json.dumps({"case": name, **meta}), file=sys.stderr, flush=True)
    if dev.type != "cuda":  # the smoke test: the call runs, nothing records it
        fn()
        return
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes in float32 (CPU smoke test)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--adapters", type=int, nargs="*", default=[32, 1])
    p.add_argument("--variants", nargs="+", default=["split", "cols"], choices=["split", "cols"],
                   help="split, or the column expand (kernels.lora_cols)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    dtype = torch.float32 if a.quick else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    checked = failures = 0
    for name, (k, sizes) in (QUICK if a.quick else LAYERS).items():
        n = sum(sizes)
        for adapters in a.adapters:
            lay = Layer(k, sizes, adapters, RANK, RANK, dtype, False, dev, g)
            slot_ids = [t % adapters for t in range(a.tokens)]
            x = torch.randn(a.tokens, k, generator=g).to(dev, dtype)
            want = torch.zeros(a.tokens, n, device=dev, dtype=dtype)
            ReferenceLoRABatch.build(slot_ids, adapters, dev).add_lora(
                want, x, lay.a, lay.b, SlotRanks(lay.host, lay.ranks), lay.offsets)
            info = group_tokens(slot_ids, adapters, device=dev)
            meta = dict(layer=name, K=k, N=n, tokens=a.tokens, adapters=adapters, rank=RANK,
                        bytes=lay.bytes(adapters, a.tokens, want.element_size()))
            src = torch.empty(meta["bytes"] // 2, dtype=torch.uint8, device=dev)  # read + written: the same bytes
            dst = torch.empty_like(src)
            profiled("copy", lambda d=dst, s=src: d.copy_(s), meta, dev)
            for variant in a.variants:
                lora_triton.CONFIG_OVERRIDES["cols"] = 64 if variant == "cols" else 0
                y = torch.zeros_like(want)
                lora_triton.add_lora(y, x, lay.a, lay.b, info, lay.offsets, lay.ranks)
                err, scale = (y.float() - want.float()).abs().max().item(), want.float().abs().max().item()
                checked += 1
                if not err <= (1e-4 if dtype == torch.float32 else 2e-2) * scale:
                    failures += 1
                    print(json.dumps({"mismatch": name, "adapters": adapters, "variant": variant, "err": err,
                                      "scale": scale}), file=sys.stderr, flush=True)
                    continue
                profiled("add_lora", lambda y=y, x=x, lay=lay, info=info: lora_triton.add_lora(
                    y, x, lay.a, lay.b, info, lay.offsets, lay.ranks), {**meta, "variant": variant}, dev)
    print(json.dumps({"checked": checked, "failures": failures}), file=sys.stderr)
    return 1 if failures or not checked else 0


if __name__ == "__main__":
    sys.exit(main())
