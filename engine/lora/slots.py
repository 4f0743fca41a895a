"""Adapter slot fills off the step path: an adapter packed once, copied into a device slot in a few ops.

An adapter enters a slot many times over its life in the host cache (slots are LRU-evicted while it
stays cached). `pack_adapter` lays its tensors out once, as the wrappers' slot blocks hold them (each
wrapper says how: engine.lora.layers), in ONE host buffer, pinned where the device pins memory. A fill
(`SlotFiller.fill`) then writes every block's rows with one host-to-device copy per staging window (the
packed bytes, non_blocking from pinned memory) and a multi-tensor device copy from the staging buffer
into the slot views; rows a previous occupant wrote past the new adapter's are zeroed by one multi-tensor
zero. Nothing waits for the device: every op is queued on the current stream after the step that may
still read the slot, and the pinned source stays alive (the host allocator keeps a block until the copies
that read it are done), so the host goes on preparing the next step.

The manager never sees this layout and the wrappers never see adapter names: the model runner keeps the
packed form beside the adapter it was made from (engine.model_runner).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.lora.adapter import LoRAModule
    from engine.lora.layers import BaseLayerWithLoRA, PackedLayer

_ALIGN = 16
STAGING_BYTES = 64 * 2**20
"""Device staging window: larger adapters are copied in several windows through the same buffer."""


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class AdapterPack:
    """An adapter's tensors for one set of wrappers (one TP rank's), ready to copy into any slot."""

    flat: torch.Tensor
    """uint8 host buffer holding every part (pinned when the device pins memory)."""
    layers: list[PackedLayer]
    """One per wrapper, in the wrappers' order; their parts are views of `flat`."""

    @property
    def nbytes(self) -> int:
        return self.flat.numel()


def pack_adapter(wrappers: Sequence[BaseLayerWithLoRA], modules: Mapping[str, LoRAModule],
                 pin: bool) -> AdapterPack:
    """Lay the adapter out for `wrappers` in one (pinned if `pin`) host buffer: host work, once per adapter."""
    rows = [w.pack_rows(modules) for w in wrappers]
    total = 0
    for w, rs in zip(wrappers, rows):
        for r, blk in zip(rs, w.blocks):
            total += _aligned(r * blk.size(-1) * blk.element_size())
    flat = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)
    layers, at = [], 0
    for w, rs in zip(wrappers, rows):
        parts = []
        for r, blk in zip(rs, w.blocks):
            nb = r * blk.size(-1) * blk.element_size()
            parts.append(flat[at:at + nb].view(blk.dtype).view(r, blk.size(-1)))
            at += _aligned(nb)
        layers.append(w.pack_into(modules, parts))
    return AdapterPack(flat, layers)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def run_copies(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], zeros: Sequence[torch.Tensor]) -> None:
    """dst.copy_(src) for every pair and zero_() every view, as multi-tensor ops (one or a few launches on a
    GPU when the sources are on the device; per-tensor copies otherwise)."""
    if zeros:
        torch._foreach_zero_([_bytes(z) for z in zeros])
    if pairs:
        torch._foreach_copy_([_bytes(d) for d, _ in pairs], [_bytes(s) for _, s in pairs])


class SlotFiller:
    """Fills and clears one slot of every wrapped layer at once (the model runner's only way in)."""

    def __init__(self, wrappers: Sequence[BaseLayerWithLoRA], device: torch.device, pins_memory: bool,
                 staged: bool | None = None, staging_bytes: int = STAGING_BYTES) -> None:
        """pins_memory: Device.pins_memory (packs are pinned). staged (default: pins_memory, i.e. a GPU): copy
        through a device staging buffer; without, the host is the device and parts are copied directly."""
        self.wrappers = list(wrappers)
        self.pins_memory = pins_memory
        self.staging: torch.Tensor | None = None
        """Device buffer the packed bytes land in before the device-side copies (None: direct copies)."""
        if (pins_memory if staged is None else staged) and self.wrappers:
            per_slot = [blk[0].numel() * blk.element_size() for w in self.wrappers for blk in w.blocks]
            size = min(sum(_aligned(b) for b in per_slot), max(staging_bytes, max(per_slot)))
            self.staging = torch.empty(size, dtype=torch.uint8, device=device)
        self.num_copy_ops = 0
        """Host->device copies issued so far (statistics for benchmarks)."""

    def pack(self, modules: Mapping[str, LoRAModule]) -> AdapterPack:
        return pack_adapter(self.wrappers, modules, self.pins_memory)

    def fill(self, slot: int, pack: AdapterPack) -> None:
        """Write `pack` into `slot` of every wrapper; queued on the current stream, no host wait."""
        if len(pack.layers) != len(self.wrappers):
            raise ValueError(f"adapter packed for {len(pack.layers)} layers, the model has {len(self.wrappers)}")
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        zeros: list[torch.Tensor] = []
        for w, packed in zip(self.wrappers, pack.layers):
            p, z = w.slot_copies(slot, packed)
            pairs += p
            zeros += z
        if zeros:
            torch._foreach_zero_([_bytes(t) for t in zeros])
        if self.staging is None:
            run_copies(pairs, ())
            return
        self._staged(pack.flat, pairs)

    def _staged(self, flat: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy the packed bytes in windows of the staging buffer, each window: one host->device copy of a
        contiguous range of `flat`, then one multi-tensor copy from staging into the slot views."""
        assert self.staging is not None
        base, cap = flat.data_ptr(), self.staging.numel()
        spans = sorted(((s.data_ptr() - base, s.numel() * s.element_size(), d) for d, s in pairs), key=lambda t: t[0])
        i = 0
        while i < len(spans):
            lo = spans[i][0]
            j = i
            while j < len(spans) and spans[j][0] + spans[j][1] - lo <= cap:
                j += 1
            if j == i:
                raise ValueError(f"a packed part of {spans[i][1]} bytes exceeds the staging buffer ({cap} bytes)")
            hi = spans[j - 1][0] + spans[j - 1][1]
            self.staging[:hi - lo].copy_(flat[lo:hi], non_blocking=True)
            self.num_copy_ops += 1
            torch._foreach_copy_([_bytes(d) for _, _, d in spans[i:j]],
                                 [self.staging[o - lo:o - lo + nb] for o, nb, _ in spans[i:j]])
            i = j

    def clear(self, slot: int) -> None:
        for w in self.wrappers:
            w.clear_slot(slot)
