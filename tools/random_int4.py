"""Random checkpoints in the AutoRound int4 layout at real model shapes (Qwen3-8B, Qwen3.6-27B), for
GPU correctness and benchmarks where downloading the real weights is impossible.

The packed tensors are what auto-round writes (GPTQ v1 `auto_round:auto_gptq`, symmetric, group 128):
qweight int32 [K/8, N], qzeros int32 [K/G, N/8] (all 7 = zp 8 - 1), scales fp16 [K/G, N] with mixed
signs. Generated on the given device in chunks so an 8B-shaped checkpoint takes seconds.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from tools.tinymodels import tiny_tokenizer


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    hybrid: bool = False
    lin_k_heads: int = 16
    lin_v_heads: int = 48
    lin_dim: int = 128


QWEN3_8B = Shape(4096, 12288, 36, 32, 8, 128, 151936)
QWEN36_27B = Shape(5120, 17408, 64, 24, 4, 256, 248320, hybrid=True)


def _int4(k: int, n: int, g: torch.Generator, device: torch.device, std: float) -> dict[str, torch.Tensor]:
    words = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g, dtype=torch.int64, device=device)
    sign = torch.where(torch.rand(k // 128, n, generator=g, device=device) < 0.5, -1.0, 1.0)
    scales = (torch.rand(k // 128, n, generator=g, device=device) * 0.5 + 0.75) * std / 4.6 * sign
    return {"qweight": words.to(torch.int32).cpu(), "qzeros": torch.full((k // 128, n // 8), 0x77777777,
            dtype=torch.int64).to(torch.int32), "scales": scales.half().cpu()}


def write_random_int4(out: str, s: Shape, layers: int | None = None, seed: int = 0,
                      device: torch.device | None = None) -> str:
    """Write config.json, tokenizer and model.safetensors; `layers` overrides the layer count."""
    device = device or torch.device("cpu")
    n_layers = layers or s.layers
    g = torch.Generator(device=device).manual_seed(seed)
    std = 0.02
    t: dict[str, torch.Tensor] = {}
    pre = "model.language_model" if s.hybrid else "model"

    def dense(name: str, rows: int, cols: int) -> None:
        t[name] = (torch.randn(rows, cols, generator=g, device=device) * std).to(torch.bfloat16).cpu()

    def quant(name: str, k: int, n: int) -> None:
        for leaf, v in _int4(k, n, g, device, std).items():
            t[f"{name}.{leaf}"] = v

    dense(f"{pre}.embed_tokens.weight", s.vocab, s.hidden)
    dense("lm_head.weight", s.vocab, s.hidden)
    t[f"{pre}.norm.weight"] = torch.zeros(s.hidden, dtype=torch.bfloat16) if s.hybrid else torch.ones(
        s.hidden, dtype=torch.bfloat16)
    types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") if s.hybrid else "full_attention"
             for i in range(n_layers)]
    for i, kind in enumerate(types):
        p = f"{pre}.layers.{i}"
        for nm in ("input_layernorm", "post_attention_layernorm"):
            t[f"{p}.{nm}.weight"] = torch.zeros(s.hidden, dtype=torch.bfloat16) if s.hybrid else torch.ones(
                s.hidden, dtype=torch.bfloat16)
        if kind == "full_attention":
            q_out = s.heads * s.head_dim * (2 if s.hybrid else 1)
            quant(f"{p}.self_attn.q_proj", s.hidden, q_out)
            quant(f"{p}.self_attn.k_proj", s.hidden, s.kv_heads * s.head_dim)
            quant(f"{p}.self_attn.v_proj", s.hidden, s.kv_heads * s.head_dim)
            quant(f"{p}.self_attn.o_proj", s.heads * s.head_dim, s.hidden)
            for nm in ("q_norm", "k_norm"):
                t[f"{p}.self_attn.{nm}.weight"] = (torch.zeros if s.hybrid else torch.ones)(
                    s.head_dim, dtype=torch.bfloat16)
        else:
            kd, vd = s.lin_k_heads * s.lin_dim, s.lin_v_heads * s.lin_dim
            la = f"{p}.linear_attn"
            quant(f"{la}.in_proj_qkv", s.hidden, 2 * kd + vd)
            quant(f"{la}.in_proj_z", s.hidden, vd)
            dense(f"{la}.in_proj_a.weight", s.lin_v_heads, s.hidden)
            dense(f"{la}.in_proj_b.weight", s.lin_v_heads, s.hidden)
            quant(f"{la}.out_proj", vd, s.hidden)
            t[f"{la}.conv1d.weight"] = (torch.randn(2 * kd + vd, 1, 4) * 0.3).to(torch.bfloat16)
            t[f"{la}.A_log"] = torch.randn(s.lin_v_heads) * 0.5
            t[f"{la}.dt_bias"] = torch.randn(s.lin_v_heads) * 0.5
            t[f"{la}.norm.weight"] = torch.ones(s.lin_dim, dtype=torch.bfloat16)
        quant(f"{p}.mlp.gate_proj", s.hidden, s.intermediate)
        quant(f"{p}.mlp.up_proj", s.hidden, s.intermediate)
        quant(f"{p}.mlp.down_proj", s.intermediate, s.hidden)
    os.makedirs(out, exist_ok=True)
    save_file(t, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    qc = {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": 128,
          "sym": True, "data_type": "int", "block_name_to_quantize": f"{pre}.layers"}
    if s.hybrid:
        qc["extra_config"] = {f"{pre}.layers.{i}.linear_attn.in_proj_{ab}": {"bits": 16, "data_type": "fp"}
                              for i, k in enumerate(types) if k == "linear_attention" for ab in "ab"}
    text = {"vocab_size": s.vocab, "hidden_size": s.hidden, "intermediate_size": s.intermediate,
            "num_hidden_layers": n_layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
            "head_dim": s.head_dim, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "hidden_act": "silu"}
    if s.hybrid:
        text.update(model_type="qwen3_5_text", layer_types=types, linear_num_key_heads=s.lin_k_heads,
                    linear_num_value_heads=s.lin_v_heads, linear_key_head_dim=s.lin_dim,
                    linear_value_head_dim=s.lin_dim, linear_conv_kernel_dim=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
        cfg = {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False, "quantization_config": qc}
    else:
        cfg = {"model_type": "qwen3", **text, "rope_theta": 1000000.0, "quantization_config": qc}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    tiny_tokenizer().save_pretrained(out)
    return out
