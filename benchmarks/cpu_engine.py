"""The offline engine's CPU time per token on the bench_vs_vllm workload (16 prompts x 32 tokens, the base model
and four rank-8 adapters round-robin), one torch thread as the engine core has on a 2-core host, per --dtype and
--lora-dtype: what the engine core's step costs without the server around it (benchmarks/cpu_split.py measures it
through the server).

    python benchmarks/cpu_engine.py --dtypes float32 bfloat16 --lora-dtypes auto bfloat16
    python benchmarks/cpu_engine.py --quick       # the demo model and its adapters, a smoke run

One JSON line per (dtype, lora dtype): microseconds per token of each case, min and median over --rounds rounds;
every engine is built first and each round runs all of them in turn, so that they share the machine's load (on a
shared 2-core host a run's figures move by tens of percent with it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import SamplingParams
from tests.helpers import make_lora_engine

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="/tmp/bvv", help="bench_vs_vllm's cache dir (checkpoint and adapters)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--lora-dtypes", nargs="+", default=["auto"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="the demo model and adapters, 2 rounds of 4 tokens")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.quick:
        model = str(REPO / "demo" / "model")
        adapters = {n: str(REPO / "demo" / "adapters" / n) for n in ("reverse", "upper", "sort")}
        rounds, tokens, max_rank = 2, 4, 64  # the demo adapters' ranks: 8, 16, 64
    else:
        from benchmarks.bench_vs_vllm import build

        model, adapters = build(Path(a.root))
        rounds, tokens, max_rank = a.rounds, 32, 8  # as bench_vs_vllm serves them
    names = list(adapters)
    prompts = [[5 + i, 17, 42, 9, 100, 3, 77, 8, 9, 10] for i in range(16)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    cases: dict[str, list[str | None]] = {"base": [None] * 16, "adapters": [names[i % len(names)] for i in range(16)]}
    engines = {(dtype, lora_dtype): make_lora_engine(model, adapters, max_loras=len(names), max_lora_rank=max_rank,
                                                     max_model_len=512, max_num_seqs=16, lora_dtype=lora_dtype,
                                                     dtype=dtype, device="cpu")
               for dtype in a.dtypes for lora_dtype in a.lora_dtypes}
    times: dict[tuple[str, str, str], list[float]] = {(*k, c): [] for k in engines for c in cases}
    for i in range(rounds + 1):  # round 0 warms up; each round runs every engine and case once, in turn
        for key, engine in engines.items():
            for case, lora in cases.items():
                t0 = time.perf_counter()
                out = engine.generate(prompts, params, lora_names=lora)
                dt = time.perf_counter() - t0
                if sum(len(r.token_ids) for r in out) != 16 * tokens:
                    raise SystemExit(f"{key} {case}: a request ended early or failed: {[r.error for r in out]}")
                if i:
                    times[(*key, case)].append(dt)
    for (dtype, lora_dtype), engine in engines.items():
        row: dict[str, object] = {"dtype": dtype, "lora_dtype": lora_dtype, "slots": str(engine.runner.lora_dtype)}
        for case in cases:
            t = sorted(times[(dtype, lora_dtype, case)])
            row[f"{case}_us_per_token"] = {"min": round(1e6 * t[0] / (16 * tokens), 1),
                                           "median": round(1e6 * t[len(t) // 2] / (16 * tokens), 1)}
        engine.shutdown()
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
