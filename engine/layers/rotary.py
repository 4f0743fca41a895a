"""Rotary position embedding (neox layout, as Qwen uses), optionally on the first dims only."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class RopeConfigError(ValueError):
    pass


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

    def __init__(self, head_dim: int, max_positions: int, theta: float, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        xr, xpass = x[..., :rd].float(), x[..., rd:]
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        return torch.cat([out, xpass], dim=-1) if xpass.numel() else out

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
