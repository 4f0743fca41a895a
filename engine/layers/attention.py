"""Attention over the paged KV cache: rotates this step's q and k, writes k/v, then attends (kernels chosen per
device)."""

from __future__ import annotations

import torch
from torch import nn

from engine.forward_context import AttentionMetadata, get_context
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from kernels.attention import BatchIndex, batch_index, batch_pays, paged_attention
from kernels.fused import write_kv


class _StepIndex:
    """The reference backend's gather index of the step being run (kernels.attention.batch_index): every
    attention layer of a step reads the same block tables, so it is computed by the first and reused by
    the others (keyed by the step's metadata object, made fresh for each step and held here while it is
    the key). None where the padded one-call form would cost more than the per-sequence loop."""

    memo: tuple[AttentionMetadata, BatchIndex | None] | None = None
    """(metadata, its index), replaced as one object: engines on other threads may run their steps meanwhile."""

    @classmethod
    def of(cls, meta: AttentionMetadata, block_size: int) -> BatchIndex | None:
        memo = cls.memo
        if memo is None or memo[0] is not meta:
            cu, ctx = meta.cu_q_list, meta.context_lens_list
            index = batch_index(meta.block_tables, cu, ctx, block_size) if batch_pays(cu, ctx, block_size) else None
            memo = cls.memo = (meta, index)
        return memo[1]


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: str = "reference") -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Bound by the model runner once the cache is allocated: [num_blocks, block_size, kv_heads, head_dim].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend = backend
        """Attention kernels (kernels.attention, engine.device.Kernels.attention), given when the model is built."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rotary: RotaryEmbedding, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> torch.Tensor:
        """q [T, Hq, D], k / v [T, Hkv, D] before the rotary (and the per-head norms where given) -> [T, Hq*D]."""
        ctx = get_context()
        assert ctx.attn is not None, "attention needs attention metadata"
        meta = ctx.attn
        if rotary.writes_cache:
            q = rotary.rotate_into_cache(positions, q, k, v, q_norm, k_norm, self.k_cache, self.v_cache,
                                         meta.slot_mapping)
        else:
            q, k = rotary(positions, q, k, q_norm, k_norm)
            write_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping, self.backend)
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of the rotated q [T, Hq, D] over the cache (this step's k/v already in it) -> [T, Hq*D]."""
        t = q.size(0)
        index = _StepIndex.of(meta, self.k_cache.size(1)) if self.backend == "reference" else None
        o = paged_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_q, meta.context_lens,
                            meta.cu_q_list, meta.context_lens_list, meta.max_q_len, self.scale, self.backend, index)
        return o.reshape(t, self.num_heads * self.head_dim)
