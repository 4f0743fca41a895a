"""Qwen3.5 / Qwen3.6 hybrid decoder (text only): Gated DeltaNet layers and gated full attention.

Checkpoints come in the vision-language layout (`model.language_model.*`, plus `model.visual.*` and
`mtp.*`, which the loader skips) or as text-only exports (`model.*`). Norms are zero-centred,
x / rms(x) * (1 + w), except the DeltaNet output norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from engine.device import Kernels
from engine.distributed import tp_size
from engine.errors import UnsupportedModelError
from engine.layers.attention import Attention
from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.gdn import GatedDeltaNet
from engine.layers.linear import QKVParallelLinear, RowParallelLinear, divide
from engine.layers.norm import RMSNorm
from engine.layers.quant import QuantConfig
from engine.layers.rotary import RotaryEmbedding, rope_theta_of
from engine.models.qwen import QKVAttention, QwenDecoderLayer, QwenForCausalLM, QwenMLP, QwenModel
from kernels.fused import sigmoid_gate

HYBRID_ARCHS = ("qwen3_5", "qwen3_5_text")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: `text_config` of a vision-language export, else the config itself."""
    return hf.get("text_config") or hf if hf.get("model_type") == "qwen3_5" else hf


@dataclass(frozen=True)
class Qwen35Args:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    ckpt_prefix: str
    """Where the language model's tensors live in the checkpoint (quantization names use it)."""

    @staticmethod
    def from_hf(hf: dict[str, Any]) -> Qwen35Args:
        t = text_config(hf)
        n = int(t["num_hidden_layers"])
        types = t.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
        if len(types) != n or set(types) - {"full_attention", "linear_attention"}:
            raise UnsupportedModelError(f"layer_types {types!r} must list linear_attention/full_attention per layer")
        rope = t.get("rope_parameters") or {}
        head_dim = int(t.get("head_dim") or 256)
        return Qwen35Args(
            vocab_size=int(t["vocab_size"]), hidden_size=int(t["hidden_size"]),
            intermediate_size=int(t["intermediate_size"]), layer_types=tuple(types),
            num_heads=int(t["num_attention_heads"]), num_kv_heads=int(t["num_key_value_heads"]), head_dim=head_dim,
            rotary_dim=int(head_dim * float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25)))),
            rope_theta=rope_theta_of(t), rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(t.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
            attention_bias=bool(t.get("attention_bias", False)),
            lin_k_heads=int(t["linear_num_key_heads"]), lin_v_heads=int(t["linear_num_value_heads"]),
            lin_k_dim=int(t["linear_key_head_dim"]), lin_v_dim=int(t["linear_value_head_dim"]),
            conv_kernel=int(t.get("linear_conv_kernel_dim", 4)),
            ckpt_prefix="model.language_model" if hf.get("model_type") == "qwen3_5" else "model")


class GatedAttention(QKVAttention):
    """Full attention whose q_proj also yields a per-head output gate: out = attn * sigmoid(gate)."""

    def __init__(self, a: Qwen35Args, quant: QuantConfig, kernels: Kernels, dtype: torch.dtype, ckpt: str) -> None:
        super().__init__()
        names = [f"{ckpt}.{n}" for n in ("q_proj", "k_proj", "v_proj")]
        divide(a.num_heads, tp_size(), f"{ckpt} attention heads")  # a [query, gate] pair must not straddle ranks
        # q_proj rows are [query_h, gate_h] per head: counting 2 * heads "heads" keeps each pair on one rank.
        self.qkv_proj = QKVParallelLinear(a.hidden_size, a.head_dim, 2 * a.num_heads, a.num_kv_heads, a.attention_bias,
                                          quant.method_for(names, kernels.int4), dtype, f"{ckpt}.qkv_proj")
        self.o_proj = RowParallelLinear(a.num_heads * a.head_dim, a.hidden_size, a.attention_bias,
                                        quant.method_for([f"{ckpt}.o_proj"], kernels.int4), dtype, f"{ckpt}.o_proj")
        self.num_heads = self.qkv_proj.num_heads // 2
        self.num_kv_heads, self.head_dim = self.qkv_proj.num_kv_heads, a.head_dim
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype, zero_centered=True, backend=kernels.fused)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype, zero_centered=True, backend=kernels.fused)
        self.attn = Attention(self.num_heads, self.num_kv_heads, a.head_dim, a.head_dim**-0.5, kernels.attention)
        self.fused = kernels.fused

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        t, hd = qkv.size(0), self.head_dim
        qg, k, v = qkv.split([2 * self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd], -1)
        q, gate = qg.view(t, self.num_heads, 2 * hd).split([hd, hd], dim=-1)
        kv_heads = (t, self.num_kv_heads, hd)
        o = self.attn(positions, q, k.reshape(kv_heads), v.reshape(kv_heads), rotary, self.q_norm, self.k_norm)
        return self.o_proj(sigmoid_gate(o, gate, self.fused))


class HybridDecoderLayer(QwenDecoderLayer):
    """QwenDecoderLayer's residual wiring around a Gated DeltaNet or a gated attention mixer."""

    def __init__(self, a: Qwen35Args, i: int, quant: QuantConfig, kernels: Kernels, dtype: torch.dtype) -> None:  # type: ignore[override]
        nn.Module.__init__(self)  # the parts differ from QwenDecoderLayer's
        ckpt = f"{a.ckpt_prefix}.layers.{i}"
        self.is_linear = a.layer_types[i] == "linear_attention"
        fused = kernels.fused
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype, zero_centered=True, backend=fused)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype, zero_centered=True, backend=fused)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(a.hidden_size, a.lin_k_heads, a.lin_v_heads, a.lin_k_dim, a.lin_v_dim,
                                             a.conv_kernel, a.rms_norm_eps, quant, kernels, dtype,
                                             f"{ckpt}.linear_attn")
        else:
            self.self_attn = GatedAttention(a, quant, kernels, dtype, f"{ckpt}.self_attn")
        self.mlp = QwenMLP(a, quant, kernels, dtype, f"{ckpt}.mlp")  # type: ignore[arg-type]

    def mix_normed(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                   rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_linear:
            return self.self_attn(positions, self.input_layernorm, h, residual, rotary)
        x, residual = self.input_layernorm.pair(h, residual)
        return self.linear_attn(x), residual


class HybridModel(QwenModel):
    """QwenModel's forward over hybrid layers, zero-centred final norm and partial rotary."""

    def __init__(self, a: Qwen35Args, quant: QuantConfig, kernels: Kernels, dtype: torch.dtype) -> None:  # type: ignore[override]
        nn.Module.__init__(self)  # QwenModel's parts are built here, not by its __init__
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, dtype)
        self.layers = nn.ModuleList(HybridDecoderLayer(a, i, quant, kernels, dtype) for i in range(len(a.layer_types)))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype, zero_centered=True, backend=kernels.fused)
        self.rotary = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rotary_dim,
                                      backend=kernels.fused)


class Qwen35ForCausalLM(QwenForCausalLM):
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        **QwenForCausalLM.packed_modules, "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1)}
    lora_targets: ClassVar[dict[str, tuple[str, int]]] = {
        **QwenForCausalLM.lora_targets, "in_proj_qkv": ("in_proj_qkv", 0), "in_proj_z": ("in_proj_z", 0),
        "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1), "out_proj": ("out_proj", 0)}
    model_class: ClassVar[type[nn.Module]] = HybridModel

    @staticmethod
    def checkpoint_to_param(name: str) -> str:
        """`model.language_model.X` (vision-language layout) -> `model.X`; the DeltaNet's conv and norm
        weights are plain parameters here (`linear_attn.conv1d.weight` -> `linear_attn.conv1d`)."""
        prefix = "model.language_model."
        name = "model." + name[len(prefix):] if name.startswith(prefix) else name
        for leaf in (".linear_attn.conv1d.weight", ".linear_attn.norm.weight"):
            if name.endswith(leaf):
                return name[: -len(".weight")]
        return name
