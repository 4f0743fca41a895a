"""Where the engine loop's time goes on bench_serve's request plan (arrivals, prefill beside decodes), with
async scheduling on and off on the same engine: per step kind (decode graph, mixed-step graphs, eager) the
host time of the launch, the wait for the sampled ids and the rest of the core step, then a cProfile top-N of
each mode. One JSON line per (mode, kind), then the profiles as text.

    python benchmarks/profile_plan.py --layers 36 --adapters 32 --batch 32 --requests 128
    python benchmarks/profile_plan.py --quick
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
import traceback
import warnings
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_e2e import emit, engine_config, model_args, write_model
from benchmarks.bench_serve import offline, plan
from engine import LLMEngine
from engine.sampler import StepFuture

_RESULT = StepFuture.result


def instrument(e: LLMEngine) -> dict[str, list[float]]:
    """Wrap the runner's launch and the futures' wait; returns the per-kind timing lists they fill."""
    times: dict[str, list[float]] = defaultdict(list)
    runner = e.runner
    launch = runner.launch

    def timed_launch(step, loads=()):  # type: ignore[no-untyped-def]
        graphs, mixed = runner.graphs, runner.mixed
        kind = ("decode_graph" if graphs is not None and graphs.can_run(step) else
                "mixed_graph" if mixed is not None and mixed.can_run(step) else "eager")
        t0 = time.perf_counter()
        fut = launch(step, loads)
        times[f"{kind}:launch_ms"].append(1e3 * (time.perf_counter() - t0))
        times[f"{kind}:tokens"].append(step.num_tokens)
        fut.kind = kind  # type: ignore[attr-defined]
        return fut

    result = StepFuture.result

    def timed_result(self: StepFuture):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = result(self)
        times[f"{getattr(self, 'kind', '?')}:wait_ms"].append(1e3 * (time.perf_counter() - t0))
        return out

    runner.launch = timed_launch  # type: ignore[method-assign]
    StepFuture.result = timed_result  # type: ignore[method-assign]
    core_step = e.core_step

    def timed_step():  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = core_step()
        times["core_step_ms"].append(1e3 * (time.perf_counter() - t0))
        return out

    e.core_step = timed_step  # type: ignore[method-assign]
    return times


def count_syncs(e: LLMEngine, reqs: list, batch: int) -> dict[str, object]:
    """Every implicit host-device synchronization torch makes while the plan runs, by the engine line that
    made it (the explicit wait for each step's ids is not one of them)."""
    found: dict[str, int] = defaultdict(int)

    def record(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: object = None,
               line: str | None = None) -> None:
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1] if "/engine/" in f.filename or "/kernels/" in f.filename]
        found[" <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}:{f.name}" for f in ours[-3:][::-1])
              if ours else filename] += 1

    t0 = time.perf_counter()
    with warnings.catch_warnings(), e.device.sync_debug():
        warnings.simplefilter("always")
        warnings.showwarning = record
        row = offline(e, reqs, batch)
    return {"steps": row["offline_steps"], "seconds": time.perf_counter() - t0, "syncs": dict(found)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(ap, [32], [32], "/tmp/xpulora-profile-plan")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--top", type=int, default=22)
    a = ap.parse_args()
    device, s, _, path, adapters = write_model(a)
    if a.quick:
        a.requests, a.new_tokens, a.batch = 16, 8, 4
    n = max(a.adapters)
    reqs = plan(a.requests, n, a.new_tokens, min(s.vocab, 1000))
    profiles = {}
    with LLMEngine(engine_config(path, adapters[:n], a.batch, device.type)) as e:
        offline(e, reqs[: n + 1], a.batch)  # every adapter into its slot
        default = e.async_scheduling
        for mode in (True, False) if default else (False,):
            e.async_scheduling = mode
            offline(e, reqs[: 2 * a.batch], a.batch)  # warm in this mode
            times = instrument(e)
            prof = cProfile.Profile()
            prof.enable()
            row = offline(e, reqs, a.batch)
            prof.disable()
            del e.core_step, e.runner.launch  # back to the classes' methods
            StepFuture.result = _RESULT  # type: ignore[method-assign]
            emit(case="plan", async_scheduling=mode, **row,
                 core_step_ms_mean=sum(times["core_step_ms"]) / max(1, len(times["core_step_ms"])))
            for kind in ("decode_graph", "mixed_graph", "eager"):
                launches = times.get(f"{kind}:launch_ms", [])
                if not launches:
                    continue
                waits = times.get(f"{kind}:wait_ms", [])
                emit(case="kind", async_scheduling=mode, kind=kind, steps=len(launches),
                     tokens_mean=sum(times[f"{kind}:tokens"]) / len(launches),
                     launch_ms_mean=sum(launches) / len(launches), launch_ms_max=max(launches),
                     wait_ms_mean=sum(waits) / max(1, len(waits)), wait_ms_max=max(waits, default=0.0))
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(a.top)
            profiles[mode] = buf.getvalue()
        if default:  # where the host still waits for the device in async steps (CUDA's sync debug mode)
            e.async_scheduling = True
            emit(case="implicit_syncs", **count_syncs(e, reqs[: 2 * a.batch], a.batch))
        e.async_scheduling = default
    for mode, text in profiles.items():
        print(f"===== cProfile, async_scheduling={mode}, by tottime =====")
        print("\n".join(line for line in text.splitlines() if line.strip())[:6000])


if __name__ == "__main__":
    main()
