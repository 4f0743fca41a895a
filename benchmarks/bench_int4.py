"""int4 weight-only GEMM (W4A16) vs bf16, side by side, on Qwen3-8B and Qwen3.6-27B layer shapes (issue 18).

    python benchmarks/bench_int4.py                  # the table below, on the default device (one H200: ~3-4 min)
    python benchmarks/bench_int4.py --quick --device cpu   # tiny shapes, seconds (CI smoke test;
                                                            # TRITON_INTERPRET=1 adds the Triton columns)
    python benchmarks/bench_int4.py --sweep          # launch configs of the split-K Triton kernel (kernels.int4_triton)

For each (K x N, M), every method's graph-replayed time per call in µs and its bandwidth (bytes of weights,
scales and zeros, plus activations in and out, over the time), one JSON line each:
  bf16       F.linear(x, W) with the dense bf16 weight [N, K] (the peer)
  native     torch's int4 op for the device (kernels.int4 native_<device>; not timed above 64 rows: its time
             grows about linearly with M, 10-25x bf16 there)
  triton     the split-K W4A16 kernel on the checkpoint layout (kernels.int4_triton), its rule's launch shape (this
             and mma: not timed above 256 rows, where the tuned dispatch does not consider them)
  mma        the W4A16 kernel on the repacked layout (kernels.int4_mma): a small sweep of launch shapes, each
             timed and checked; `mma_us` is the best, `mma_sweep` all of them
  cuda       the CUDA C tensor-core kernel on its repacked layout (kernels.int4_cuda, CUDA only, up to 64 rows):
             every compiled launch shape, each timed and checked; `cuda_us` the best, `cuda_sweep` all of them
  dequant    one fused Triton dequantization into a transient bf16 weight, then the bf16 GEMM
  best       the fastest int4 method at this M: what the tuned dispatch (kernels.int4_tune) serves
Each call reads the next of several weight copies (256 MB or more in all), so weights come from HBM, not from
the 50 MB L2. Weights are random int4 in the AutoRound/GPTQ-v1 layout, group 128, symmetric zero points (the
AutoRound default), negative scales. Before timing, every int4 method and launch shape is compared with
kernels.reference on the first copy (bf16 tolerance); any mismatch is printed and the exit status is 1.
Then a table of ratios to bf16 with PASS/FAIL per target row (M <= 16: best >= 2.5x faster; M = 32, 64: >= 1.5x;
M = 1024: best <= 1.2x bf16 time), and the tuned dispatch's own table for two shapes (its timer, its buckets).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import default_device, device_sync, graph_time_us, time_us
from kernels import triton_env
from kernels.int4 import (
    INT4_BACKENDS,
    GemvConfig,
    Int4Layout,
    MmaConfig,
    PreparedInt4,
    TritonInt4Config,
    dequant_mm,
    gemv_config,
    int4_mm,
    mma_config,
    native_supported,
    prepare_int4,
    triton_config,
    triton_mm,
)
from kernels.int4_cuda import CUDA_MAX_ROWS, CudaMmaConfig
from kernels.int4_cuda import cuda_config as cuda_rule
from kernels.int4_cuda import variants as cuda_variants
from kernels.int4_gemv import GEMV_MAX_ROWS
from kernels.int4_tune import _gemv_variants
from kernels.reference import dequant_int4, pack_int4_cols, pack_int4_rows

SHAPES_8B = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)]
SHAPES_27B = [(5120, 24 * 256 * 2 + 2 * 4 * 256), (6144, 5120), (5120, 2 * 17408), (17408, 5120)]
"""Qwen3.6-27B at TP=1: q (with its gate) / k / v fused, o, gate_up fused, down."""
FULL = dict(shapes=SHAPES_8B + SHAPES_27B, ms=[1, 4, 8, 16, 32, 64, 256, 1024])
QUICK = dict(shapes=[(256, 384), (512, 256)], ms=[1, 16])
GROUP = 128
NATIVE_MAX_M = 64
KERNEL_MAX_M = 256
"""The memory-bound Triton kernels (mma, triton) are not timed above this, where the tuner does not time them either."""
TOL = (1.6e-2, 1e-2)
"""bf16 (rtol, atol relative to max|ref|), as tests/kernels/test_int4.py."""


def random_checkpoint(k: int, n: int, seed: int, sym: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    qweight = pack_int4_rows(torch.randint(0, 16, (k, n), generator=g))
    z = torch.full((k // GROUP, n), 7) if sym else torch.randint(6, 10, (k // GROUP, n), generator=g)
    qzeros = pack_int4_cols(z)
    sign = torch.where(torch.rand(k // GROUP, n, generator=g) < 0.5, -1.0, 1.0)
    scales = ((torch.rand(k // GROUP, n, generator=g) * 0.01 + 0.005) * sign).to(torch.float16)
    return qweight, qzeros, scales


def copies_for(nbytes: int, rotate_mb: float) -> int:
    return max(1, min(64, int(rotate_mb * 2**20 // max(nbytes, 1)) + 1)) if rotate_mb > 0 else 1


def over(fn: Callable[[object], object], items: list) -> Callable[[], None]:
    """One timed call: fn on each weight copy in turn."""
    def call() -> None:
        for it in items:
            fn(it)
    return call


def per_call(fn: Callable[[object], object], items: list, dev: torch.device, budget_s: float) -> float:
    """µs of fn on one weight copy: graph-replayed where the device has graphs."""
    call = over(fn, items)
    return (graph_time_us(call, dev, budget_s, reps=2) or time_us(call, device_sync(dev), budget_s)) / len(items)


def mma_sweep(m: int, k: int, n: int) -> list[MmaConfig]:
    """The rule's launch shape and neighbours (the tuner's candidates and a few more)."""
    from kernels.int4_tune import _mma_variants

    base = mma_config(m, k, n, GROUP)
    extra = [replace(base, block_n=128, num_warps=8), replace(base, num_stages=2),
             replace(base, block_n=32, split_k=base.split_k * 2)]
    if m > 64:
        extra.append(replace(base, block_t=128, block_n=64, num_warps=4))
    return list(dict.fromkeys(c for c in [*_mma_variants(m, k, n, GROUP, fold=True), *extra]
                              if c.fits(m, k, n, GROUP)))


def cfg_name(c: MmaConfig | TritonInt4Config | GemvConfig | CudaMmaConfig) -> str:
    if isinstance(c, CudaMmaConfig):
        return f"w{c.warps} u{c.unroll} n{c.tiles}" + (f" k{c.splits}" if c.splits > 1 else "")
    if isinstance(c, GemvConfig):
        pf = "" if c.prefetch else " noprefetch"
        return f"{c.block_n}x{c.block_kw} s{c.split_k} w{c.num_warps} st{c.num_stages}{pf}"
    a = (c.block_n, c.block_t, c.block_k) if isinstance(c, MmaConfig) else (c.block_m, c.block_n, c.block_k)
    fold = " fold" if isinstance(c, MmaConfig) and c.fold else ""
    return f"{a[0]}x{a[1]}x{a[2]} s{c.split_k} w{c.num_warps} st{c.num_stages}{fold}"


class Checker:
    """Every int4 method's output on the first weight copy vs kernels.reference (dense fp32 weight)."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.checked = 0

    def check(self, what: str, y: torch.Tensor, ref: torch.Tensor) -> bool:
        self.checked += 1
        r = ref.float()
        err = (y.float() - r).abs()
        bound = TOL[1] * max(float(r.abs().max()), 1e-6) + TOL[0] * r.abs()
        if bool(torch.isfinite(y.float()).all()) and bool((err <= bound).all()):
            return True
        self.failures.append(f"{what}: max abs error {float(err.max()):.4g} (ref scale {float(r.abs().max()):.4g})")
        print(f"# MISMATCH {self.failures[-1]}", file=sys.stderr, flush=True)
        return False


def run_shape(dev: torch.device, k: int, n: int, ms: list[int], methods: list[str], budget_s: float,
              rotate_mb: float, checker: Checker) -> list[dict]:
    dtype = torch.bfloat16
    layout = Int4Layout(group_size=GROUP, zero_offset=1, in_features=k, out_features=n)
    ckpts = [tuple(t.to(dev) for t in random_checkpoint(k, n, seed=k + n + i))
             for i in range(copies_for(k * n // 2, rotate_mb))]
    dense_t = [dequant_int4(*c, GROUP, 1, dtype=dtype).t().contiguous()  # [N, K] bf16 for F.linear
               for c in ckpts[:copies_for(k * n * 2, rotate_mb)]]
    ref_w = dequant_int4(*ckpts[0], GROUP, 1, dtype=torch.float32)  # [K, N]
    prepared: dict[str, list[PreparedInt4]] = {}
    for meth in methods:
        backend = {"native": f"native_{dev.type}", "dequant": "triton", "mma": "triton_mma",
                   "gemv": "triton_gemv", "cuda": "cuda_mma"}.get(meth, meth)
        if native_supported(backend, layout, dtype):  # type: ignore[arg-type]
            prepared[meth] = [prepare_int4(*c, layout, backend, dtype=dtype) for c in ckpts]  # type: ignore[arg-type]
    w_bytes = k * n // 2 + ckpts[0][2].numel() * 2 + ckpts[0][1].numel() * 4

    def case(m: int) -> dict:
        x = torch.randn(m, k, device=dev, dtype=dtype)
        ref = x.float() @ ref_w
        act = (m * k + m * n) * 2
        rec: dict = dict(bench="int4", device=str(dev), M=m, K=k, N=n, group=GROUP, copies=len(ckpts))
        bf16_us = per_call(lambda d: torch.nn.functional.linear(x, d), dense_t, dev, budget_s)
        rec.update(bf16_us=round(bf16_us, 2), bf16_GBps=round((k * n * 2 + act) / bf16_us / 1e3, 1))
        timed: dict[str, float] = {}

        def time_it(name: str, fn: Callable[[object], object], ws: list, key: str = "",
                    rec: dict = rec, m: int = m) -> float | None:
            if not checker.check(f"{name} K{k} N{n} M{m}", fn(ws[0]), ref):  # type: ignore[arg-type]
                return None
            us = per_call(fn, ws, dev, budget_s)
            if key:
                rec[f"{key}_us"], rec[f"{key}_GBps"] = round(us, 2), round((w_bytes + act) / us / 1e3, 1)
            return us

        for meth, ws in prepared.items():
            if meth == "native" and m > NATIVE_MAX_M:
                rec["native_us"] = None
                continue
            if meth in ("mma", "triton") and m > KERNEL_MAX_M:
                continue
            if meth in ("mma", "gemv", "cuda"):
                if (meth == "gemv" and m > GEMV_MAX_ROWS) or (meth == "cuda" and m > CUDA_MAX_ROWS):
                    continue
                sweep = {}
                configs: list = (mma_sweep(m, k, n) if meth == "mma" else _gemv_variants(k, n, GROUP)
                                 if meth == "gemv" else cuda_variants(m, k, n))
                for c in configs:
                    us = time_it(f"{meth}[{cfg_name(c)}]", lambda w, c=c: int4_mm(x, replace(w, config=c)), ws)
                    if us is not None:
                        sweep[cfg_name(c)] = round(us, 2)
                rec[f"{meth}_sweep"] = dict(sorted(sweep.items(), key=lambda t: t[1]))
                rule_cfg = (mma_config(m, k, n, GROUP) if meth == "mma" else gemv_config(m, k, n, GROUP)
                            if meth == "gemv" else cuda_rule(m, k, n))
                rule = cfg_name(rule_cfg) if rule_cfg is not None else "-"
                rec[f"{meth}_rule"], rec[f"{meth}_rule_us"] = rule, sweep.get(rule)
                if sweep:
                    best = min(sweep.values())
                    rec[f"{meth}_best"], rec[f"{meth}_us"] = min(sweep, key=sweep.__getitem__), best
                    rec[f"{meth}_GBps"] = round((w_bytes + act) / best / 1e3, 1)
                    timed[meth] = best
                continue
            if meth == "dequant":
                fn: Callable[[object], object] = lambda w: dequant_mm(x, w.weight, w.zeros, w.scales, GROUP, 1)
            elif meth == "triton":
                rec["triton_rule"] = cfg_name(triton_config(m, k, n, GROUP))
                fn = lambda w: triton_mm(x, w, None)
            else:
                fn = lambda w: int4_mm(x, w)
            us = time_it(meth, fn, ws, key=meth)
            if us is not None:
                timed[meth] = us
        for meth, us in timed.items():
            rec[f"{meth}_speedup_vs_bf16"] = round(bf16_us / us, 3)
        if timed:
            best = min(timed, key=timed.__getitem__)
            rec.update(best=best, best_us=round(timed[best], 2), best_speedup_vs_bf16=round(bf16_us / timed[best], 3))
        return rec

    out = []
    for m in ms:
        out.append(case(m))
        print(json.dumps(out[-1]), flush=True)
    return out


def target(m: int) -> tuple[str, Callable[[float], bool]] | None:
    """The issue's target for a row count, as (text, test of bf16_us / best_us)."""
    if m <= 16:
        return ">= 2.5x faster", lambda r: r >= 2.5
    if m in (32, 64):
        return ">= 1.5x faster", lambda r: r >= 1.5
    if m == 1024:
        return "<= 1.2x bf16 time", lambda r: 1 / r <= 1.2
    return None


def print_table(recs: list[dict]) -> tuple[int, int]:
    cols = ["native", "triton", "mma", "gemv", "cuda", "dequant"]
    print(f"\n{'K x N':>13} {'M':>5} {'bf16':>8} " + " ".join(f"{c:>8}" for c in cols)
          + f" {'best':>8} {'best/bf16':>10}  target")
    passed = total = 0
    for r in recs:
        cells = " ".join(f"{r.get(f'{c}_us'):>8}" if r.get(f"{c}_us") is not None else f"{'-':>8}" for c in cols)
        ratio = r.get("best_speedup_vs_bf16")
        t = target(r["M"])
        verdict = ""
        if t is not None and ratio is not None:
            ok = t[1](ratio)
            passed, total = passed + ok, total + 1
            verdict = f"{'PASS' if ok else 'FAIL'} ({t[0]})"
        shown = f"{ratio:.2f}x" if ratio is not None else "-"
        print(f"{r['K']:>6}x{r['N']:<6} {r['M']:>5} {r['bf16_us']:>8} {cells} {r.get('best', '-'):>8} {shown:>10}  "
              f"{verdict}")
    return passed, total


def tuner_tables(dev: torch.device, shapes: list[tuple[int, int]]) -> None:
    """The tuned dispatch as the engine runs it (its timer: engine.device's graph replays) on a few shapes."""
    from kernels.int4_tune import Shape, measure

    backends = [f"native_{dev.type}", "cuda_mma", "triton_gemv", "triton_mma", "triton", "dequant"]
    try:
        from engine.device import Device  # the engine package needs its wheels (tools/device_wheels.sh)

        timer = Device(dev.type, dev.index or 0).time_calls  # type: ignore[arg-type]
        how = "engine.device graph replays"
    except ImportError as e:
        def timer(calls: list) -> float:
            return per_call(lambda c: c(), calls, dev, 0.005)
        how = f"this script's graph timer (engine not importable: {e})"
    for k, n in shapes:
        lay = Int4Layout(GROUP, 1, k, n)
        runs = [b for b in backends
                if native_supported("triton" if b == "dequant" else b, lay, torch.bfloat16)]  # type: ignore[arg-type]
        table = measure(Shape(lay, torch.bfloat16, sym=True), runs, timer, dev)
        print(json.dumps({"tuner": f"{k}x{n}", "timer": how, "table": table.describe(),
                          "timings": {m: dict(t[:4]) for m, t in table.timings}}), flush=True)


def sweep(dev: torch.device, shapes: list[tuple[int, int]], ms: list[int], budget_s: float, rotate_mb: float) -> None:
    """Graph-replayed time of launch configs of the split-K Triton kernel (kernels.int4_triton)."""
    configs = [TritonInt4Config(0, bn, bk, split, warps, stages) for bn, bk in ((64, 128), (128, 64))
               for split in (1, 2, 4, 8) for warps, stages in ((4, 3), (4, 5), (8, 4))]
    for k, n in shapes:
        layout = Int4Layout(group_size=GROUP, zero_offset=1, in_features=k, out_features=n)
        ws = [prepare_int4(*(t.to(dev) for t in random_checkpoint(k, n, seed=i)), layout, "triton",
                           dtype=torch.bfloat16) for i in range(copies_for(k * n // 2, rotate_mb))]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            chosen = triton_config(m, k, n, GROUP)
            cand = [replace(c, block_m=chosen.block_m) for c in configs if k % (c.block_k * c.split_k) == 0]
            times = {c: per_call(lambda w, c=c, x=x: triton_mm(x, w, None, c), ws, dev, budget_s)
                     for c in {chosen, *cand}}
            best = sorted(times.items(), key=lambda t: t[1])[:5]
            print(json.dumps({"sweep": "int4 triton", "M": m, "K": k, "N": n, "heuristic_us": round(times[chosen], 2),
                              "heuristic": cfg_name(chosen),
                              "best": [{"us": round(t, 2), "config": cfg_name(c)} for c, t in best]}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=default_device(), help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and short timings (CI smoke test)")
    p.add_argument("--budget-ms", type=float, default=None,
                   help="timing budget per measurement (default 5; --quick: 0, i.e. one timed call)")
    p.add_argument("--rotate-mb", type=float, default=256.0,
                   help="cycle through copies of the weights totalling at least this much (0: one copy)")
    p.add_argument("--shapes", default="all", choices=("all", "8b", "27b"), help="which model's layer shapes")
    p.add_argument("--ms", type=int, nargs="*", default=None, help="row counts (default 1 4 8 16 32 64 256 1024)")
    p.add_argument("--no-tuner", action="store_true", help="skip the tuned dispatch's own tables")
    p.add_argument("--sweep", action="store_true", help="time launch configs of the split-K Triton kernel")
    p.add_argument("--sweep-ms", type=int, nargs="*", default=[16, 32, 64], help="rows to sweep")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    quick = args.quick or dev.type == "cpu"
    if quick:
        args.rotate_mb = 0.0
    cfg = QUICK if quick else FULL
    shapes = cfg["shapes"] if quick else {"all": FULL["shapes"], "8b": SHAPES_8B, "27b": SHAPES_27B}[args.shapes]
    budget_s = (args.budget_ms if args.budget_ms is not None else (0.0 if args.quick else 5.0)) / 1e3
    if args.sweep:
        sweep(dev, shapes, args.sweep_ms if not args.quick else [1], budget_s, args.rotate_mb)
        return 0
    methods = []
    if f"native_{dev.type}" in INT4_BACKENDS:
        methods.append("native")
    if triton_env.usable_on(dev.type):
        methods += ["triton", "mma", "gemv", "dequant"]
    if dev.type == "cuda":
        methods.append("cuda")
    else:
        print(f"# triton not usable on {dev} (CPU: set TRITON_INTERPRET=1): no triton columns", file=sys.stderr)
    checker = Checker()
    recs = []
    for k, n in shapes:
        recs += run_shape(dev, k, n, args.ms or cfg["ms"], methods, budget_s, args.rotate_mb, checker)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    passed, total = print_table(recs)
    print(f"\nint4 targets: {passed}/{total} rows PASS")
    if not quick and not args.no_tuner and "mma" in methods:
        tuner_tables(dev, [shapes[0], shapes[-1]])
    if checker.failures:
        print(f"int4 correctness: FAIL ({len(checker.failures)} of {checker.checked} outputs differ from the "
              "reference)")
        for f in checker.failures:
            print(f"  {f}")
        return 1
    print(f"int4 correctness: PASS ({checker.checked} outputs equal the reference within bf16 tolerance)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
