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
import os
import pstats
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_e2e import emit, engine_config, model_args, requests, time_decode, write_model
from benchmarks.timing import device_sync, time_us
from engine import LLMEngine, SamplingParams
from engine.forward_context import forward_context

BUDGET_S = 0.05
"""Timing budget of each part measured alone."""


def profile(path: str, adapters: list[str], batch: int, new_tokens: int, device: torch.device, top: int) -> None:
    sync = device_sync(device)
    prompts, names = requests(batch, len(adapters))
    with LLMEngine(engine_config(path, adapters, batch, device.type)) as e:
        step = time_decode(e, prompts, new_tokens, names)
        r = e.runner
        row = {"part": "step", "batch": batch, "adapters": len(adapters), **step}
        h = torch.randn(batch, r.model.model.norm.weight.numel(), dtype=r.dtype, device=device)
        if r.graphs is not None:  # a decode graph ends with the lm_head and the greedy argmax
            size = next(s for s in r.graphs.sizes if s >= batch)
            graph, _, info = r.graphs.graphs[(size, bool(adapters))]
            row["graph_replay_ms"] = time_us(graph.replay, sync, BUDGET_S) / 1e3
        logits = r.model.compute_logits(h)
        row["lm_head_ms"] = time_us(lambda: r.model.compute_logits(h), sync, BUDGET_S) / 1e3
        params = [SamplingParams(temperature=0.0)] * batch
        row["sampler_ms"] = time_us(lambda: r.sampler(logits.float(), params, [None] * batch), sync, BUDGET_S) / 1e3
        parts = ("graph_replay_ms",) if r.graphs is not None else ("lm_head_ms", "sampler_ms")
        row["rest_ms"] = step["ms_per_step"] - sum(row.get(k, 0.0) for k in parts)
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
    model_args(ap, [1, 32], [0], "/tmp/xpulora-profile")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    device, _, _, path, adapters = write_model(a)
    for b in a.batches:
        for n in a.adapters:
            if n <= b:
                profile(path, adapters[:n], b, a.new_tokens, device, a.top)


if __name__ == "__main__":
    main()
