"""The engine loop's host work on a tiny model: offline `LLMEngine` steps with N concurrent requests (prefill
and decode, as a server sees them), on the committed demo model (4-layer int4 Qwen3), on the base model and
with four random rank-8 adapters on all seven projections (requests spread over the adapters and the base).
On the CPU of a tiny model nearly all of a step is host work, so steps/s here is the loop's own speed.
One JSON line per case: steps/s, tokens/s, ms per step; then the cProfile top-N of the steps by own time.

    python benchmarks/profile_host.py                          # 16 requests x 32 tokens, base and 4 adapters
    python benchmarks/profile_host.py --requests 64 --top 30   # more rows
    python benchmarks/profile_host.py --quick                  # a smoke run
    python benchmarks/profile_host.py --adapters 0 --demo-adapters   # the demo's own adapters too (ranks 8, 16
                                                               # and 64 at max rank 64, requests over them and the base)
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_e2e import emit, release, write_adapter
from engine import EngineConfig, LLMEngine, LoRAConfig, ModelConfig, ParallelConfig, SamplingParams, SchedulerConfig
from tools.random_int4 import Shape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "demo", "model")
DEMO_SHAPE = Shape(256, 768, 4, 4, 2, 64, 448)
"""The demo model's shapes (demo/model/config.json), for the random adapters."""


DEMO_ADAPTERS = os.path.join(ROOT, "demo", "adapters")


def config(adapters: list[str], max_seqs: int, device: str, max_rank: int = 8) -> EngineConfig:
    lora = LoRAConfig(enable_lora=True, max_loras=len(adapters), max_lora_rank=max_rank,
                      lora_modules=tuple((f"a{i}", p) for i, p in enumerate(adapters))) if adapters else LoRAConfig()
    return EngineConfig(ModelConfig(DEMO, max_model_len=512), scheduler=SchedulerConfig(max_num_seqs=max_seqs),
                        lora=lora, parallel=ParallelConfig(device=device))  # type: ignore[arg-type]


def run(e: LLMEngine, n: int, new_tokens: int, n_adapters: int, seed: int) -> tuple[int, int]:
    """n requests (24-40-token prompts, greedy, ignore_eos) added at once; returns (steps, tokens)."""
    g = torch.Generator().manual_seed(seed)
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        prompt = torch.randint(0, 390, (int(torch.randint(24, 41, (1,), generator=g)),), generator=g).tolist()
        e.add_request(f"r{seed}-{i}", prompt, sp, f"a{i % (n_adapters + 1)}" if i % (n_adapters + 1) < n_adapters
                      else None)
    steps = tokens = 0
    while e.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in e.step())
        steps += 1
    return steps, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--adapters", type=int, nargs="*", default=[0, 4])
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per case (the best is reported)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--demo-adapters", action="store_true",
                    help="also the demo's adapters (reverse r8, upper r16, sort r64; max_lora_rank 64)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--root", default="/tmp/xpulora-profile-host")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.requests, a.new_tokens, a.repeats, a.top = 4, 4, 1, 5
    paths = [write_adapter(f"{a.root}/lora{i}", DEMO_SHAPE, DEMO_SHAPE.layers, 8, i)
             for i in range(max(a.adapters, default=0))]
    demo = [os.path.join(DEMO_ADAPTERS, n) for n in ("reverse", "upper", "sort")]
    cases = [(paths[:n], 8, "random rank 8") for n in a.adapters] + ([(demo, 64, "demo")] if a.demo_adapters else [])
    for adapters, max_rank, kind in cases:
        n_ad = len(adapters)
        with LLMEngine(config(adapters, a.requests, a.device, max_rank)) as e:
            run(e, a.requests, a.new_tokens, n_ad, seed=100)  # warm-up
            best = None
            for r in range(a.repeats):
                e.device.synchronize()
                t0 = time.perf_counter()
                steps, tokens = run(e, a.requests, a.new_tokens, n_ad, seed=r)
                e.device.synchronize()
                dt = time.perf_counter() - t0
                if best is None or dt < best[0]:
                    best = (dt, steps, tokens)
            assert best is not None
            dt, steps, tokens = best
            emit(case="loop", requests=a.requests, new_tokens=a.new_tokens, adapters=n_ad, lora=kind, steps=steps,
                 steps_per_s=round(steps / dt, 1), tokens_per_s=round(tokens / dt, 1),
                 ms_per_step=round(1e3 * dt / steps, 3))
            prof = cProfile.Profile()
            prof.enable()
            steps, _ = run(e, a.requests, a.new_tokens, n_ad, seed=999)
            prof.disable()
            stats = pstats.Stats(prof)
            rows = sorted(((v[2] / steps * 1e3, v[3] / steps * 1e3, f"{os.path.basename(k[0])}:{k[1]}:{k[2]}")
                           for k, v in stats.stats.items()), reverse=True)  # type: ignore[attr-defined]
            emit(case="host", adapters=n_ad, steps=steps,
                 top_self_ms_per_step=[[round(s, 4), round(c, 4), f] for s, c, f in rows[:a.top]])
        del e
        release(a.device)


if __name__ == "__main__":
    main()
