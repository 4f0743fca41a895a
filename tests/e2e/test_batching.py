"""Batch invariance: a prompt's greedy output does not depend on its batch, on preemption or on
chunked prefill."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.helpers import make_engine, prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def int4_model(model_factory) -> str:
    return model_factory("qwen3", "auto_round", True)


@pytest.fixture(scope="module")
def batch_prompts() -> list[str]:
    ps = prompts(16, seed=11, min_words=1, max_words=40)
    assert len({len(p.split()) for p in ps}) > 8  # mixed lengths
    return ps


@pytest.fixture(scope="module")
def alone(int4_model: str, batch_prompts: list[str]) -> list[list[int]]:
    engine = make_engine(int4_model)
    return [engine.generate([p], GREEDY)[0].token_ids for p in batch_prompts]


def test_cpu_engine_resolves_the_eager_step_budget(int4_model: str) -> None:
    with make_engine(int4_model) as e:  # no graphs on the CPU: every step runs eagerly, the budget is 2048
        assert e.runner.mixed is None
        assert e.config.scheduler.max_num_batched_tokens == e.scheduler.budget == 2048


def test_bench_decode_window_holds_no_prefill(int4_model: str) -> None:
    """bench_e2e's pure decode (also bench_serve's baseline) starts its clock after every prompt is prefilled,
    however many steps the budget needs: 8 prompts of 32 tokens at 64 tokens per step take 4 steps."""
    from benchmarks.bench_e2e import time_decode

    with make_engine(int4_model, max_num_batched_tokens=64) as e:
        r = time_decode(e, [[7 + i] * 32 for i in range(8)], 6)
        assert r["mixed_steps"] == 0
        assert r["steps"] >= 4  # the 6 tokens' decode steps, less those before the clock


def test_batch_of_16_equals_alone(int4_model: str, batch_prompts: list[str], alone: list[list[int]]) -> None:
    engine = make_engine(int4_model)
    batched = [r.token_ids for r in engine.generate(batch_prompts, GREEDY)]
    assert batched == alone
    assert engine.blocks.num_free == engine.blocks.num_blocks  # every block returned


def test_preemption_by_recompute_keeps_outputs(int4_model: str, batch_prompts: list[str],
                                               alone: list[list[int]]) -> None:
    # 16 blocks x 16 tokens cannot hold 16 sequences of up to ~90 tokens: the scheduler must preempt.
    engine = make_engine(int4_model, max_model_len=128, num_blocks=16)
    batched = [r.token_ids for r in engine.generate(batch_prompts, GREEDY)]
    assert engine.num_preemptions > 0
    assert batched == alone
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_chunked_prefill_keeps_outputs(int4_model: str, batch_prompts: list[str], alone: list[list[int]]) -> None:
    # A 7-token step budget splits every long prompt into chunks and mixes them with decodes.
    engine = make_engine(int4_model, max_num_batched_tokens=7)
    batched = [r.token_ids for r in engine.generate(batch_prompts, GREEDY)]
    assert batched == alone


def test_max_num_seqs_bounds_running(int4_model: str, batch_prompts: list[str], alone: list[list[int]]) -> None:
    engine = make_engine(int4_model, max_num_seqs=3)
    for i, p in enumerate(batch_prompts):
        engine.add_request(str(i), p, GREEDY)
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(batch_prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
        assert len(engine.scheduler.running) <= 3
    assert [outs[str(i)] for i in range(len(batch_prompts))] == alone


def test_seeded_sampling_is_batch_invariant(int4_model: str, batch_prompts: list[str]) -> None:
    params = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(len(batch_prompts))]
    engine = make_engine(int4_model)
    batched = [r.token_ids for r in engine.generate(batch_prompts, params)]
    solo = make_engine(int4_model)  # one request at a time; each carries its own seed
    alone = [solo.generate([p], sp)[0].token_ids for p, sp in zip(batch_prompts[:4], params)]
    assert batched[:4] == alone
    assert len({tuple(t) for t in batched}) > 1
