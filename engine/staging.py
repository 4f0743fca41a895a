"""Host -> device copies that never make the host wait: a step's small inputs, index lists, sampler parameters.

On CUDA (and XPU) a copy from pageable host memory is synchronous: torch waits for the stream to drain, i.e.
for every kernel queued so far. With async scheduling the host prepares step N+1 while step N runs, so one
such copy would stall the host until step N ends. Everything a step sends goes through `upload` instead: the
values are written into page-locked memory taken from torch's caching host allocator (which keeps a block
until the copies that read it have run) and copied with non_blocking=True. On the CPU the host tensor is the
device tensor.

`Staging` lays a step's inputs of one dtype end to end and sends them in one copy (one launch instead of one
per tensor) and returns device views of each part.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.device import Device


def upload(device: Device, values: Sequence[int] | Sequence[float] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values on the device, copied without waiting for the device's queued work."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if not device.pins_memory:
        return host
    return host.pin_memory().to(device.torch_device, non_blocking=True)


class Uploader:
    """`upload` bound to one device: what the sampler, the logits processors and the LoRA batch are given."""

    def __init__(self, device: Device) -> None:
        self.device = device

    def __call__(self, values: Sequence[int] | Sequence[float] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return upload(self.device, values, dtype)


class Staging:
    def __init__(self, device: Device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype

    def send(self, parts: list[list[int]]) -> list[torch.Tensor]:
        """Device tensors holding each part (views of one buffer)."""
        out = upload(self.device, [x for p in parts for x in p], self.dtype)
        views, at = [], 0
        for p in parts:
            views.append(out[at:at + len(p)])
            at += len(p)
        return views
