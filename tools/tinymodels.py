"""Tiny Qwen checkpoints built offline (transformers + auto-round), for tests and the demo.

Sizes follow the rule that makes int4 and TP=2 both work: every quantized input size and its half
is a multiple of 128 (hidden 256, intermediate 768, heads x head_dim = 256). The vocab in the
config is padded above the tokenizer's size, as real Qwen checkpoints are.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedTokenizerFast

from tools.tokenizer import build_byte_bpe_tokenizer

Arch = Literal["qwen2", "qwen3"]
PackingFormat = Literal["auto_round", "auto_round:auto_gptq", "auto_round:gptqmodel"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello engine: serving many adapters on one model.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 and letters a b c d e f g h i j k l m n o p.",
    "Tensor parallel LoRA on int4 AutoRound Qwen checkpoints, on CPU, CUDA and XPU.",
    "Café, naïve, façade; 你好，世界; emoji 🚀🙂; Grüße aus München.",
] * 4


def tiny_tokenizer(vocab_size: int = 420) -> PreTrainedTokenizerFast:
    return build_byte_bpe_tokenizer(CORPUS, vocab_size)


def tiny_config(arch: Arch, vocab_size: int, tie: bool = False, layers: int = 2, hidden: int = 256,
                intermediate: int = 768, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
                max_pos: int = 1024, eos_token_id: int | None = None, init_std: float = 0.02):
    from transformers import Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_pos, tie_word_embeddings=tie, rms_norm_eps=1e-6,
                  initializer_range=init_std, eos_token_id=eos_token_id, bos_token_id=None,
                  pad_token_id=eos_token_id)
    if arch == "qwen3":
        return Qwen3Config(head_dim=head_dim, **common)
    if head_dim * heads != hidden:
        raise ValueError("Qwen2 derives head_dim = hidden / heads")
    return Qwen2Config(**common)


def make_model(out_dir: str, arch: Arch = "qwen3", tie: bool = False, seed: int = 0,
               dtype: torch.dtype = torch.bfloat16, init_std: float = 0.05, **cfg) -> str:
    """Write a random tiny model (weights in `dtype`) plus tokenizer to out_dir."""
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    config = tiny_config(arch, vocab_size=512, tie=tie, eos_token_id=tok.eos_token_id, init_std=init_std, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    if arch == "qwen2":
        # Qwen2's q/k/v biases start at zero; make them matter so the bias path is exercised.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.05)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def quantize(src: str, out_dir: str, fmt: PackingFormat = "auto_round", sym: bool = True,
             group_size: int = 128, bits: int = 4, iters: int = 0,
             layer_config: dict[str, dict[str, int]] | None = None) -> str:
    """AutoRound RTN (iters=0, no calibration data) of the model at src, written to out_dir.
    layer_config overrides single layers (e.g. {"model.layers.0.mlp.down_proj": {"bits": 16}})."""
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(os.path.join(src, "config.json")) as f:
        vl = json.load(f).get("model_type") == "qwen3_5"
    if vl:  # keep the vision-language layout (model.language_model.*) that real Qwen3.5/3.6 exports use
        from transformers import Qwen3_5ForConditionalGeneration

        model = Qwen3_5ForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(src)
    kwargs: dict = dict(disable_opt_rtn=True) if iters == 0 else {}
    if layer_config:
        kwargs["layer_config"] = layer_config
    ar = AutoRound(model, tok, bits=bits, group_size=group_size, sym=sym, iters=iters, device_map="cpu", **kwargs)
    from server.quantize import flatten_output

    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    ar.quantize_and_save(tmp, format=fmt)
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.move(flatten_output(Path(tmp)), out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def make_peft_adapter(base_dir: str, out_dir: str, r: int, targets: list[str] | str, alpha: float | None = None,
                      seed: int = 0, rslora: bool = False, zero_b: bool = False, b_std: float = 0.05,
                      rank_pattern: dict[str, int] | None = None, alpha_pattern: dict[str, float] | None = None) -> str:
    """A real PEFT LoRA adapter on the 16-bit model at base_dir, with random NON-zero A and B (or zero B)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r, target_modules=targets,
                     use_rslora=rslora, rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {},
                     lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.zeros(p.shape) if zero_b else torch.randn(p.shape, generator=g) * b_std)
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_qwen35_model(out_dir: str, vision: bool = True, seed: int = 0, layers: int = 4,
                      dtype: torch.dtype = torch.bfloat16) -> str:
    """A random tiny Qwen3.5 hybrid (3 Gated DeltaNet layers per full-attention layer).

    vision=True writes the vision-language layout (Qwen3_5ForConditionalGeneration with a tiny vision
    tower, `model.language_model.*`) plus a few `mtp.*` tensors like the real exports; vision=False
    a text-only `qwen3_5_text` export (Qwen3_5ForCausalLM). Norms, conv, A_log and dt_bias are
    randomised so that none of them is a no-op.
    """
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    tok = tiny_tokenizer()
    text = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                max_position_embeddings=1024, initializer_range=0.05, eos_token_id=tok.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10]})
    torch.manual_seed(seed)
    if vision:
        vis = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256, patch_size=16,
                   num_position_embeddings=64)
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vis))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if "linear_attn.norm" in name else 0.0))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.to(dtype).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    if vision:  # real exports carry a multi-token-prediction head; it is not used for text serving
        path = os.path.join(out_dir, "model.safetensors")
        tensors = load_file(path)
        tensors["mtp.fc.weight"] = torch.randn(256, 512).to(dtype)
        tensors["mtp.norm.weight"] = torch.ones(256).to(dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return out_dir


def force_transformers_torch_gdn() -> None:
    """With fla-core installed, transformers routes Qwen3.5's Gated DeltaNet to fla's Triton kernels even for
    CPU tensors, which fail there (or, on a GPU host, would make the oracle a second fast kernel): rebind
    its decorated functions to the torch functions they wrap, so the oracle is transformers' own torch
    path. Idempotent; unknown keyword arguments are dropped as transformers' wrapper does."""
    import functools
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        fn = getattr(m, name)
        if getattr(fn, "_torch_only", False):
            continue
        torch_fn = inspect.unwrap(fn)
        params = set(inspect.signature(torch_fn).parameters)

        @functools.wraps(torch_fn)
        def call(*args: object, _f: object = torch_fn, _p: set[str] = params, **kwargs: object) -> object:
            return _f(*args, **{k: v for k, v in kwargs.items() if k in _p})  # type: ignore[operator]

        call._torch_only = True  # type: ignore[attr-defined]
        setattr(m, name, call)


def load_transformers_fp32(path: str) -> torch.nn.Module:
    """A checkpoint in transformers (auto-round's own int4 layers for int4 folders), float32. auto-round casts
    int4 models to fp16 on load, which also rounds the rotary inv_freq buffer: cast back and rebuild the
    rotary table."""
    from transformers import AutoModelForCausalLM

    force_transformers_torch_gdn()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = torch.nn.Module.float(model).eval()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    return model
