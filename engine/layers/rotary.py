"""Rotary position embedding (neox layout, as Qwen uses), optionally on the first dims only."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.errors import RopeConfigError
from engine.layers.norm import RMSNorm
from kernels.fused import norm_rope, rope_write_kv
from kernels.reference import qk_norm_rope, rope_tables


def rope_theta_of(hf: dict[str, Any]) -> float:
    """rope_theta from either the classic field or transformers 5's rope_parameters."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rtype = params.get("rope_type", params.get("type")) or scaling.get("rope_type", scaling.get("type")) or "default"
    if rtype != "default":
        raise RopeConfigError(f"rope type {rtype!r} is not supported yet (only the default RoPE)")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise RopeConfigError("config.json has neither rope_theta nor rope_parameters.rope_theta")
    return float(theta)


class RotaryEmbedding(nn.Module):
    """q, k [T, heads, head_dim] rotated at `positions` [T]; the cos/sin table is built once in float32."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, rotary_dim: int | None = None,
                 backend: str = "reference") -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
        self.backend = backend
        """kernels.fused backend (engine.device.Kernels.fused), given when the model is built."""
        self._step: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None
        """(positions, rope_tables of them): the reference backend gathers a step's cos / sin once for all
        its layers (this module is shared by them; a step's positions tensor is made fresh for it)."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm | None = None,
                k_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated q and k, each first RMS-normed per head by q_norm / k_norm where given (Qwen3's query/key
        norms), in torch ops: the attention layer's path where the backend has no joint op (writes_cache). q and
        k in one pass over their heads side by side (kernels.reference.qk_norm_rope), the results views of one
        tensor: a CPU step is op-bound, and this is 7 ops where two norm_rope calls are ~30."""
        same_norms = (q_norm is None) == (k_norm is None) and (
            q_norm is None or (q_norm.eps == k_norm.eps and q_norm.zero_centered == k_norm.zero_centered))  # type: ignore[union-attr]
        if not same_norms or q.size(-1) != k.size(-1):
            return self._apply(positions, q, q_norm), self._apply(positions, k, k_norm)
        step = self._step
        if step is None or step[0] is not positions:
            step = self._step = (positions, rope_tables(self.cos_sin, positions))
        return qk_norm_rope(q, k, step[1], self.rotary_dim, None if q_norm is None else q_norm.weight,
                            None if k_norm is None else k_norm.weight, q_norm.eps if q_norm is not None else 0.0,
                            q_norm.zero_centered if q_norm is not None else False)

    def _apply(self, positions: torch.Tensor, x: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        w, eps, zero_centered = (norm.weight, norm.eps, norm.zero_centered) if norm is not None else (None, 0.0, False)
        return norm_rope(x, positions, self.cos_sin, self.rotary_dim, w, eps, zero_centered)

    @property
    def writes_cache(self) -> bool:
        """Whether rotate_into_cache is one op here (Triton: one launch for the layer's rotary and cache write);
        else the attention layer rotates (forward), then writes the cache."""
        return self.backend == "triton"

    def rotate_into_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          q_norm: RMSNorm | None, k_norm: RMSNorm | None, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """forward's rotated q; the rotated k and v written into the caches at slot_mapping instead of returned."""
        if (q_norm is None) != (k_norm is None) or (q_norm is not None and k_norm is not None and (
                q_norm.eps != k_norm.eps or q_norm.zero_centered != k_norm.zero_centered)):
            raise ValueError("rotate_into_cache: q and k norms must both be given, with one eps and form, or neither")
        w_q, w_k = (None, None) if q_norm is None or k_norm is None else (q_norm.weight, k_norm.weight)
        eps, zero_centered = (q_norm.eps, q_norm.zero_centered) if q_norm is not None else (0.0, False)
        return rope_write_kv(q, k, v, positions, self.cos_sin, self.rotary_dim, w_q, w_k, eps, zero_centered,
                             k_cache, v_cache, slot_mapping, self.backend)
