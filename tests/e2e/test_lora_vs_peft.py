"""Whole-model LoRA against peft + transformers (+ auto-round's dequantized int4 weights), float32.

Adapters are real peft adapters built on the 16-bit model with random non-zero A and B, at several
ranks and target sets; the int4 oracle is transformers holding auto-round's dequantized weights with
the same peft adapter attached (peft cannot attach to auto-round's int4 layers)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from engine import SamplingParams
from tests.helpers import make_lora_engine, prompts
from tests.oracle import hf_greedy, hf_logits, load_hf_dequantized
from tools.tinymodels import load_transformers_fp32, make_peft_adapter

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ADAPTERS = {
    "r8-qv": dict(r=8, targets=["q_proj", "v_proj"]),
    "r16-attn": dict(r=16, targets=["q_proj", "k_proj", "v_proj", "o_proj"], alpha=8),
    "r64-all": dict(r=64, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                    b_std=0.02),
    "r4-mlp-rslora": dict(r=4, targets="(.*(gate|up|down)_proj)", rslora=True,
                          rank_pattern={"down_proj": 12}, alpha_pattern={"up_proj": 20.0}),
}


@pytest.fixture(scope="module")
def setup(model_factory, tmp_path_factory) -> dict:
    bf16 = model_factory("qwen3", None, False)
    root = tmp_path_factory.mktemp("adapters")
    paths = {name: make_peft_adapter(bf16, str(root / name), seed=i, **kw) for i, (name, kw) in enumerate(ADAPTERS.items())}
    paths["zero-b"] = make_peft_adapter(bf16, str(root / "zero-b"), r=8, targets=["q_proj", "down_proj"], zero_b=True)
    return {"bf16": bf16, "int4": model_factory("qwen3", "auto_round", False), "adapters": paths}


def _oracle(base: torch.nn.Module, adapter_dir: str) -> torch.nn.Module:
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@pytest.mark.parametrize("quant", ["bf16", "int4"])
def test_mixed_batch_matches_peft(setup: dict, quant: str) -> None:
    path = setup[quant]
    engine = make_lora_engine(path, setup["adapters"], max_loras=5)
    ps = prompts(10, seed=5)
    names: list[str | None] = [None, *ADAPTERS, "zero-b"]
    # Every prompt under every adapter and the base, all in ONE mixed batch.
    batch = [(p, n) for p in ps for n in names]
    results = engine.generate([p for p, _ in batch], GREEDY, [n for _, n in batch])
    by_key = {(p, n): r for (p, n), r in zip(batch, results)}
    for n in names:
        hf = load_transformers_fp32(path) if quant == "bf16" else load_hf_dequantized(path)
        oracle = hf if n is None else _oracle(hf, setup["adapters"][n])
        for p in ps:
            r = by_key[(p, n)]
            assert r.error is None
            assert r.token_ids == hf_greedy(oracle, r.prompt_token_ids, GREEDY.max_tokens), (n, p)
        if n is not None:
            ids = by_key[(ps[0], n)].prompt_token_ids
            slot = engine.lora.acquire_slot(engine.lora.resolve(n))[0]  # already resident: no load
            ours = engine.runner.prompt_logits(ids, lora_slot=slot)
            engine.lora.release_slot(engine.lora.resolve(n))
            torch.testing.assert_close(ours, hf_logits(oracle, ids), atol=1e-4, rtol=0)
    # The adapters really change the output, and the zero-B adapter is exactly the base model.
    for p in ps:
        assert by_key[(p, "zero-b")].token_ids == by_key[(p, None)].token_ids
    assert any(by_key[(p, "r64-all")].token_ids != by_key[(p, None)].token_ids for p in ps)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_mixed_batch_equals_each_request_alone(setup: dict) -> None:
    engine = make_lora_engine(setup["int4"], setup["adapters"], max_loras=5)
    ps = prompts(6, seed=9)
    names: list[str | None] = [None, "r8-qv", "r64-all", None, "r4-mlp-rslora", "r16-attn"]
    mixed = engine.generate(ps, GREEDY, names)
    for p, n, r in zip(ps, names, mixed):
        alone = engine.generate([p], GREEDY, [n])[0]
        assert alone.token_ids == r.token_ids


FP8_EFFECT_TOL = 0.08
"""fp8 adapter storage (e4m3, one scale per rank row of A and per output row of B): the logits stay within this
fraction of the adapter's own effect (max |peft - base logits|) of peft's. e4m3 keeps 3 mantissa bits (a
relative rounding error up to 2^-4 per weight); measured on these adapters: see the test's message and
docs/adapters.md."""


@pytest.mark.parametrize("quant", ["bf16", "int4"])
def test_fp8_adapters_stay_close_to_peft(setup: dict, quant: str) -> None:
    path = setup[quant]
    fp8 = make_lora_engine(path, setup["adapters"], max_loras=5, lora_dtype="fp8")
    hf = load_transformers_fp32(path) if quant == "bf16" else load_hf_dequantized(path)
    ids = fp8.tokenizer.encode(prompts(1, seed=7, min_words=12)[0])
    base = hf_logits(hf, ids)
    worst = []
    for n in ADAPTERS:
        oracle = _oracle(hf if quant == "bf16" else load_hf_dequantized(path), setup["adapters"][n])
        want = hf_logits(oracle, ids)
        fp8.generate(["x"], GREEDY, [n])  # the adapter gets a slot
        aid = fp8.lora.resolve(n)
        slot = fp8.lora.acquire_slot(aid)[0]
        got = fp8.runner.prompt_logits(ids, lora_slot=slot)
        fp8.lora.release_slot(aid)
        effect = float((want - base).abs().max())
        err = float((got - want).abs().max())
        worst.append((n, round(err, 4), round(effect, 3), round(err / effect, 4)))
        if quant == "bf16":
            oracle.unload()  # peft wraps `hf` in place: restore it for the next adapter
    print("fp8 vs peft (adapter, max |dlogit|, adapter effect, ratio):", worst)
    assert all(r <= FP8_EFFECT_TOL for *_, r in worst), worst
    assert any(r > 0 for *_, r in worst), "fp8 storage changed nothing: the adapters were not quantized"
