"""Gated activation of the MLP."""

from __future__ import annotations

import torch
from torch import nn

from kernels.fused import silu_and_mul


class SiluAndMul(nn.Module):
    """y = silu(x[..., :d]) * x[..., d:] for the merged gate|up output."""

    def __init__(self, backend: str = "reference") -> None:
        super().__init__()
        self.backend = backend
        """kernels.fused backend (engine.device.Kernels.fused), given when the model is built."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x, self.backend)
