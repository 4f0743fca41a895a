"""An adapter's slot-ready packed form is made when it enters the host cache (the manager's prepare hook,
on the thread that reads it), once per adapter object, and is dropped with the adapter."""

from __future__ import annotations

import gc
from pathlib import Path

from engine.config import LoRAConfig
from engine.lora.adapter import LoRAAdapter
from engine.lora.manager import LoRAManager
from tests.helpers import demo_shapes, make_lora_engine

DEMO = Path(__file__).resolve().parents[2] / "demo"


def test_prepare_runs_when_an_adapter_enters_the_host_cache() -> None:
    seen: list[LoRAAdapter] = []
    m = LoRAManager(LoRAConfig(enable_lora=True, max_loras=1, max_lora_rank=64, max_cpu_loras=1), demo_shapes(),
                    prepare=seen.append)
    a = m.load("a", str(DEMO / "adapters" / "reverse"))
    assert [x.name for x in seen] == ["a"] and m.adapter(a) is seen[0]  # a host-cache hit: not prepared again
    m.load("b", str(DEMO / "adapters" / "sort"))  # evicts a from the host cache (one entry)
    again = m.adapter(a)  # re-read from disk: prepared again, a new object
    assert [x.name for x in seen] == ["a", "b", "a"] and again is seen[2] and again is not seen[0]


def test_runner_packs_each_adapter_object_once_and_drops_it_with_the_adapter() -> None:
    llm = make_lora_engine(str(DEMO / "model"), {"r": str(DEMO / "adapters" / "reverse")}, max_model_len=128)
    assert llm.lora is not None
    runner = llm.runner
    ad = llm.lora.adapter(llm.lora.resolve("r"))
    pack = runner.prepare_lora(ad)
    assert runner.prepare_lora(ad) is pack
    assert len(pack.layers) == len(runner.lora_layers) and pack.nbytes > 0
    llm.lora.unload("r")
    del ad, pack
    gc.collect()
    assert len(runner._lora_packs) == 0
