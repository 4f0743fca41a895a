"""Qwen3.5 / Qwen3.6 hybrid (Gated DeltaNet + gated attention) against transformers, float32.

Tolerance 1e-4 on logits of magnitude ~3, as for the dense models: identical weights, differences only
from accumulation order (~6e-6 measured). The int4 oracle is transformers holding auto-round's own
dequantization of the checkpoint (checked against auto-round's transformers integration here too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from peft import PeftModel
from safetensors.torch import load_file, save_file

from engine import KernelConfig, SamplingParams
from engine.lora.adapter import AdapterError
from tests.helpers import as_tp_rank, make_engine, make_lora_engine, prompts, tp_device
from tests.oracle import hf_greedy, hf_logits, load_hf_dequantized
from tools.tinymodels import load_transformers_fp32, make_peft_adapter, make_qwen35_model, quantize

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
REF_GDN = KernelConfig(gdn="reference")
"""The oracles here hold float32 to 1e-4; fla's Triton kernels (the GPUs' default) run their chunked dots in
reduced precision (up to ~1 % of the output's scale: benchmarks/check_fla.py), so these tests pin the torch GDN on every device."""
TWELVE = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
          "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("q35")
    vl = make_qwen35_model(str(root / "vl-bf16"), vision=True)
    return {"vl": vl, "text": make_qwen35_model(str(root / "text-bf16"), vision=False, seed=3),
            "int4": quantize(vl, str(root / "vl-int4"))}


def _oracle(models: dict[str, str], kind: str) -> torch.nn.Module:
    return load_hf_dequantized(models[kind]) if kind == "int4" else load_transformers_fp32(models[kind])


@pytest.mark.parametrize("kind", ["vl", "text", "int4"])
def test_logits_and_greedy_match_transformers(models: dict[str, str], kind: str) -> None:
    engine = make_engine(models[kind], kernels=REF_GDN)
    hf = _oracle(models, kind)
    ps = prompts(6, seed=31, max_words=40)
    results = engine.generate(ps, GREEDY)
    for r in results:
        assert r.token_ids == hf_greedy(hf, r.prompt_token_ids, GREEDY.max_tokens)
    for r in results[:3]:
        torch.testing.assert_close(engine.runner.prompt_logits(r.prompt_token_ids).cpu(),
                                   hf_logits(hf, r.prompt_token_ids), atol=1e-4, rtol=0)
    if kind == "int4":  # the dequantized oracle agrees with auto-round's own transformers integration
        ids = results[0].prompt_token_ids
        torch.testing.assert_close(hf_logits(load_transformers_fp32(models[kind]), ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_states_after_prompt_equal_transformers_cache(models: dict[str, str]) -> None:
    engine = make_engine(models["vl"], kernels=REF_GDN)
    hf = load_transformers_fp32(models["vl"])
    ids = engine.tokenize(prompts(1, seed=4, min_words=20)[0])
    engine.runner.prompt_logits(ids)  # leaves the prompt's state in slot 0
    with torch.no_grad():
        cache = hf(torch.tensor([ids]), use_cache=True).past_key_values
    if not hasattr(cache, "get_conv_state"):  # the oracle's cache API (transformers 5.24; older ones differ)
        pytest.skip(f"transformers {transformers.__version__}'s cache has no get_conv_state")
    gdn = engine.runner.gdn_layers
    linear_layers = [i for i, t in enumerate(hf.config.layer_types) if t == "linear_attention"]
    assert len(gdn) == len(linear_layers) == 3
    for m, i in zip(gdn, linear_layers):
        conv = cache.get_conv_state(i, state_idx=0)[0].float()  # [C, K] (transformers keeps one extra column)
        rec = cache.get_recurrent_state(i, state_idx=0)[0].float()
        torch.testing.assert_close(m.conv_state[0].float().cpu(), conv[:, -(m.kernel - 1):], atol=1e-5, rtol=0)
        torch.testing.assert_close(m.ssm_state[0].cpu(), rec, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_concurrency_equal_one_shot(models: dict[str, str]) -> None:
    ps = prompts(5, seed=8, min_words=5, max_words=40)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    one_shot = make_engine(models["int4"], kernels=REF_GDN)
    alone = [one_shot.generate([p], params)[0].token_ids for p in ps]
    chunked = make_engine(models["int4"], max_num_batched_tokens=6, kernels=REF_GDN)  # prompts split into chunks
    assert [r.token_ids for r in chunked.generate(ps, params)] == alone
    batched = make_engine(models["int4"], max_num_seqs=4, num_blocks=8, max_model_len=128,
                          kernels=REF_GDN)  # forces preemption
    assert [r.token_ids for r in batched.generate(ps, params)] == alone
    assert batched.num_preemptions > 0


def test_abort_frees_the_state_slot(models: dict[str, str]) -> None:
    engine = make_engine(models["vl"], max_num_seqs=2, kernels=REF_GDN)
    engine.add_request("a", "hello world", GREEDY)
    engine.add_request("b", "the quick brown fox", GREEDY)
    engine.step()
    assert engine.scheduler._free_states == []
    engine.abort("a")
    assert engine.scheduler._free_states != [] and engine.blocks.num_free > 0
    engine.add_request("c", "café", GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert sorted(engine.scheduler._free_states) == [0, 1]


def _renamed(src: str, dst: Path) -> str:
    """The same adapter with keys under model.language_model.layers (how VL exports name them)."""
    dst.mkdir()
    (dst / "adapter_config.json").write_text((Path(src) / "adapter_config.json").read_text())
    t = load_file(str(Path(src) / "adapter_model.safetensors"))
    save_file({k.replace("model.layers.", "model.language_model.layers."): v for k, v in t.items()},
              str(dst / "adapter_model.safetensors"))
    return str(dst)


@pytest.fixture(scope="module")
def adapter(models: dict[str, str], tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("q35-lora")
    a = make_peft_adapter(models["vl"], str(root / "all12"), r=8, targets=TWELVE, seed=5, b_std=0.1)
    return {"plain": a, "vl": _renamed(a, root / "all12-vl")}


@pytest.mark.parametrize("kind", ["vl", "int4"])
def test_lora_on_all_twelve_targets_matches_peft(models: dict[str, str], adapter: dict[str, str], kind: str) -> None:
    engine = make_lora_engine(models[kind], {"plain": adapter["plain"], "vl": adapter["vl"]}, kernels=REF_GDN)
    loaded = engine.lora.adapter(engine.lora.resolve("plain"))
    assert {n.rsplit(".", 1)[-1] for n in loaded.modules} == set(TWELVE)
    oracle = PeftModel.from_pretrained(_oracle(models, kind), adapter["plain"]).eval()
    ps = prompts(3, seed=12)
    for name in ("plain", "vl"):
        results = engine.generate(ps, GREEDY, [name] * len(ps))
        for r in results:
            assert r.token_ids == hf_greedy(oracle, r.prompt_token_ids, GREEDY.max_tokens)
        slot = engine.lora.acquire_slot(engine.lora.resolve(name))[0]
        ids = results[0].prompt_token_ids
        torch.testing.assert_close(engine.runner.prompt_logits(ids, lora_slot=slot).cpu(), hf_logits(oracle, ids),
                                   atol=1e-4, rtol=0)
        engine.lora.release_slot(engine.lora.resolve(name))


def test_adapter_matching_nothing_is_rejected(models: dict[str, str], adapter: dict[str, str], tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((Path(adapter["plain"]) / "adapter_config.json").read_text())
    t = load_file(str(Path(adapter["plain"]) / "adapter_model.safetensors"))
    save_file({k.replace("model.layers.", "transformer.h."): v for k, v in t.items()}, str(bad / "adapter_model.safetensors"))
    engine = make_lora_engine(models["vl"], kernels=REF_GDN)
    with pytest.raises(AdapterError):
        engine.load_lora_adapter("bad", str(bad))
    assert engine.lora.list_adapters() == []


@pytest.mark.parametrize("fully_sharded", [False, True], ids=["default", "fully-sharded"])
def test_tp2_equals_tp1_on_int4_hybrid_with_adapter(models: dict[str, str], adapter: dict[str, str],
                                                    fully_sharded: bool) -> None:
    from engine import CacheConfig, EngineConfig, LLMEngine, LoRAConfig, ModelConfig, ParallelConfig

    device = tp_device(2)  # both sizes on one kind of device: the CPU when fewer than two GPUs are visible

    def run(tp: int) -> list[list[int]]:
        lora = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8, fully_sharded_loras=fully_sharded,
                          lora_modules=(("a", adapter["vl"]),))
        cfg = EngineConfig(ModelConfig(models["int4"], dtype="float32", max_model_len=256),
                           cache=CacheConfig(num_blocks=64), lora=lora, kernels=REF_GDN,
                           parallel=ParallelConfig(tensor_parallel_size=tp, device=device))
        with LLMEngine(cfg) as e:
            return [r.token_ids for r in e.generate(ps, GREEDY, ["a", None, "a", None])]

    ps = prompts(4, seed=77, max_words=30)
    one = run(1)
    assert run(2) == one
    assert one[0] != make_engine(models["int4"], kernels=REF_GDN).generate([ps[0]], GREEDY)[0].token_ids  # the adapter matters


def test_gated_attention_heads_must_split_evenly_over_tp() -> None:
    """q_proj holds [query, gate] per head: 3 heads at tp=2 would split a pair across ranks."""
    from dataclasses import replace

    from engine.device import Kernels
    from engine.layers.quant import QuantConfig
    from engine.models.qwen3_5 import GatedAttention, Qwen35Args

    a = Qwen35Args(vocab_size=64, hidden_size=64, intermediate_size=128, layer_types=("full_attention",),
                   num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=4, rope_theta=1e4, rms_norm_eps=1e-6,
                   max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False, lin_k_heads=2,
                   lin_v_heads=2, lin_k_dim=16, lin_v_dim=16, conv_kernel=4, ckpt_prefix="model")
    with as_tp_rank(0, 2):
        GatedAttention(a, QuantConfig("none"), Kernels(), torch.float32, "l.self_attn")  # 4 heads: fine
        with pytest.raises(ValueError, match=r"l\.self_attn attention heads: 3 is not divisible"):
            GatedAttention(replace(a, num_heads=3), QuantConfig("none"), Kernels(), torch.float32, "l.self_attn")
