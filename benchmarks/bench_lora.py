"""Batched multi-LoRA (issue 6 (b)): Triton shrink+expand vs the torch reference vs a per-adapter loop.

    python benchmarks/bench_lora.py                  # Qwen3-8B-shaped layers on the default device
    python benchmarks/bench_lora.py --quick --device cpu   # tiny shapes, seconds (CI smoke test;
                                                            # TRITON_INTERPRET=1 adds the triton column)

One JSON line per case (layer, tokens, distinct adapters, rank). All times in microseconds per call of
one wrapped layer (all its slices):
  triton_us        kernels.lora_triton.add_lora (2 launches), the step's token grouping prepared once outside,
                   B in the engine's layout [slots, n, r_max] (r contiguous)
  triton_graph_us  the same replayed from a captured device graph (no Python launch cost), where supported
  triton_rm_us, triton_rm_graph_us   the same with B stored rank-major ([slots, r_max, n] storage, passed
                   as its transposed view): a small rank's padding is then never read
  prepare_us       engine.lora.punica.group_tokens from the host slot list (once per step, shared by
                   every layer)
  reference_us     engine.lora.punica.ReferenceLoRABatch.add_lora: per slot, boolean gathers, fp32 matmuls
  loop_us          per adapter and slice: y[rows, slice] += (x[rows] @ A[:r].T) @ B[:, :r].T in the layer
                   dtype, with each adapter's row indices precomputed on the device (a naive engine)
  loop_graph_us    the loop replayed from a captured graph
  base_us          the layer's dense x @ W in the layer dtype (what the LoRA work rides on)
and ratios loop_over_triton, reference_over_triton, triton_over_base (eager), *_graph likewise.
Buffers are engine-shaped: 64 slots (max_loras), r_max 64 (max_lora_rank), each adapter's true rank
`rank`; tokens are dealt round-robin to the adapters (every token has one: the worst case). Repeated
calls keep small adapter sets in L2, so times for 1-8 adapters are optimistic for a real decode step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import default_device, device_sync, graph_time_us, time_us
from engine.lora.punica import ReferenceLoRABatch, SlotRanks, group_tokens
from kernels import lora_triton, triton_env

# Qwen3-8B: hidden 4096, 32 q heads / 8 kv heads of 128, intermediate 12288.
FULL = dict(
    layers={"qkv": (4096, [4096, 1024, 1024]), "gate_up": (4096, [12288, 12288]), "down": (12288, [4096])},
    tokens=[64, 1024], adapters=[1, 8, 32, 64], ranks=[8, 16, 64], slots=64, r_max=64)
QUICK = dict(
    layers={"qkv": (64, [64, 16, 16]), "gate_up": (64, [96, 96]), "down": (96, [64])},
    tokens=[8], adapters=[1, 4], ranks=[16], slots=4, r_max=64)


def run_case(dev: torch.device, dtype: torch.dtype, layer: str, k: int, sizes: list[int], tokens: int,
             adapters: int, rank: int, slots: int, r_max: int, budget_s: float, use_triton: bool) -> dict:
    g = torch.Generator(device="cpu").manual_seed(tokens * 1000 + adapters * 10 + rank)
    lora_a = [(torch.randn(slots, r_max, k, generator=g) / k ** 0.5).to(dev, dtype) for _ in sizes]
    lora_b = [(torch.randn(slots, n, r_max, generator=g) / r_max ** 0.5).to(dev, dtype) for n in sizes]
    ranks = [[rank] * slots for _ in sizes]
    rt = torch.tensor(ranks, dtype=torch.int32, device=dev)
    slot_ids = [(i % adapters) * (slots // adapters) for i in range(tokens)]  # spread over the slot range
    token_slots = torch.tensor(slot_ids, dtype=torch.long, device=dev)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    x = torch.randn(tokens, k, generator=g).to(dev, dtype)
    y = torch.zeros(tokens, sum(sizes), device=dev, dtype=dtype)
    w = (torch.randn(k, sum(sizes), generator=g) / k ** 0.5).to(dev, dtype)
    sync = device_sync(dev)
    rec: dict = dict(bench="lora", device=str(dev), dtype=str(dtype).removeprefix("torch."), layer=layer, k=k,
                     n=sizes, tokens=tokens, adapters=adapters, rank=rank, r_max=r_max, slots=slots)

    rec["base_us"] = time_us(lambda: x @ w, sync, budget_s)

    for key in ("triton_us", "triton_graph_us", "triton_rm_us", "triton_rm_graph_us", "prepare_us"):
        rec[key] = None
    if use_triton:
        rec["prepare_us"] = time_us(lambda: group_tokens(slot_ids, slots, device=dev), sync, budget_s)
        info = group_tokens(slot_ids, slots, device=dev)
        lora_b_rm = [b.transpose(1, 2).contiguous().transpose(1, 2) for b in lora_b]
        for tag, bs in (("", lora_b), ("_rm", lora_b_rm)):

            def tri(bs: list[torch.Tensor] = bs) -> None:
                lora_triton.add_lora(y, x, lora_a, bs, info, offsets, rt)

            rec[f"triton{tag}_us"] = time_us(tri, sync, budget_s)
            rec[f"triton{tag}_graph_us"] = graph_time_us(tri, dev, budget_s)

    ref_batch = ReferenceLoRABatch.build(slot_ids, slots, dev)
    rec["reference_us"] = time_us(lambda: ref_batch.add_lora(y, x, lora_a, lora_b, SlotRanks(ranks, rt), offsets),
                                  sync, budget_s)

    groups = [(s, (token_slots == s).nonzero().flatten()) for s in sorted(set(slot_ids))]

    def loop() -> None:
        for s, rows in groups:
            xs = x[rows]
            for a, b, off in zip(lora_a, lora_b, offsets):
                n = b.size(1)
                y[rows, off:off + n] += (xs @ a[s, :rank].t()) @ b[s, :, :rank].t()

    rec["loop_us"] = time_us(loop, sync, budget_s)
    rec["loop_graph_us"] = graph_time_us(loop, dev, budget_s)

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    rec["loop_over_triton"] = ratio(rec["loop_us"], rec["triton_us"])
    rec["reference_over_triton"] = ratio(rec["reference_us"], rec["triton_us"])
    rec["triton_over_base"] = ratio(rec["triton_us"], rec["base_us"])
    rec["loop_over_triton_graph"] = ratio(rec["loop_graph_us"], rec["triton_graph_us"])
    rec["triton_graph_over_base"] = ratio(rec["triton_graph_us"], rec["base_us"])
    rec["triton_rm_graph_over_base"] = ratio(rec["triton_rm_graph_us"], rec["base_us"])
    rec["loop_over_triton_rm_graph"] = ratio(rec["loop_graph_us"], rec["triton_rm_graph_us"])
    for key, val in rec.items():
        if key.endswith("_us") and val is not None:
            rec[key] = round(val, 2)
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=default_device(), help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and short timings (CI smoke test)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--layers", default=None, help="comma-separated subset of qkv,gate_up,down")
    p.add_argument("--budget-ms", type=float, default=None,
                   help="timing budget per measurement (default 50; --quick: 0, i.e. one timed call)")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    cfg = QUICK if args.quick or dev.type == "cpu" else FULL
    budget_s = (args.budget_ms if args.budget_ms is not None else (0.0 if args.quick else 50.0)) / 1e3
    use_triton = triton_env.usable_on(dev.type)
    if not use_triton:
        print(f"# triton not usable on {dev} (CPU: set TRITON_INTERPRET=1): no triton columns", file=sys.stderr)
    layers = args.layers.split(",") if args.layers else list(cfg["layers"])
    for layer in layers:
        k, sizes = cfg["layers"][layer]
        for tokens in cfg["tokens"]:
            for adapters in cfg["adapters"]:
                for rank in cfg["ranks"]:
                    rec = run_case(dev, dtype, layer, k, sizes, tokens, adapters, rank, cfg["slots"], cfg["r_max"],
                                   budget_s, use_triton)
                    print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
