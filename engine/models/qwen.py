"""Qwen2 / Qwen2.5 (qkv bias) and Qwen3 (q/k RMSNorm) dense decoders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from engine.device import Kernels
from engine.errors import UnsupportedModelError
from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.quant import QuantConfig
from engine.layers.rotary import RotaryEmbedding, rope_theta_of

SUPPORTED_ARCHS = ("qwen2", "qwen3")


@dataclass(frozen=True)
class QwenArgs:
    """The architecture fields this model reads from config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @staticmethod
    def from_hf(hf: dict[str, Any]) -> QwenArgs:
        mt = hf.get("model_type")
        if mt not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(f"model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}")
        if hf.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention (use_sliding_window: true) is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {hf.get('hidden_act')!r} is not supported (silu only)")
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        return QwenArgs(
            model_type=mt,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta_of(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Qwen3 has attention_bias (normally false).
            qkv_bias=True if mt == "qwen2" else bool(hf.get("attention_bias", False)),
            qk_norm=mt == "qwen3",
        )


class QKVAttention(nn.Module):
    """An attention sublayer that starts with its qkv projection (`qkv_proj`) and ends in `attend`."""

    qkv_proj: QKVParallelLinear

    def forward(self, positions: torch.Tensor, norm: RMSNorm, h: torch.Tensor, residual: torch.Tensor | None,
                rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sublayer on norm(h (+ residual)), h (+ residual)): the norm passes to the qkv projection, whose LoRA
        wrapper joins its shrink to it."""
        qkv, residual = self.qkv_proj.forward_normed(norm, h, residual)
        return self.attend(positions, qkv, rotary), residual

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        """Attention and o_proj from the qkv projection's output."""
        raise NotImplementedError


class QwenAttention(QKVAttention):
    def __init__(self, a: QwenArgs, quant: QuantConfig, kernels: Kernels, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        names = [f"{prefix}.{n}" for n in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = QKVParallelLinear(a.hidden_size, a.head_dim, a.num_heads, a.num_kv_heads, a.qkv_bias,
                                          quant.method_for(names, kernels.int4), dtype, f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(a.num_heads * a.head_dim, a.hidden_size, False,
                                        quant.method_for([f"{prefix}.o_proj"], kernels.int4), dtype, f"{prefix}.o_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = a.head_dim
        self.q_size, self.kv_size = self.num_heads * a.head_dim, self.num_kv_heads * a.head_dim
        self.attn = Attention(self.num_heads, self.num_kv_heads, a.head_dim, a.head_dim**-0.5, kernels.attention)
        self.qk_norm = a.qk_norm
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype, backend=kernels.fused)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype, backend=kernels.fused)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = qkv.size(0)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        o = self.attn(positions, q, k, v.reshape(t, self.num_kv_heads, self.head_dim), rotary, *norms)
        return self.o_proj(o)


class QwenMLP(nn.Module):
    def __init__(self, a: QwenArgs, quant: QuantConfig, kernels: Kernels, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        names = [f"{prefix}.gate_proj", f"{prefix}.up_proj"]
        self.gate_up_proj = MergedColumnParallelLinear(a.hidden_size, [a.intermediate_size] * 2, False,
                                                       quant.method_for(names, kernels.int4), dtype,
                                                       f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(a.intermediate_size, a.hidden_size, False,
                                           quant.method_for([f"{prefix}.down_proj"], kernels.int4), dtype,
                                           f"{prefix}.down_proj")
        self.act = SiluAndMul(kernels.fused)

    def forward(self, norm: RMSNorm, h: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP on norm(h (+ residual)), h (+ residual)): the norm and the activation pass to the layers after
        them, whose LoRA wrappers join their shrinks to those launches."""
        gate_up, residual = self.gate_up_proj.forward_normed(norm, h, residual)
        return self.down_proj.forward_act(self.act, gate_up), residual


class QwenDecoderLayer(nn.Module):
    def __init__(self, a: QwenArgs, quant: QuantConfig, kernels: Kernels, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype, backend=kernels.fused)
        self.self_attn = QwenAttention(a, quant, kernels, dtype, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype, backend=kernels.fused)
        self.mlp = QwenMLP(a, quant, kernels, dtype, f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.mix_normed(positions, h, residual, rotary)
        return self.mlp(self.post_attention_layernorm, h, residual)

    def mix_normed(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                   rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm (the residual add joined; the first layer has no residual yet) and the token-mixing
        sublayer (attention here; hybrid layers override it): (its output, the new residual)."""
        return self.self_attn(positions, self.input_layernorm, h, residual, rotary)


class QwenModel(nn.Module):
    def __init__(self, a: QwenArgs, quant: QuantConfig, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, dtype)
        self.layers = nn.ModuleList(
            QwenDecoderLayer(a, quant, kernels, dtype, f"model.layers.{i}") for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype, backend=kernels.fused)
        self.rotary = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, backend=kernels.fused)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, self.rotary)
        h, _ = self.norm(h, residual)
        return h


class QwenForCausalLM(nn.Module):
    """Checkpoint names map onto the fused layers through `packed_modules`."""

    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # LoRA targets: checkpoint module name -> (our layer, slice index within it).
    lora_targets: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
    }

    model_class: ClassVar[type[nn.Module]] = QwenModel

    def __init__(self, a: QwenArgs, quant: QuantConfig, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__()
        self.args = a
        self.model = self.model_class(a, quant, kernels, dtype)
        self.lm_head = ParallelLMHead(a.vocab_size, a.hidden_size, dtype)
        if a.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    @staticmethod
    def checkpoint_to_param(name: str) -> str:
        return name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)
