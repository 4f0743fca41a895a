"""The opening burst: c requests reach an idle engine at once (bench_serve's prompts: 16-64 random tokens, the
adapters in turn), as bench_serve's plan opens. Each request asks for one token, so its end is its first token.
Per (step budget, c): ms until the first and the last request have their token, the steps the burst took
(tokens and ms of each), and the device kernels and host ops of one more burst grouped by name (torch.profiler,
kernels inside replayed graphs included; host ops by self time: launches, allocator, copies). The prefix cache is
off: every burst computes its prompts.

    python benchmarks/bench_burst.py --layers 36 --adapters 32 --batches 32 64 --budgets 0   # the default (2048)
    python benchmarks/bench_burst.py --layers 36 --adapters 32 --batches 32 64 --budgets 0 --max-mixed-graph-tokens 512
    python benchmarks/bench_burst.py --quick          # tiny shapes on the CPU (smoke test)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_e2e import emit, engine_config, model_args, release, write_model
from benchmarks.timing import profile_by_name, top
from engine import LLMEngine, SamplingParams


def burst(e: LLMEngine, c: int, names: list[str | None], vocab: int, seed: int) -> dict:
    """Add c one-token requests at once and step until all have ended; times from the first add."""
    rng = random.Random(seed)
    e.device.synchronize()
    t0 = time.perf_counter()
    for i in range(c):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(16, 64))]
        e.add_request(f"b{seed}.{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                      names[i % len(names)])
    firsts: list[float] = []
    steps: list[tuple[int, float]] = []
    while e.has_unfinished():
        n0, t = e.steps.tokens, time.perf_counter()
        out = e.step()
        now = time.perf_counter()
        steps.append((e.steps.tokens - n0, round(1e3 * (now - t), 2)))
        firsts += [now - t0 for o in out if o.new_token_ids]
    if len(firsts) != c:
        raise SystemExit(f"burst of {c}: {len(firsts)} first tokens")
    return {"first_ms": round(1e3 * min(firsts), 2), "last_ms": round(1e3 * max(firsts), 2),
            "p50_ms": round(1e3 * sorted(firsts)[c // 2], 2), "steps": steps}


def kernels(e: LLMEngine, c: int, names: list[str | None], vocab: int, seed: int, top_n: int) -> dict:
    """Device microseconds of one burst in total and of its top kernels by name; its host ops the same."""
    device, host = profile_by_name(lambda: burst(e, c, names, vocab, seed), e.device.torch_device)
    return {"device_us": round(sum(device.values()), 1), "top_kernels": top(device, top_n),
            "host_op_us": round(sum(host.values()), 1), "top_host_ops": top(host, top_n)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(ap, [32, 64], [32], "/tmp/xpulora-burst")
    ap.add_argument("--budgets", type=int, nargs="+", default=[0],
                    help="max_num_batched_tokens of each engine (0: the engine's default)")
    ap.add_argument("--max-mixed-graph-tokens", type=int, default=None,
                    help="EngineConfig.max_mixed_graph_tokens (default: the engine's)")
    ap.add_argument("--repeats", type=int, default=3, help="timed bursts per (budget, c); the last is reported")
    ap.add_argument("--top", type=int, default=14)
    a = ap.parse_args()
    device, s, _, path, adapters = write_model(a)
    if a.quick:
        a.batches, a.budgets, a.repeats = [4], [64], 2
    n = max(a.adapters)
    names: list[str | None] = [*(f"a{i}" for i in range(n)), None]  # every adapter, then the base model
    for budget in a.budgets:
        cfg = engine_config(path, adapters[:n], max(a.batches), device.type)
        cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler,
                                                                    max_num_batched_tokens=budget or None),
                                  cache=dataclasses.replace(cfg.cache, enable_prefix_caching=False))
        if a.max_mixed_graph_tokens is not None:
            cfg = dataclasses.replace(cfg, max_mixed_graph_tokens=a.max_mixed_graph_tokens)
        with LLMEngine(cfg) as e:
            for c in a.batches:
                burst(e, c, names, s.vocab, 1000 + c)  # warm: this size's graphs and Triton variants
                # Repeats with prompts of their own: a step's cost that persists is the path's, not a first
                # call's (a Triton specialization of a new token count, say).
                runs = [burst(e, c, names, s.vocab, 2000 + 100 * r + c) for r in range(a.repeats)]
                mixed = e.runner.mixed
                largest = mixed.sizes[-1] if mixed is not None else None
                del mixed  # the graphs' memory goes with the engine (release below)
                emit(case="burst", budget=e.config.scheduler.max_num_batched_tokens, concurrency=c,
                     largest_mixed_graph=largest, adapters=n,
                     lora_config=os.environ.get("XPULORA_LORA_CONFIG", ""), **runs[-1],
                     earlier_runs=runs[:-1], **kernels(e, c, names, s.vocab, 3000 + c, a.top))
        del e
        release(device)


if __name__ == "__main__":
    main()
