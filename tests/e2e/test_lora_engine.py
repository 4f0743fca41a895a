"""Adapter lifecycle in the engine: more adapters than slots, unload while running, same-name reload,
failed loads that leave nothing behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.errors import ModelNotFoundError
from engine.lora.adapter import AdapterError
from engine.lora.manager import AdapterNotLoadedError
from tests.helpers import ALL7, make_lora_engine, prompts
from tools.tinymodels import make_peft_adapter

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def six(model_factory, tmp_path_factory) -> dict:
    bf16 = model_factory("qwen3", None, False)
    root = tmp_path_factory.mktemp("six")
    adapters = {f"a{i}": make_peft_adapter(bf16, str(root / f"a{i}"), r=[4, 8, 16][i % 3], targets=ALL7, seed=10 + i,
                                           b_std=0.1) for i in range(6)}
    return {"model": model_factory("qwen3", "auto_round", False), "adapters": adapters, "root": root, "bf16": bf16}


def _alone(model: str, adapters: dict[str, str], p: str, name: str | None) -> list[int]:
    return make_lora_engine(model, adapters, max_loras=1).generate([p], GREEDY, [name])[0].token_ids


def test_six_adapters_with_two_slots(six: dict) -> None:
    engine = make_lora_engine(six["model"], six["adapters"], max_loras=2, max_cpu_loras=3)
    ps = prompts(4, seed=2)
    batch = [(p, n) for p in ps for n in [*six["adapters"], None]]
    engine_steps_adapters: list[int] = []
    for i, (p, n) in enumerate(batch):
        engine.add_request(str(i), p, GREEDY, n)
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
        running = {s.lora_id for s in engine.scheduler.running if s.lora_id is not None}
        engine_steps_adapters.append(len(running))
    assert max(engine_steps_adapters) <= 2
    assert engine.lora.num_evictions > 0  # slots were really reused
    reference = make_lora_engine(six["model"], six["adapters"], max_loras=6)
    for i, (p, n) in enumerate(batch):
        assert outs[str(i)] == reference.generate([p], GREEDY, [n])[0].token_ids, (p, n)


def test_unload_while_running_then_reload_with_new_weights(six: dict, tmp_path: Path) -> None:
    engine = make_lora_engine(six["model"], {"x": six["adapters"]["a0"]}, max_loras=2)
    p = prompts(1, seed=3)[0]
    old = engine.generate([p], GREEDY, ["x"])[0].token_ids
    engine.add_request("run", p, GREEDY, "x")
    got: list[int] = []
    for _ in range(2):  # prefill done, now running (async scheduling reads a step's tokens back one step later)
        got = got or [t for o in engine.step() for t in o.new_token_ids]
    assert len(got) == 1 and engine.has_unfinished()
    engine.unload_lora_adapter("x")
    with pytest.raises(ModelNotFoundError):
        engine.add_request("new", p, GREEDY, "x")
    while engine.has_unfinished():
        for o in engine.step():
            got.extend(o.new_token_ids)
    assert got == old  # the running request finished with the adapter it started with
    assert engine.lora.slots_snapshot().count(None) == 2  # its slot was freed at the end
    engine.load_lora_adapter("x", six["adapters"]["a3"])
    new = engine.generate([p], GREEDY, ["x"])[0].token_ids
    assert new == _alone(six["model"], {"a3": six["adapters"]["a3"]}, p, "a3")
    assert new != old


def test_failed_loads_register_nothing(six: dict, tmp_path: Path) -> None:
    engine = make_lora_engine(six["model"], max_lora_rank=8)
    big = six["adapters"]["a2"]  # rank 16 > max_lora_rank 8
    with pytest.raises(AdapterError, match="rank 16 > max_lora_rank 8"):
        engine.load_lora_adapter("big", big)
    bad = tmp_path / "bad"
    shutil.copytree(six["adapters"]["a0"], bad)
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(AdapterError):
        engine.load_lora_adapter("bad", str(bad))
    with pytest.raises(AdapterError):
        engine.load_lora_adapter("missing", str(tmp_path / "nope"))
    assert engine.lora.list_adapters() == []
    engine.load_lora_adapter("ok", six["adapters"]["a0"])
    with pytest.raises(AdapterError, match="already loaded"):
        engine.load_lora_adapter("ok", six["adapters"]["a1"])
    with pytest.raises(AdapterNotLoadedError):
        engine.unload_lora_adapter("never")
    assert [n for n, _, _ in engine.lora.list_adapters()] == ["ok"]


def test_reload_same_name_gets_new_id(six: dict) -> None:
    engine = make_lora_engine(six["model"], {"y": six["adapters"]["a1"]})
    first = engine.lora.resolve("y")
    engine.unload_lora_adapter("y")
    engine.load_lora_adapter("y", six["adapters"]["a1"])
    assert engine.lora.resolve("y") != first


def test_host_cache_eviction_rereads_and_detects_changed_files(six: dict, tmp_path: Path) -> None:
    copies = {}
    for n in ("a0", "a1", "a2"):
        copies[n] = str(tmp_path / n)
        shutil.copytree(six["adapters"][n], copies[n])
    engine = make_lora_engine(six["model"], copies, max_loras=1, max_cpu_loras=1)
    p = prompts(1, seed=4)[0]
    assert engine.generate([p], GREEDY, ["a0"])[0].token_ids == _alone(six["model"], {"a0": six["adapters"]["a0"]}, p, "a0")
    # a1 was evicted from the host cache when a2 loaded; change its files on disk: it must be refused.
    shutil.copy(Path(six["adapters"]["a3"]) / "adapter_model.safetensors", Path(copies["a1"]) / "adapter_model.safetensors")
    r = engine.generate([p], GREEDY, ["a1"])[0]
    assert r.finish_reason == "error" and "changed on disk" in (r.error or "")
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert engine.generate([p], GREEDY, ["a2"])[0].finish_reason == "length"


def test_waiting_adapter_is_not_starved(six: dict) -> None:
    """One slot; a0 requests keep arriving while an a1 request waits: a1 must run before the a0 stream ends."""
    engine = make_lora_engine(six["model"], {"a0": six["adapters"]["a0"], "a1": six["adapters"]["a1"]}, max_loras=1)
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    p = prompts(1, seed=6)[0]
    for i in range(3):
        engine.add_request(f"a0-{i}", p, short, "a0")
    engine.step()
    engine.add_request("a1", p, short, "a1")
    finished_at: dict[str, int] = {}
    for step in range(200):
        engine.add_request(f"a0-late-{step}", p, short, "a0")  # a steady stream for the adapter in the slot
        for o in engine.step():
            if o.finished:
                finished_at[o.request_id] = step
        if "a1" in finished_at:
            break
    assert "a1" in finished_at and finished_at["a1"] < 20, finished_at.get("a1")


def test_pinned_adapter_keeps_its_slot(six: dict) -> None:
    engine = make_lora_engine(six["model"], max_loras=2)
    engine.load_lora_adapter("pinned", six["adapters"]["a0"], pin=True)
    for n in ("a1", "a2", "a3"):
        engine.load_lora_adapter(n, six["adapters"][n])
    p = prompts(1, seed=7)[0]
    engine.generate([p], GREEDY, ["pinned"])
    pinned_id = engine.lora.resolve("pinned")
    for n in ("a1", "a2", "a3", "a1"):
        engine.generate([p], GREEDY, [n])
        assert pinned_id in engine.lora.slots_snapshot()
    assert engine.lora.num_evictions >= 2
