"""engine.gc_pauses: collections are timed and counted per generation; freezing leaves full collections
nothing old to walk."""

from __future__ import annotations

import gc

from engine.gc_pauses import PROCESS, GcPauses, freeze_startup_heap


def test_counts_and_times_each_generation() -> None:
    p = GcPauses().install()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        p.uninstall()
    assert p.collections[0] >= 1 and p.collections[2] == 2
    assert p.seconds[2] > 0 and p.total_seconds >= p.seconds[2]
    gc.collect(2)  # after uninstall: not counted
    assert p.collections[2] == 2


def test_install_twice_counts_once() -> None:
    p = GcPauses().install().install()
    try:
        gc.collect(2)
    finally:
        p.uninstall()
    assert p.collections[2] == 1 and p._on_gc not in gc.callbacks


def test_freeze_moves_survivors_out_of_full_collections() -> None:
    keep = [[i] for i in range(20_000)]  # tracked objects alive across the freeze
    try:
        frozen = freeze_startup_heap()
        # A frozen object still dies by reference count (another thread's temporaries, in a full test run):
        # the count may only fall a little after the freeze.
        assert frozen >= len(keep) and frozen - 100 <= gc.get_freeze_count() <= frozen
        assert PROCESS.frozen_objects == frozen  # kept: the per-step stats must not walk the frozen list again
        tracked = len(gc.get_objects(generation=2))
        assert tracked < frozen  # the permanent generation is not what a full collection walks
    finally:
        gc.unfreeze()  # the test process's heap goes back to normal collection


def test_adapter_loaded_before_the_freeze_is_freed_on_unload() -> None:
    """The engine core freezes its heap with the start-up adapters (--lora-modules) in it: unloading one must
    still free it (by reference count: a frozen object in a cycle would never be collected)."""
    import weakref
    from pathlib import Path

    from engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
    from engine.config import LoRAConfig

    demo = Path(__file__).resolve().parents[2] / "demo"
    cfg = EngineConfig(ModelConfig(str(demo / "model"), dtype="float32", max_model_len=256),
                       lora=LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=16,
                                       lora_modules=(("upper", str(demo / "adapters" / "upper")),)))
    with LLMEngine(cfg) as e:
        e.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0), ["upper"])  # in a slot too
        assert e.lora is not None
        aid = e.lora.resolve("upper")
        assert aid is not None
        ref = weakref.ref(e.lora._host[aid])
        try:
            freeze_startup_heap()
            e.unload_lora_adapter("upper")
            assert ref() is None, "the unloaded adapter is still alive"
        finally:
            gc.unfreeze()
