"""Gated DeltaNet mixer (Qwen3.5 linear attention), split over TP ranks by heads.

Per sequence it keeps two states in a pool owned by the model runner: the last K-1 inputs of the
q|k|v channels (conv state) and the fp32 recurrent state [Hv, Dk, Dv]. The runner zeroes a sequence's
slot before its first chunk; every later chunk or decode step continues from it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.device import Kernels
from engine.distributed import tp_rank, tp_size
from engine.forward_context import get_context
from engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    SectionedColumnParallelLinear,
)
from engine.layers.quant import QuantConfig, with_skinny
from kernels.gdn import (
    causal_conv1d_decode,
    causal_conv1d_varlen,
    delta_rule_varlen,
    gated_rms_norm,
    gdn_decode_out,
    gdn_gating,
    uses_triton,
)

CHUNK_THRESHOLD = 16
"""Prompts longer than this use the chunked form of the recurrence."""


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, conv_kernel: int, eps: float,
                 quant: QuantConfig, kernels: Kernels, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        tp, rank = tp_size(), tp_rank()
        if k_heads % tp or v_heads % tp:
            raise ValueError(f"{prefix}: {k_heads} key / {v_heads} value heads cannot be split over tp={tp}")
        self.hk, self.hv, self.dk, self.dv = k_heads // tp, v_heads // tp, k_dim, v_dim
        self.kernel = conv_kernel
        self.eps = eps
        key_dim, value_dim, int4 = k_heads * k_dim, v_heads * v_dim, kernels.int4
        self.in_proj_qkv = SectionedColumnParallelLinear(
            hidden, [key_dim, key_dim, value_dim], False, quant.method_for([f"{prefix}.in_proj_qkv"], int4), dtype,
            f"{prefix}.in_proj_qkv")
        self.in_proj_z = ColumnParallelLinear(hidden, value_dim, False,
                                              quant.method_for([f"{prefix}.in_proj_z"], int4), dtype,
                                              f"{prefix}.in_proj_z")
        # 2 Hv features (5120 -> 96 on the 27B): one launch for decode rows where the GDN runs Triton
        ba = quant.method_for([f"{prefix}.in_proj_b", f"{prefix}.in_proj_a"], int4)
        self.in_proj_ba = MergedColumnParallelLinear(hidden, [v_heads, v_heads], False,
                                                     with_skinny(ba, uses_triton(kernels.gdn)), dtype,
                                                     f"{prefix}.in_proj_ba")
        self.out_proj = RowParallelLinear(value_dim, hidden, False, quant.method_for([f"{prefix}.out_proj"], int4),
                                          dtype, f"{prefix}.out_proj")
        self.sections = [key_dim, key_dim, value_dim]
        self.local_sections = [n // tp for n in self.sections]
        self.conv_dim = sum(self.local_sections)
        self.rank, self.tp = rank, tp
        self.conv1d = nn.Parameter(torch.empty(self.conv_dim, conv_kernel, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.hv, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv, dtype=torch.float32), requires_grad=False)
        self.norm = nn.Parameter(torch.empty(v_dim, dtype=dtype), requires_grad=False)
        self.conv1d.weight_loader = self._load_conv
        self.A_log.weight_loader = self._load_heads
        self.dt_bias.weight_loader = self._load_heads
        self.norm.weight_loader = self._load_replicated
        self.prefix = prefix
        # Bound by the model runner: [slots, conv_dim, K-1] and [slots, hv, dk, dv] (float32).
        self.conv_state = torch.empty(0)
        self.ssm_state = torch.empty(0)
        self.backend = kernels.gdn
        """Delta-rule kernels (kernels.gdn, engine.device.Kernels.gdn), given when the model is built."""

    # -- loaders: each shard cut by heads ----------------------------------------------------------------
    def _check(self, loaded: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
        if tuple(loaded.shape) != shape:
            raise ValueError(f"{self.prefix}.{what}: checkpoint shape {tuple(loaded.shape)}, expected {shape}")

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        self._check(loaded, (sum(self.sections), 1, self.kernel), "conv1d.weight")
        parts = loaded.squeeze(1).split(self.sections, dim=0)
        param.data.copy_(torch.cat([p.chunk(self.tp, dim=0)[self.rank] for p in parts], dim=0))

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        self._check(loaded, (self.hv * self.tp,), "A_log/dt_bias")
        param.data.copy_(loaded.chunk(self.tp)[self.rank])

    def _load_replicated(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        self._check(loaded, tuple(param.shape), "norm.weight")
        param.data.copy_(loaded)

    # -- forward -------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        meta, slots = ctx.attn, ctx.state_slots
        assert meta is not None and ctx.state_index is not None, "GDN layers need attention metadata and state slots"
        t = x.size(0)
        qkv = self.in_proj_qkv(x)
        z = self.in_proj_z(x).view(t, self.hv, self.dv)
        ab = self.in_proj_ba(x)
        # Each head's output goes through a gated RMSNorm (plain weight, norm before the silu(z) gate).
        # Decode (one token per sequence): vectorised over slots with no host sync, so graphs can hold it.
        if meta.max_q_len == 1 and t == ctx.state_index.numel():
            q, k, v = causal_conv1d_decode(qkv, self.conv_state, ctx.state_index, self.conv1d, self.backend).split(
                self.local_sections, dim=-1)
            o = gdn_decode_out(q.view(t, self.hk, self.dk), k.view(t, self.hk, self.dk), v.view(t, self.hv, self.dv),
                               ab, self.A_log, self.dt_bias, z, self.norm, self.eps, self.ssm_state, ctx.state_index,
                               x.dtype, self.backend)
        else:
            assert slots is not None
            cu = meta.cu_q_list
            g, beta = gdn_gating(ab, self.A_log, self.dt_bias, self.backend)
            q, k, v = causal_conv1d_varlen(qkv, self.conv_state, ctx.state_index, self.conv1d, cu).split(
                self.local_sections, dim=-1)
            out = delta_rule_varlen(q.view(t, self.hk, self.dk), k.view(t, self.hk, self.dk),
                                    v.view(t, self.hv, self.dv), g, beta, self.ssm_state, slots, cu, self.backend,
                                    CHUNK_THRESHOLD, ctx.state_index, meta.cu_q)
            o = gated_rms_norm(out, z, self.norm, self.eps, x.dtype, self.backend)
        return self.out_proj(o.reshape(t, self.hv * self.dv))
