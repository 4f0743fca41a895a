"""Gated activation of the MLP."""

from __future__ import annotations

import torch
from torch import nn

from kernels.fused import silu_and_mul


class SiluAndMul(nn.Module):
    """y = silu(x[..., :d]) * x[..., d:] for the merged gate|up output."""

    def __init__(self) -> None:
        super().__init__()
        self.backend = "reference"
        """kernels.fused backend, chosen per device by the model runner."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x, self.backend)
