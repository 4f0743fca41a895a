"""Prefix caching through the engine, float32: the same token ids and logprobs (1e-4) with the cache on
and off on mixed batches (base + adapters, shared and unshared prefixes), with chunked prefill and
preemption, n > 1 copies and TP=2; a cache hit never crosses adapters or a same-name reload; the hybrid
Qwen3.5 model hits only where a state snapshot exists and then equals a run without the cache."""

from __future__ import annotations

import random

import pytest

from engine import (
    CacheConfig,
    EngineConfig,
    LLMEngine,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SamplingParams,
    SchedulerConfig,
)
from tests.helpers import ALL7, make_lora_engine
from tools.tinymodels import make_peft_adapter, make_qwen35_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
NAMES = ["a0", "a1", "a2"]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 400) for _ in range(n)]


SYS_A, SYS_B = _ids(random.Random(1), 40), _ids(random.Random(2), 37)


def _batch(seed: int) -> list[tuple[list[int], str | None]]:
    """Two shared system prefixes (40 and 37 tokens: 2 full blocks of 16 each) under the base and three
    adapters, plus unshared prompts."""
    rng = random.Random(seed)
    out: list[tuple[list[int], str | None]] = []
    for name in [None, *NAMES]:
        out += [(SYS_A + _ids(rng, rng.randint(1, 20)), name) for _ in range(2)]
        out.append((SYS_B + _ids(rng, rng.randint(1, 20)), name))
        out.append((_ids(rng, rng.randint(5, 50)), name))
    rng.shuffle(out)
    return out


def _generate(e: LLMEngine, batch: list[tuple[list[int], str | None]], params: SamplingParams = GREEDY) -> list:
    return e.generate([p for p, _ in batch], params, [n for _, n in batch])


def _assert_same(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.error is None and g.token_ids == w.token_ids
        for a, b in zip(g.logprobs or [], w.logprobs or [], strict=True):
            assert abs(a.logprob - b.logprob) <= 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(x - y) <= 1e-4 for (_, x), (_, y) in zip(a.top, b.top))


@pytest.fixture(scope="module")
def setup(model_factory, tmp_path_factory) -> dict:
    bf16 = model_factory("qwen3", None, False)
    root = tmp_path_factory.mktemp("prefix-adapters")
    adapters = {f"a{i}": make_peft_adapter(bf16, str(root / f"a{i}"), r=[8, 16, 8, 16][i], targets=ALL7, seed=40 + i,
                                           b_std=0.1) for i in range(4)}
    model = model_factory("qwen3", "auto_round", False)
    rounds = [_batch(1), _batch(2)]
    with make_lora_engine(model, adapters, prefix_caching=False) as off:
        ref = [_generate(off, b) for b in rounds]
    return {"model": model, "adapters": adapters, "rounds": rounds, "ref": ref}


def test_mixed_batches_equal_with_cache_on_and_off(setup: dict) -> None:
    e = make_lora_engine(setup["model"], setup["adapters"])
    assert e.blocks.enable_caching
    first = _generate(e, setup["rounds"][0])
    _assert_same(first, setup["ref"][0])
    # Within the first batch, requests sharing a prefix under one identity share its 2 full blocks.
    assert {r.num_cached_tokens for r in first} == {0, 32}
    hits = e.blocks.num_hits
    second = _generate(e, setup["rounds"][1])
    _assert_same(second, setup["ref"][1])
    # The second batch finds every shared prefix cached from the first, under its own identity.
    shared = [p[:40] == SYS_A or p[:37] == SYS_B for p, _ in setup["rounds"][1]]
    assert [r.num_cached_tokens for r in second] == [32 if s else 0 for s in shared]
    assert e.blocks.num_hits > hits and e.blocks.num_queries >= sum(len(p) for b in setup["rounds"] for p, _ in b)


def test_an_adapter_never_hits_another_and_a_reload_never_hits_the_old_blocks(setup: dict) -> None:
    ad = setup["adapters"]
    e = make_lora_engine(setup["model"], {"a0": ad["a0"], "a1": ad["a1"], "x": ad["a2"]})
    p = _ids(random.Random(7), 50)
    runs = [(name, e.generate([p], GREEDY, [name])[0]) for name in ["a0", "a1", None, "x", "a0", None, "a1"]]
    assert [r.num_cached_tokens for _, r in runs] == [0, 0, 0, 0, 48, 48, 48]
    e.unload_lora_adapter("x")
    e.load_lora_adapter("x", ad["a3"])  # the same name, other weights
    hits = e.blocks.num_hits
    reloaded = e.generate([p], GREEDY, ["x"])[0]
    assert reloaded.num_cached_tokens == 0 and e.blocks.num_hits == hits
    with make_lora_engine(setup["model"], {"x": ad["a3"]}, prefix_caching=False) as fresh:
        _assert_same([reloaded], fresh.generate([p], GREEDY, ["x"]))
    assert reloaded.token_ids != runs[3][1].token_ids  # the reload really changed the output
    assert e.generate([p], GREEDY, ["x"])[0].num_cached_tokens == 48  # the new identity caches its own


def test_chunked_prefill_and_preemption_with_the_cache(setup: dict) -> None:
    kw = dict(max_model_len=128, num_blocks=20, max_num_batched_tokens=24, max_loras=4)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    batch = [(p[:70], n) for p, n in setup["rounds"][0]][:12]
    with make_lora_engine(setup["model"], setup["adapters"], prefix_caching=False, **kw) as off:
        want = _generate(off, batch, params)
    e = make_lora_engine(setup["model"], setup["adapters"], **kw)
    got = _generate(e, batch, params)
    _assert_same(got, want)
    assert e.num_preemptions > 0 and e.blocks.num_hits > 0


def test_n_copies_share_their_prompt_blocks(setup: dict) -> None:
    e = make_lora_engine(setup["model"], setup["adapters"])
    p = _ids(random.Random(9), 45)
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=100 + j, ignore_eos=True) for j in range(3)]
    got = e.generate([p] * 3, params, ["a1"] * 3)
    assert [r.num_cached_tokens for r in got] == [0, 32, 32]
    with make_lora_engine(setup["model"], setup["adapters"], prefix_caching=False) as off:
        want = off.generate([p] * 3, params, ["a1"] * 3)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert len({tuple(r.token_ids) for r in got}) > 1  # the copies really sample differently


def test_tp2_with_the_cache_equals_tp1_without(setup: dict) -> None:
    with make_lora_engine(setup["model"], setup["adapters"], num_blocks=64, tp=2) as e2:
        first = _generate(e2, setup["rounds"][0])
        second = _generate(e2, setup["rounds"][1])
        assert e2.blocks.num_hits > 0
    _assert_same(first, setup["ref"][0])
    _assert_same(second, setup["ref"][1])


def _hybrid_engine(model: str, adapters: dict[str, str], caching: bool = True, budget: int = 2048, tp: int = 1,
                   max_model_len: int = 256, num_blocks: int | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(
        ModelConfig(model, dtype="float32", max_model_len=max_model_len),
        cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=caching, hybrid_snapshot_interval=32),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget), parallel=ParallelConfig(tensor_parallel_size=tp),
        lora=LoRAConfig(enable_lora=True, max_loras=4, lora_modules=tuple(adapters.items()))))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("q35")
    model = make_qwen35_model(str(root / "m"), vision=False)
    targets = ["q_proj", "in_proj_qkv", "in_proj_z", "out_proj", "down_proj"]
    adapters = {f"a{i}": make_peft_adapter(model, str(root / f"a{i}"), r=8, targets=targets, seed=60 + i, b_std=0.1)
                for i in range(3)}
    rounds = [_batch(4), _batch(5)]
    with _hybrid_engine(model, adapters, caching=False) as off:
        want = [_generate(off, b) for b in rounds]
    return {"model": model, "adapters": adapters, "rounds": rounds, "want": want}


def test_hybrid_hits_restore_the_state_snapshot(hybrid: dict) -> None:
    model, adapters, rounds = hybrid["model"], hybrid["adapters"], hybrid["rounds"]
    e = _hybrid_engine(model, adapters)
    got = [_generate(e, b) for b in rounds]
    for g, w in zip(got, hybrid["want"]):
        _assert_same(g, w)
    # Round 1 cannot share within its step (a state snapshot is findable once its step ran); round 2 hits
    # every shared prefix at the 32-token snapshot, under its own identity only.
    assert all(r.num_cached_tokens == 0 for r in got[0])
    shared = [p[:40] == SYS_A or p[:37] == SYS_B for p, _ in rounds[1]]
    assert [r.num_cached_tokens for r in got[1]] == [32 if x else 0 for x in shared]
    # Chunked prefill and preemption on top (a small KV cache, 24-token steps).
    batch = [(p[:70], n) for p, n in rounds[0]][:10]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    with _hybrid_engine(model, adapters, caching=False, budget=24) as off:
        want2 = _generate(off, batch, params)
    small = _hybrid_engine(model, adapters, budget=24, max_model_len=128, num_blocks=20)
    _assert_same(_generate(small, batch, params), want2)
    assert small.num_preemptions > 0 and small.blocks.num_hits > 0


def test_hybrid_tp2_with_the_cache_equals_tp1_without(hybrid: dict) -> None:
    with _hybrid_engine(hybrid["model"], hybrid["adapters"], tp=2) as e2:
        got = [_generate(e2, b) for b in hybrid["rounds"]]
        assert e2.blocks.num_hits > 0
    for g, w in zip(got, hybrid["want"]):
        _assert_same(g, w)


def test_penalised_requests_equal_with_cache_on_and_off(setup: dict) -> None:
    """The repetition penalty counts the prompt's tokens, which the sampler's history learns from the tokens
    a step feeds: a penalised request after a cache-warming one must still see its whole prompt."""
    batch = [(p, n) for p, n in setup["rounds"][0] if p[:40] == SYS_A][:4]
    pen = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, repetition_penalty=1.8,
                         frequency_penalty=0.5)
    with make_lora_engine(setup["model"], setup["adapters"], prefix_caching=False) as off:
        want = _generate(off, batch, pen)
        plain = _generate(off, batch)
    with make_lora_engine(setup["model"], setup["adapters"]) as on:
        _generate(on, batch)  # warms the cache with every prompt of the batch
        _assert_same(_generate(on, batch, pen), want)
    assert any(w.token_ids != p.token_ids for w, p in zip(want, plain))  # the penalty changes the outputs
