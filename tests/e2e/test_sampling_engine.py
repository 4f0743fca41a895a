"""The sampling processors' device-side token history under what the scheduler does to a sequence: tensor
parallelism (only rank 0 samples; TP=2 must equal TP=1), chunked prefill and preemption by recompute (the
history is rebuilt from the re-fed tokens), on the demo model with its adapters in mixed batches."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import CacheConfig, EngineConfig, LLMEngine, LoRAConfig, ModelConfig, SamplingParams, SchedulerConfig
from tests.helpers import make_lora_engine

DEMO = Path(__file__).resolve().parents[2] / "demo"
ADAPTERS = {n: str(DEMO / "adapters" / n) for n in ("reverse", "upper", "sort")}
PROMPTS = ["words: cat ant moon fox =>", "words: owl jam dog hat key =>", "words: pig egg bee =>",
           "words: nut gem ink lamp owl pig =>"] * 2
NAMES: list[str | None] = [None, "reverse", "upper", "sort", "sort", None, "reverse", "upper"]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=10.0),
    SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=2.0, frequency_penalty=1.5, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.0, logit_bias=((357, -100.0),), min_tokens=9),
    SamplingParams(max_tokens=12, temperature=1.5, top_k=4, min_p=0.1, repetition_penalty=1.4, frequency_penalty=1.0,
                   seed=3,
                   ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=2.0, min_tokens=12),
    SamplingParams(max_tokens=12, temperature=2.0, presence_penalty=-1.0, frequency_penalty=-2.0, seed=9,
                   ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.0),
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=4, ignore_eos=True),
]


def _run(engine: LLMEngine) -> list[list[int]]:
    out = engine.generate(PROMPTS, PARAMS, NAMES)
    assert all(r.error is None for r in out)
    return [r.token_ids for r in out]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with make_lora_engine(str(DEMO / "model"), ADAPTERS) as e:
        ref = _run(e)
        plain = e.generate(PROMPTS, [SamplingParams(max_tokens=12, temperature=0.0)] * len(PROMPTS), NAMES)
    # The greedy processor rows are not no-ops (the last greedy row has none and must agree).
    for i in (0, 1, 2, 4):
        assert ref[i] != plain[i].token_ids, i
    assert ref[6] == plain[6].token_ids
    return ref


def test_tp2_equals_tp1(reference: list[list[int]]) -> None:
    with make_lora_engine(str(DEMO / "model"), ADAPTERS, tp=2) as e:
        assert _run(e) == reference


def test_chunked_prefill_and_preemption_rebuild_the_history(reference: list[list[int]]) -> None:
    tight = EngineConfig(ModelConfig(str(DEMO / "model"), dtype="float32", max_model_len=32),
                         cache=CacheConfig(num_blocks=6, block_size=8),
                         scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8),
                         lora=LoRAConfig(enable_lora=True, max_loras=3, lora_modules=tuple(ADAPTERS.items())))
    with LLMEngine(tight) as e:
        assert _run(e) == reference
        assert e.num_preemptions > 0
