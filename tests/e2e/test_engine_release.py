"""A closed engine holds nothing once its last reference is gone: benchmarks build engines one after another in one
process (benchmarks.bench_e2e.release), and each new one sizes its KV cache from the free device memory, so a
module-level cache or registry that kept a runner alive would shrink or break the next engine (an fp8 engine after
a bf16 one ran out of memory on an 80 GB card while the old one was still referenced)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from benchmarks.bench_e2e import engine_config, release
from engine import LLMEngine, SamplingParams

DEMO = Path(__file__).resolve().parents[2] / "demo"


def test_closed_engine_with_adapters_is_collected() -> None:
    adapters = [str(DEMO / "adapters" / n) for n in ("reverse", "upper")]
    with LLMEngine(engine_config(str(DEMO / "model"), adapters, 4, "cpu")) as e:
        outs = e.generate(["abc", "xyz"], SamplingParams(max_tokens=3, temperature=0.0), ["a0", "a1"])
        assert len(outs) == 2
        engine, runner, model = weakref.ref(e), weakref.ref(e.runner), weakref.ref(e.runner.model)
    del e, outs
    release("cpu")
    assert engine() is None and runner() is None and model() is None, [
        type(r).__name__ for r in gc.get_referrers(*(x for x in (runner(), model()) if x is not None))]
