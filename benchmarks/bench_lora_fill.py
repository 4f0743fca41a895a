"""Adapter slot fills (issue 14): one adapter copied into a device slot of every wrapped layer.

    python benchmarks/bench_lora_fill.py                 # 36 Qwen3-8B-shaped layers, rank 16, default device
    python benchmarks/bench_lora_fill.py --quick         # 4 tiny layers (CI smoke test)

Wrappers are built directly on stub base layers (no weights: a fill touches only the LoRA buffers), all
seven projections per layer (qkv, o, gate_up, down: four wrappers). One JSON line per path:
  per_slice  what set_slot did before the packed fills: per slice, zero the slot, copy A and B from the
             adapter's float32 host tensors (pageable), set each rank with a scalar store
  packed     engine.lora.slots.SlotFiller.fill of the adapter packed once (pinned on GPUs): one host->device
             copy per staging window and multi-tensor device copies (the engine's path)
Fields: host_ms (how long the call keeps the host, mean of --reps), done_ms (until the device has finished,
measured after a synchronize), busy_host_ms (host time of the same call issued while the device runs a
--busy-ms spin kernel: a fill that waits for the device takes about busy_ms here), ops (data-writing
torch ops per fill, counted by a dispatch mode), pack_ms (making the packed form, once per adapter while it
stays in the host cache), and the per_slice / packed ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import default_device, device_sync
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.lora.adapter import LoRAModule
from engine.lora.layers import BaseLayerWithLoRA, ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA
from engine.lora.slots import SlotFiller
from tools.op_count import CountWrites


class _NoWeights:
    """A linear method with no storage: the wrappers only read the base layer's geometry and device."""

    input_multiple = 1

    def __init__(self, device: torch.device) -> None:
        self.dev = device

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        layer.register_parameter("weight", nn.Parameter(torch.empty(0, device=self.dev), requires_grad=False))

    def device(self, layer: nn.Module) -> torch.device:
        return self.dev


def build(layers: int, hidden: int, heads: int, kv_heads: int, inter: int, slots: int, r_max: int,
          dtype: torch.dtype, dev: torch.device) -> tuple[list[BaseLayerWithLoRA], dict[str, tuple[int, int]]]:
    ws: list[BaseLayerWithLoRA] = []
    shapes: dict[str, tuple[int, int]] = {}
    hd = hidden // heads
    for i in range(layers):
        p = f"model.layers.{i}"
        m = _NoWeights(dev)
        parts = [
            (QKVParallelLinear(hidden, hd, heads, kv_heads, method=m, prefix=f"{p}.self_attn.qkv_proj"),
             {f"{p}.self_attn.q_proj": heads * hd, f"{p}.self_attn.k_proj": kv_heads * hd,
              f"{p}.self_attn.v_proj": kv_heads * hd}, hidden),
            (RowParallelLinear(heads * hd, hidden, method=m, prefix=f"{p}.self_attn.o_proj"),
             {f"{p}.self_attn.o_proj": hidden}, heads * hd),
            (MergedColumnParallelLinear(hidden, [inter, inter], method=m, prefix=f"{p}.mlp.gate_up_proj"),
             {f"{p}.mlp.gate_proj": inter, f"{p}.mlp.up_proj": inter}, hidden),
            (RowParallelLinear(inter, hidden, method=m, prefix=f"{p}.mlp.down_proj"),
             {f"{p}.mlp.down_proj": hidden}, inter),
        ]
        for base, outs, k in parts:
            cls = RowParallelLinearWithLoRA if isinstance(base, RowParallelLinear) else ColumnParallelLinearWithLoRA
            ws.append(cls(base, list(outs), slots, r_max, dtype))
            shapes.update({n: (k, o) for n, o in outs.items()})
    return ws, shapes


def adapter(shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> dict[str, LoRAModule]:
    g = torch.Generator().manual_seed(seed)
    return {n: LoRAModule(torch.randn(rank, k, generator=g) * 0.01, torch.randn(o, rank, generator=g) * 0.01, rank)
            for n, (k, o) in shapes.items()}


def per_slice_fill(ws: list[BaseLayerWithLoRA], slot: int, modules: dict[str, LoRAModule]) -> None:
    """The fill before the packed form (set_slot then): per slice, from the float32 host tensors."""
    for w in ws:
        for i in range(len(w.module_names)):
            w.lora_a[i][slot].zero_()
            w.lora_b[i][slot].zero_()
        w.ranks_dev[:, slot] = 0
        w.a_ranks_dev[:, slot] = 0
        for i, name in enumerate(w.module_names):
            m = modules[name]
            a, b = w.shard_a(i, m.a), w.shard_b(i, m.b)
            w.lora_a[i][slot, :a.size(0)].copy_(a)
            w.lora_b[i][slot, :, :m.rank].copy_(b)
            w.ranks_dev[i, slot] = m.rank
            w.a_ranks_dev[i, slot] = a.size(0)


def busy(dev: torch.device, ms: float) -> None:
    """Keep the device busy for about `ms` (queued, returns at once)."""
    if dev.type == "cuda":
        torch.cuda._sleep(int(ms * 2e6))  # cycles at ~2 GHz; busy_ms reports the real length
        return
    if dev.type != "cpu":
        a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
        for _ in range(max(1, int(ms / 0.15))):  # ~0.15 ms per 4096^3 bf16 matmul on a large GPU
            a = a @ a * 1e-3


def measure(fn, dev: torch.device, reps: int, busy_ms: float) -> dict:
    sync = device_sync(dev)
    fn()
    sync()
    host, done = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        sync()
        done.append(time.perf_counter() - t0)
    rec = dict(host_ms=round(sum(host) / reps * 1e3, 3), done_ms=round(sum(done) / reps * 1e3, 3))
    if dev.type != "cpu" and busy_ms > 0:
        busy(dev, busy_ms)
        t0 = time.perf_counter()
        fn()
        rec["busy_host_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        sync()
        t0 = time.perf_counter()
        busy(dev, busy_ms)
        sync()
        rec["busy_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    with CountWrites() as c:
        fn()
    sync()
    rec["ops"] = dict(c.ops)
    rec["num_ops"] = sum(c.ops.values())
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=default_device())
    p.add_argument("--quick", action="store_true", help="4 tiny layers, 2 reps (CI smoke test)")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--r-max", type=int, default=16, help="max_lora_rank (bench_e2e uses 16)")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--busy-ms", type=float, default=50.0)
    p.add_argument("--paths", nargs="*", default=["per_slice", "packed"], choices=["per_slice", "packed"])
    args = p.parse_args(argv)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shape = dict(hidden=4096, heads=32, kv_heads=8, inter=12288)
    layers, reps = args.layers, args.reps
    if args.quick:
        shape, layers, reps = dict(hidden=64, heads=4, kv_heads=2, inter=96), 4, 2
    torch.manual_seed(0)
    with torch.inference_mode():
        ws, shapes = build(layers, **shape, slots=args.slots, r_max=args.r_max, dtype=dtype, dev=dev)
        mods = adapter(shapes, args.rank, 0)
        pins = dev.type != "cpu"
        filler = SlotFiller(ws, dev, pins_memory=pins)
        t0 = time.perf_counter()
        pack = filler.pack(mods)
        pack_ms = (time.perf_counter() - t0) * 1e3
        base = dict(bench="lora_fill", device=str(dev), dtype=args.dtype, layers=layers, wrappers=len(ws),
                    rank=args.rank, r_max=args.r_max, adapter_mb=round(pack.nbytes / 2**20, 1))
        recs = {}
        for path in args.paths:
            fn = (lambda: per_slice_fill(ws, 1, mods)) if path == "per_slice" else (lambda: filler.fill(1, pack))
            recs[path] = {**base, "path": path, **measure(fn, dev, reps, 0.0 if args.quick else args.busy_ms)}
            if path == "packed":
                before = filler.num_copy_ops
                filler.fill(1, pack)
                recs[path]["h2d_copies_per_fill"] = filler.num_copy_ops - before
                recs[path]["pack_ms"] = round(pack_ms, 1)
            print(json.dumps(recs[path]), flush=True)
        if len(recs) == 2:
            a, b = recs["per_slice"], recs["packed"]
            print(json.dumps({**base, "path": "ratio", **{f"per_slice_over_packed_{k}": round(a[k] / b[k], 1)
                                                           for k in ("host_ms", "done_ms", "num_ops") if b[k]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
