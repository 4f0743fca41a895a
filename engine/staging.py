"""A step's small integer inputs, sent to the device in one copy per dtype.

The model runner lays a step's inputs (token ids, positions, block tables ...) end to end in one host
list per dtype; `send` writes it into a preallocated host buffer (pinned on GPUs, so the copy is
asynchronous and the host goes on preparing while it runs) and returns device views of each part.
One copy instead of one per tensor: on a GPU each small copy costs a launch and, from pageable memory,
a host wait.
"""

from __future__ import annotations

import torch

from engine.device import Device


class Staging:
    def __init__(self, device: Device, dtype: torch.dtype, capacity: int = 4096) -> None:
        self.device, self.dtype = device, dtype
        self.host = torch.empty(capacity, dtype=dtype, pin_memory=device.pins_memory)
        self._event = device.new_event()
        self._pending = False
        """A copy out of `host` may still be queued: wait for it before writing `host` again (ranks > 0 never
        read results back, so nothing else orders their steps' copies)."""

    def send(self, parts: list[list[int]]) -> list[torch.Tensor]:
        """Device tensors holding each part (views of one buffer)."""
        flat = [x for p in parts for x in p]
        n = len(flat)
        src = torch.tensor(flat, dtype=self.dtype)
        if not self.device.pins_memory:
            out = src  # the host is the device: the tensors are already where the model runs
        else:
            if self._pending and self._event is not None:
                self._event.synchronize()  # type: ignore[attr-defined]
            if n > self.host.numel():
                self.host = torch.empty(max(n, 2 * self.host.numel()), dtype=self.dtype, pin_memory=True)
                self._pending = False  # the old buffer may still be read by its copy; it is not reused
            self.host[:n].copy_(src)
            out = torch.empty(n, dtype=self.dtype, device=self.device.torch_device)
            out.copy_(self.host[:n], non_blocking=True)
            if self._event is not None:
                self._event.record()  # type: ignore[attr-defined]
                self._pending = True
        views, at = [], 0
        for p in parts:
            views.append(out[at:at + len(p)])
            at += len(p)
        return views
