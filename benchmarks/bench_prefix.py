"""Prefix caching with many adapters: every request is a shared system prompt (2,000 tokens) plus a short
user part, for 32 random rank-8/16 adapters, many requests per adapter, on a random int4 checkpoint in the
AutoRound layout. Runs the same workload with the cache off and on (one engine each) and reports the prompt
tokens the model computed, time to first token and whether the outputs agree. One JSON line per case:

- `burst`: every request queued at once (adapter by adapter in turn); TTFT counted from the queueing.
- `single`: afterwards, one new request per adapter, each alone (the cache then holds every adapter's
  system prompt): TTFT without queueing.

    python benchmarks/bench_prefix.py --device cuda --layers 36    # on a GPU (Qwen3-8B shape, bf16)
    python benchmarks/bench_prefix.py                              # CPU, tiny shape, float32
    python benchmarks/bench_prefix.py --quick                      # CPU smoke run, a few seconds
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_e2e import emit, release, write_adapter
from engine import CacheConfig, EngineConfig, LLMEngine, LoRAConfig, ModelConfig, SamplingParams, SchedulerConfig
from engine.config import ParallelConfig
from engine.scheduler import SchedulerOutput
from tools.random_int4 import QWEN3_8B, Shape, write_random_int4

TINY = Shape(256, 768, 2, 4, 2, 64, 1024)


def workload(a: argparse.Namespace, round_: int) -> list[tuple[list[int], str]]:
    """(prompt ids, adapter) in queueing order: request j of every adapter, then request j + 1 ..."""
    system = [random.Random(0).randrange(3, 400) for _ in range(a.system_tokens)]
    rng = random.Random(1 + round_)
    return [(system + [rng.randrange(3, 400) for _ in range(a.user_tokens)], f"a{i}")
            for _ in range(a.requests_per_adapter if round_ == 0 else 1) for i in range(a.adapters)]


def engine_config(a: argparse.Namespace, path: str, adapters: list[str], caching: bool) -> EngineConfig:
    gpu = a.device != "cpu"
    return EngineConfig(
        ModelConfig(path, dtype="bfloat16" if gpu else "float32",
                    max_model_len=a.system_tokens + a.user_tokens + a.max_tokens + 16),
        # A fixed KV pool on GPUs (38 GB at the 8B shape): the cache-off engine's memory may not be back in
        # the driver's free count when the cache-on engine sizes itself from it.
        cache=CacheConfig(enable_prefix_caching=caching, num_blocks=16384 if gpu else None),
        parallel=ParallelConfig(device=a.device),
        scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens),
        lora=LoRAConfig(enable_lora=True, max_loras=min(len(adapters), a.max_loras), max_lora_rank=16,
                        lora_modules=tuple((f"a{i}", p) for i, p in enumerate(adapters))))


class Counter:
    """Wraps the executor to count the prompt tokens each step computes (cache hits are not computed)."""

    def __init__(self, e: LLMEngine) -> None:
        self.e, self.inner, self.prefill_tokens = e, e.executor.launch, 0
        e.executor.launch = self  # type: ignore[method-assign]

    def __call__(self, step: SchedulerOutput, loads: list) -> object:
        for s, seq in zip(step.seqs, self.e.scheduler.scheduled_sequences()):
            if s.start_pos < seq.num_prompt_tokens:
                self.prefill_tokens += len(s.token_ids)
        return self.inner(step, loads)


def run(e: LLMEngine, reqs: list[tuple[list[int], str]], params: SamplingParams, counter: Counter,
        alone: bool) -> tuple[dict, list[list[int]]]:
    """Queue the requests (all at once, or each alone) and run them; TTFT per request from its queueing."""
    before, hits = counter.prefill_tokens, e.blocks.num_hits
    ttft: list[float] = []
    tokens: list[list[int]] = []
    t_start = time.perf_counter()
    for group in ([[r] for r in reqs] if alone else [reqs]):
        queued: dict[str, float] = {}
        out: dict[str, list[int]] = {}
        for p, name in group:
            rid = f"r{len(tokens) + len(queued)}"
            e.add_request(rid, p, params, name)
            queued[rid] = time.perf_counter()
            out[rid] = []
        while e.has_unfinished():
            for o in e.step():  # an output is on the host when step() returns it: no extra device sync needed
                if not out[o.request_id] and o.new_token_ids:
                    ttft.append(time.perf_counter() - queued[o.request_id])
                out[o.request_id].extend(o.new_token_ids)
        tokens += list(out.values())
    wall = time.perf_counter() - t_start
    q = statistics.quantiles(ttft, n=10) if len(ttft) > 1 else ttft * 9
    return ({"requests": len(reqs), "prompt_tokens": sum(len(p) for p, _ in reqs),
             "prefill_tokens_computed": counter.prefill_tokens - before, "cached_tokens": e.blocks.num_hits - hits,
             "ttft_mean_ms": 1e3 * statistics.fmean(ttft), "ttft_p50_ms": 1e3 * statistics.median(ttft),
             "ttft_p90_ms": 1e3 * q[8], "wall_s": wall}, tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: small prompt, few adapters")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, xpu (engine device)")
    ap.add_argument("--layers", type=int, default=36, help="layers of the Qwen3-8B shape (GPU runs)")
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--requests-per-adapter", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--max-loras", type=int, default=32)
    ap.add_argument("--root", default="/tmp/xpulora-prefix")
    a = ap.parse_args()
    if a.quick:
        a.device, a.adapters, a.requests_per_adapter, a.system_tokens, a.max_tokens = "cpu", 4, 3, 256, 2
    gpu = a.device != "cpu"
    shape, layers = (QWEN3_8B, a.layers) if gpu else (TINY, 2)
    import torch

    path = write_random_int4(f"{a.root}/model", shape, layers=layers, device=torch.device(a.device))
    adapters = [write_adapter(f"{a.root}/lora{i}", shape, layers, (8, 16)[i % 2], i) for i in range(a.adapters)]
    emit(case="plan", device=a.device, layers=layers, hidden=shape.hidden, adapters=a.adapters,
         requests_per_adapter=a.requests_per_adapter, system_tokens=a.system_tokens, user_tokens=a.user_tokens)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    results: dict[str, dict[bool, tuple[dict, list[list[int]]]]] = {"burst": {}, "single": {}}
    for caching in (False, True):
        with LLMEngine(engine_config(a, path, adapters, caching)) as e:
            counter = Counter(e)
            # Warm-up at the workload's shapes (kernels, graphs, allocator) on other tokens, then a cold cache.
            rng = random.Random(99)
            warm = [[rng.randrange(3, 400) for _ in range(a.system_tokens + a.user_tokens)] for _ in range(4)]
            e.generate(warm, params, [f"a{i % a.adapters}" for i in range(4)])
            e.reset_prefix_cache()
            results["burst"][caching] = run(e, workload(a, 0), params, counter, alone=False)
            results["single"][caching] = run(e, workload(a, 1), params, counter, alone=True)
        del e, counter  # the counter wraps the engine's executor
        release(a.device)
    for case, by in results.items():
        (off, off_ids), (on, on_ids) = by[False], by[True]
        same = sum(x == y for x, y in zip(off_ids, on_ids)) / len(off_ids)
        emit(case=case, **{f"{k}_off": v for k, v in off.items() if k not in ("requests", "prompt_tokens")},
             **{f"{k}_on": v for k, v in on.items() if k not in ("requests", "prompt_tokens")},
             requests=on["requests"], prompt_tokens=on["prompt_tokens"],
             prefill_reduction=off["prefill_tokens_computed"] / max(1, on["prefill_tokens_computed"]),
             ttft_speedup=off["ttft_mean_ms"] / on["ttft_mean_ms"], same_tokens_fraction=same)


if __name__ == "__main__":
    main()
