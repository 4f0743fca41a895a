"""What a prompt costs the decode step it joins: B - 1 sequences decoding with adapters, and each step one new
request of P prompt tokens (max_tokens 1, so its row lives one step), as a server under steady arrivals runs.
For each P: the engine loop's ms per step (LLMEngine.step, graphs and async scheduling as configured), the
share of those steps that held a prompt chunk, and the device kernels of a few of those steps grouped by name
(torch.profiler; kernels inside replayed graphs included), per step. P = 0 is the pure decode step of B - 1
rows. Each P gets B - 1 fresh decoding requests, prefilled before its clock, so every P is timed at the same
context lengths.

    python benchmarks/bench_mixed.py --layers 36 --adapters 32 --batches 64 --prompts 0 16 32 64 128
    python benchmarks/bench_mixed.py --quick          # tiny shapes on the CPU (smoke test)
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_e2e import emit, engine_config, model_args, release, requests, write_model
from benchmarks.timing import profile_by_name, top
from engine import LLMEngine, SamplingParams

STEPS, PROFILED = 40, 8


def steps_with_arrivals(e: LLMEngine, n: int, prompt_len: int, names: list[str | None], rng: random.Random,
                        vocab: int, serial: itertools.count) -> float:
    """Run n steps, adding one P-token request before each (P = 0: none); seconds over the n steps."""
    e.device.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        if prompt_len:
            i = next(serial)
            e.add_request(f"x{i}", [rng.randrange(vocab) for _ in range(prompt_len)],
                          SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), names[i % len(names)])
        e.step()
    e.device.synchronize()
    return time.perf_counter() - t0


def kernels_per_step(e: LLMEngine, prompt_len: int, names: list[str | None], rng: random.Random, vocab: int,
                     serial: itertools.count, top_n: int) -> tuple[float, list[tuple[str, float]]]:
    """Device microseconds per step in total and of the top kernels by name, over PROFILED steps."""
    device, _ = profile_by_name(lambda: steps_with_arrivals(e, PROFILED, prompt_len, names, rng, vocab, serial),
                                e.device.torch_device)
    return sum(device.values()) / PROFILED, top(device, top_n, PROFILED)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(ap, [64], [32], "/tmp/xpulora-mixed")
    ap.add_argument("--prompts", type=int, nargs="+", default=[0, 16, 32, 64, 128])
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    device, s, _, path, adapters = write_model(a)
    if a.quick:
        a.batches, a.prompts = [4], [0, 8]
    n = max(a.adapters)
    steps = 4 if a.quick else STEPS
    for b in a.batches:
        with LLMEngine(engine_config(path, adapters[:n], b, device.type)) as e:
            prompts, names = requests(b - 1, n)
            rng, serial = random.Random(b), itertools.count(1)
            budget = 512 - max(map(len, prompts)) - 2  # max_model_len 512 (bench_e2e.engine_config)
            arrivals = names or [None]
            for plen in a.prompts:
                # Fresh decoding requests for each P, so that every P is timed at the same context lengths (the
                # decode attention grows with them); their prefill runs before the clock.
                ids = [f"d{plen}.{i}" for i in range(b - 1)]
                for rid, p, name in zip(ids, prompts, names):
                    e.add_request(rid, p, SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True), name)
                while any(not e.requests[rid].seq.output_token_ids for rid in ids):
                    e.step()
                # warm this size (its graphs' first replays, Triton variants), then time it
                steps_with_arrivals(e, 3, plen, arrivals, rng, s.vocab, serial)
                m0, n0 = e.steps.mixed, e.steps.steps
                dt = steps_with_arrivals(e, steps, plen, arrivals, rng, s.vocab, serial)
                mixed = (e.steps.mixed - m0) / max(1, e.steps.steps - n0)
                total, kernels = kernels_per_step(e, plen, arrivals, rng, s.vocab, serial, a.top)
                emit(case="mixed", batch=b, decoding=b - 1, prompt=plen, adapters=n, ms_per_step=1e3 * dt / steps,
                     mixed_share=round(mixed, 3),
                     device_us_per_step=round(total, 1), top_kernels=kernels)
                if not all(rid in e.requests for rid in ids):
                    raise SystemExit("the decoding requests ran out of tokens: fewer STEPS")
                for rid in ids:
                    e.abort(rid)
                while e.has_unfinished():
                    e.step()
        del e
        release(device)


if __name__ == "__main__":
    main()
