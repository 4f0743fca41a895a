"""Where a decode step's time goes, on a Qwen3-8B-shaped random int4 checkpoint (AutoRound layout).

For each batch size: the engine's whole step (`LLMEngine.step`), the captured decode graph replayed alone,
the lm_head, the sampler, and the rest (scheduling, input staging, Python), then the device kernels of
one eager decode forward grouped by name (torch.profiler), and the host functions that cost most per step
(cProfile). One JSON line per part.

    python benchmarks/profile_step.py --layers 36 --batches 1 32      # on a GPU
    python benchmarks/profile_step.py --layers 8 --batches 32 --adapters 0 1 32   # the cost of adapters
    python benchmarks/profile_step.py --quick                         # tiny shapes on the CPU (smoke test)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_e2e import time_decode, write_adapter
from benchmarks.timing import device_sync
from engine import CacheConfig, EngineConfig, LLMEngine, LoRAConfig, ModelConfig, SamplingParams, SchedulerConfig
from engine.forward_context import forward_context
from tools.random_int4 import QWEN3_8B, Shape, write_random_int4


def emit(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def mean_ms(fn: object, sync: object, iters: int) -> float:
    fn()  # type: ignore[operator]
    sync()  # type: ignore[operator]
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()  # type: ignore[operator]
    sync()  # type: ignore[operator]
    return 1e3 * (time.perf_counter() - t0) / iters


def profile(path: str, adapters: list[str], batch: int, new_tokens: int, device: torch.device, top: int) -> None:
    lora = LoRAConfig(enable_lora=True, max_loras=len(adapters), max_lora_rank=16,
                      lora_modules=tuple((f"a{i}", p) for i, p in enumerate(adapters))) if adapters else LoRAConfig()
    cfg = EngineConfig(ModelConfig(path, dtype="bfloat16" if device.type != "cpu" else "float32", max_model_len=512),
                       cache=CacheConfig(num_blocks=None if device.type == "cpu" else 4096),
                       scheduler=SchedulerConfig(max_num_seqs=batch), lora=lora)
    sync = device_sync(device)
    names = [f"a{i % len(adapters)}" if adapters else None for i in range(batch)]
    with LLMEngine(cfg) as e:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 400, (32,), generator=g).tolist() for _ in range(batch)]
        step = time_decode(e, prompts, new_tokens, names)
        r = e.runner
        row = {"part": "step", "batch": batch, "adapters": len(adapters), **step}
        if r.graphs is not None:
            size = next(s for s in r.graphs.sizes if s >= batch)
            graph, out, info = r.graphs.graphs[(size, bool(adapters))]
            row["graph_replay_ms"] = mean_ms(graph.replay, sync, 50)
            h = out[:batch]
        else:
            h = torch.randn(batch, r.model.model.norm.weight.numel(), dtype=r.dtype, device=device)
        logits = r.model.compute_logits(h)
        row["lm_head_ms"] = mean_ms(lambda: r.model.compute_logits(h), sync, 50)
        params = [SamplingParams(temperature=0.0)] * batch
        row["sampler_ms"] = mean_ms(lambda: r.sampler(logits.float(), params, [None] * batch), sync, 50)
        row["rest_ms"] = step["ms_per_step"] - sum(row.get(k, 0.0) for k in ("graph_replay_ms", "lm_head_ms",
                                                                             "sampler_ms"))
        emit(**row)

        # Host side of whole steps (kernel launches are asynchronous; the sampler's copy-out waits).
        for i, p in enumerate(prompts):
            e.add_request(f"p{i}", p, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True), names[i])
        e.step()
        prof = cProfile.Profile()
        prof.enable()
        n = 0
        while e.has_unfinished():
            e.step()
            n += 1
        prof.disable()
        stats = pstats.Stats(prof)
        rows = sorted(((v[2] / n * 1e3, v[3] / n * 1e3, f"{os.path.basename(k[0])}:{k[1]}:{k[2]}")
                       for k, v in stats.stats.items()), reverse=True)  # type: ignore[attr-defined]
        emit(part="host", batch=batch, adapters=len(adapters), steps=n,
             top_self_ms_per_step=[[round(a, 4), round(b, 4), f] for a, b, f in rows[:top]])

        if r.graphs is None or device.type == "cpu":
            return
        # Device kernels of one eager decode forward, on the inputs of the graph's last replay.
        ctx = r.graphs._context(size, info)
        with torch.inference_mode(), forward_context(ctx):
            r.model(r.graphs.input_ids[:size], r.graphs.positions[:size])
            sync()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                r.model(r.graphs.input_ids[:size], r.graphs.positions[:size])
                sync()
        total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for ev in p.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                t = total[ev.name[:90]]
                t[0] += ev.device_time
                t[1] += 1
        kernels = sorted(total.items(), key=lambda kv: -kv[1][0])
        emit(part="kernels", batch=batch, adapters=len(adapters), total_us=round(sum(v[0] for _, v in kernels), 1),
             top=[[name, round(us, 1), int(c)] for name, (us, c) in kernels[:top]])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--adapters", type=int, nargs="*", default=[0], help="distinct rank-16 adapters on all projections")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, CPU smoke test")
    ap.add_argument("--root", default="/tmp/xpulora-profile")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    s = Shape(256, 768, 2, 4, 2, 64, 1024) if a.quick else QWEN3_8B
    layers = 2 if a.quick else a.layers
    if a.quick:
        a.batches, a.new_tokens, a.adapters = [1, 4], 4, [0, 2]
    path = write_random_int4(f"{a.root}/model", s, layers=layers, device=device)
    paths = [write_adapter(f"{a.root}/lora{i}", s, layers, 16, i) for i in range(max(a.adapters))]
    for b in a.batches:
        for n in a.adapters:
            if n <= b:
                profile(path, paths[:n], b, a.new_tokens, device, a.top)


if __name__ == "__main__":
    main()
