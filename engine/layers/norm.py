"""RMSNorm (optionally fused with the residual add)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, computed in float32; `zero_centered` uses (1 + w) (Qwen3.5 style)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32,
                 zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"norm weight: checkpoint shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(loaded)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        if self.zero_centered:
            w = w + 1.0
        return (xf * w).to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
