"""RMSNorm (optionally fused with the residual add)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.fused import rms_norm


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, computed in float32; `zero_centered` uses (1 + w) (Qwen3.5 style)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32,
                 zero_centered: bool = False, backend: str = "reference") -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.backend = backend
        """kernels.fused backend (engine.device.Kernels.fused), given when the model is built."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"norm weight: checkpoint shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """normed x, or (normed x + residual, x + residual) when a residual is given."""
        y, h = self.pair(x, residual)
        return y if residual is None else (y, h)

    def pair(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed x (+ residual), x (+ residual)) whether or not a residual is given."""
        return rms_norm(x, self.weight, self.eps, self.zero_centered, residual, self.backend)
