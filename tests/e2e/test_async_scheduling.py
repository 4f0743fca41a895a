"""Async scheduling (the engine launches step N+1 before it reads step N's sampled ids back, and step N+1 takes
them from the device) gives exactly the synchronous loop's outputs. On the CPU the same code runs without
overlap, so these compare the two modes request by request on the demo model (trained: its requests end on
EOS at different steps, which leaves wasted rows) under everything that touches the pending-token logic:
mixed adapter batches with slot churn, chunked prefill, preemption, prefix-cache hits, seeds, logprobs,
min_tokens/stop ids, penalties and grammars (which wait for their ids first), aborts while a step is in
flight, and TP=2 over gloo (rank 0 broadcasts the ids to the other rank)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams, StructuredSpec
from engine.config import CacheConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig

DEMO = Path(__file__).resolve().parents[2] / "demo"
ADAPTERS = tuple((n, str(DEMO / "adapters" / n)) for n in ("reverse", "upper", "sort"))
WORDS = "cat ant moon fox owl jam dog hat pig egg bee sun".split()


def engine(async_scheduling: bool, *, max_loras: int = 2, num_blocks: int | None = None, tp: int = 1,
           max_num_batched_tokens: int = 2048, prefix_caching: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(
        ModelConfig(str(DEMO / "model"), dtype="float32", max_model_len=128),
        cache=CacheConfig(num_blocks=num_blocks or 8 * 32, enable_prefix_caching=prefix_caching),
        parallel=ParallelConfig(tensor_parallel_size=tp, device="cpu"),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=max_num_batched_tokens),
        lora=LoRAConfig(enable_lora=True, max_loras=max_loras, max_lora_rank=64, lora_modules=ADAPTERS),
        async_scheduling=async_scheduling))


def workload(n: int = 24, long: bool = False) -> tuple[list[str], list[SamplingParams], list[str | None]]:
    """Prompts of 2-6 words (two share a long prefix), base and three adapters, most greedy until EOS; long:
    every third request runs 20-24 tokens past its EOS (sequences that outgrow their first KV block)."""
    prompts, params, models = [], [], []
    shared = "words: " + " ".join(WORDS * 2)
    for i in range(n):
        k = 2 + i % 5
        prompt = "words: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(k)) + " =>"
        if i % 7 == 3:
            prompt = shared + " " + WORDS[i % len(WORDS)] + " =>"  # a prefix-cache hit after the first
        kind = i % 6
        if kind == 4:
            p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=100 + i, logprobs=2)
        elif kind == 5:
            p = SamplingParams(max_tokens=10 + i % 3, temperature=0.0, min_tokens=3, stop_token_ids=[5])
        else:
            p = SamplingParams(max_tokens=4 + i % 13, temperature=0.0, logprobs=0 if i % 2 else None)
        if long and i % 3 == 0:
            p = SamplingParams(max_tokens=20 + i % 5, temperature=0.0, ignore_eos=True)
        prompts.append(prompt)
        params.append(p)
        models.append([None, "reverse", "upper", "sort"][i % 4])
    return prompts, params, models


def run(e: LLMEngine, prompts: list[str], params: list[SamplingParams], models: list[str | None]) -> list[tuple]:
    """Per request: ids, finish reason, text and logprobs (ids with values, compared by `same`)."""
    out = e.generate(prompts, params, models)
    assert e.blocks.num_free == e.blocks.num_blocks  # every block came back
    return [(r.token_ids, r.finish_reason, r.text,
             None if r.logprobs is None else [(lp.token_id, lp.logprob, lp.top) for lp in r.logprobs])
            for r in out]


def same(got: list[tuple], want: list[tuple]) -> None:
    """Ids, reasons, texts exactly; logprobs to 1e-4 (a wasted row or a different admission step changes a
    step's batch, hence the float summation order of its matmuls, in the last digits)."""
    assert [g[:3] for g in got] == [w[:3] for w in want]
    for g, w in zip(got, want):
        assert (g[3] is None) == (w[3] is None)
        for (gi, glp, gtop), (wi, wlp, wtop) in zip(g[3] or [], w[3] or []):
            assert gi == wi and glp == pytest.approx(wlp, abs=1e-4)
            assert [t for t, _ in gtop] == [t for t, _ in wtop]
            assert [v for _, v in gtop] == pytest.approx([v for _, v in wtop], abs=1e-4)


@pytest.fixture(scope="module")
def reference() -> list[tuple]:
    with engine(False) as e:
        return run(e, *workload())


def test_async_equals_sync(reference: list[tuple]) -> None:
    with engine(True) as e:
        assert e.async_scheduling
        got = run(e, *workload())
    same(got, reference)
    reasons = {r[1] for r in reference}
    assert "stop" in reasons and "length" in reasons  # EOS mid-batch (wasted rows) and max_tokens both ran


@pytest.mark.parametrize("case", ["chunked", "preempting", "no_prefix_cache"])
def test_async_equals_sync_under_pressure(case: str) -> None:
    kw = {"chunked": {"max_num_batched_tokens": 9}, "preempting": {"num_blocks": 8},
          "no_prefix_cache": {"prefix_caching": False}}[case]
    with engine(False, **kw) as e:
        want = run(e, *workload(long=True))
    with engine(True, **kw) as e:
        got = run(e, *workload(long=True))
        if case == "preempting":
            assert e.num_preemptions > 0
    same(got, want)


def test_penalties_and_grammars_wait_for_their_ids() -> None:
    prompts, params, models = workload(12)
    spec = StructuredSpec("choice", json.dumps([" cat ant", " moon fox owl", " dog"]))
    for i in range(0, 12, 3):
        params[i] = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)
    params[1] = SamplingParams(max_tokens=12, temperature=0.0, structured=spec)
    params[7] = SamplingParams(max_tokens=12, temperature=0.0, structured=spec)
    with engine(False) as e:
        want = run(e, prompts, params, models)
    with engine(True) as e:
        got = run(e, prompts, params, models)
    same(got, want)
    assert want[1][2] in (" cat ant", " moon fox owl", " dog") and want[7][2] in (" cat ant", " moon fox owl", " dog")


def test_abort_while_a_step_is_in_flight() -> None:
    prompts, params, models = workload(8)
    with engine(True) as e:
        for i, (p, m) in enumerate(zip(prompts, models)):
            e.add_request(str(i), p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), m)
        seen: dict[str, int] = {}
        for _ in range(3):
            for out in e.step():
                seen[out.request_id] = seen.get(out.request_id, 0) + len(out.new_token_ids)
        assert e._launched is not None  # a step is on its way
        assert e.abort("2") and e.abort("5")
        late = []
        while e.has_unfinished():
            late += [o.request_id for o in e.step()]
        assert "2" not in late and "5" not in late  # the in-flight step's ids for them were dropped
        assert e.blocks.num_free == e.blocks.num_blocks


def test_tp2_async_equals_tp1_sync(reference: list[tuple]) -> None:
    with engine(True, tp=2) as e:
        got = run(e, *workload())
    same(got, reference)
