"""Gated activation of the MLP."""

from __future__ import annotations

import torch
from torch import nn


class SiluAndMul(nn.Module):
    """y = silu(x[..., :d]) * x[..., d:] for the merged gate|up output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up
