"""The step's tokens grouped by adapter slot for the Triton LoRA kernels (host work, once per step), and the
host -> device copies the LoRA batches make without waiting for the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import lora_triton
from kernels.lora_triton import TokenGroups, max_blocks


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` without waiting for the device's queued work (a blocking copy from pageable
    memory synchronizes the stream): page-locked staging, non_blocking copy."""
    return host if host.device == device else host.pin_memory().to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, host: torch.Tensor) -> None:
    dst.copy_(host if host.device == dst.device else host.pin_memory(), non_blocking=True)


def check_slots(slots: torch.Tensor, num_slots: int) -> None:
    bad = (slots < -1) | (slots >= num_slots)
    if bool(bad.any()):
        raise ValueError(f"LoRA slots {sorted(set(slots[bad].tolist()))} outside [-1, {num_slots})")


def _default_block_m(num_tokens: int) -> int:
    """Tokens of one slot per program (the kernels go over them in 16-row tiles, reading the slot's weights
    from DRAM once per run). Decode steps: short runs, more programs; prefill: longer runs."""
    run = lora_triton.CONFIG_OVERRIDES.get("run_m")
    if run is not None:
        return run
    return 16 if num_tokens <= 256 else 32 if num_tokens <= 2048 else 64


def _schedule(slots: torch.Tensor, num_slots: int, block_m: int, num_blocks: int) -> torch.Tensor:
    """meta (int32, on slots' device) for int64 slots: sort by slot, count, cut each slot's run into blocks."""
    key = torch.where(slots >= 0, slots, num_slots)  # -1 sorts last, as slot S
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=slots.device)
    cnt = counts.scatter_add_(0, key, torch.ones_like(key))[:num_slots]  # bincount without a host sync
    start = torch.cumsum(cnt, 0) - cnt
    nblk = (cnt + block_m - 1) // block_m
    cum = torch.cumsum(nblk, 0)
    b = torch.arange(num_blocks, dtype=torch.long, device=slots.device)
    bslot = torch.searchsorted(cum, b, right=True)  # slot s owns blocks cum[s-1] <= b < cum[s]; S: unused
    s_c = bslot.clamp(max=num_slots - 1)
    bstart = start[s_c] + (b - (cum[s_c] - nblk[s_c])) * block_m
    bend = start[s_c] + cnt[s_c]
    return torch.cat([slots, order, start, cnt, bslot, bstart, bend]).to(torch.int32)


def group_tokens(token_slots: torch.Tensor | Sequence[int], num_slots: int, *, device: torch.device | None = None,
                 block_m: int | None = None, out: TokenGroups | None = None) -> TokenGroups:
    """The tokens sorted by slot, per-slot start/len and the M-block schedule the kernels read.

    token_slots: [T] ints in [-1, num_slots). From the host (a sequence or a CPU tensor; `device` says
    where the kernels run, default CPU) it is checked, `has_lora` is known, and the schedule is computed
    on the CPU and sent in ONE copy (a handful of tiny device ops cost more in launches). A device tensor
    is scheduled on the device with no host sync (has_lora None). With `out`, everything is written into
    out's tensor (same T, num_slots and block_m) and out is returned: what a captured graph needs.
    """
    if num_slots <= 0:
        raise ValueError(f"group_tokens: num_slots must be positive, got {num_slots}")
    if not isinstance(token_slots, torch.Tensor):
        token_slots = torch.tensor(list(token_slots), dtype=torch.long)
    if token_slots.dim() != 1:
        raise ValueError(f"group_tokens: token_slots must be 1-D, got {tuple(token_slots.shape)}")
    slots = token_slots.to(torch.long)
    dev = torch.device(device) if device is not None else (out.meta.device if out is not None else slots.device)
    t = slots.numel()
    bm = block_m or (out.block_m if out is not None else _default_block_m(t))
    nb = max_blocks(t, num_slots, bm)
    has_lora: bool | None = None
    if slots.device.type == "cpu":
        check_slots(slots, num_slots)
        has_lora = bool((slots >= 0).any())
    meta = _schedule(slots, num_slots, bm, nb)
    if out is None:
        return TokenGroups(meta=to_device(meta, dev), num_tokens=t, num_slots=num_slots, num_blocks=nb,
                           block_m=bm, has_lora=has_lora)
    if out.num_tokens != t or out.num_slots != num_slots or out.block_m != bm:
        raise ValueError(f"group_tokens(out=...): out holds T={out.num_tokens}, S={out.num_slots}, "
                         f"block_m={out.block_m}; got T={t}, S={num_slots}, block_m={bm}")
    copy_into(out.meta, meta)
    out.has_lora = has_lora
    return out
