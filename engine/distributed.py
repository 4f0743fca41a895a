"""Tensor-parallel group: rank/size and the few collectives the layers call (no-ops at tp=1)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1


_GROUP = TPGroup()


def init_tp(rank: int, size: int, backend: str, init_method: str, device_id: torch.device | None = None,
            timeout_s: float = 120.0) -> None:
    """Join the process group (size > 1) and record this process's TP coordinates.

    device_id binds the group to an accelerator (None on the CPU); engine.device decides it. The
    timeout bounds how long a collective waits for a dead peer before raising.
    """
    global _GROUP
    if size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, device_id=device_id,
                                timeout=datetime.timedelta(seconds=timeout_s))
    _GROUP = TPGroup(rank, size)


def destroy_tp() -> None:
    global _GROUP
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = TPGroup()


def tp_rank() -> int:
    return _GROUP.rank


def tp_size() -> int:
    return _GROUP.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; identity at tp=1."""
    if _GROUP.size > 1:
        dist.all_reduce(x)
    return x


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's integer (e.g. KV blocks that fit on every device); device is where
    this rank's collectives run."""
    if _GROUP.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x on every rank, in place; identity at tp=1."""
    if _GROUP.size > 1:
        dist.broadcast(x, src=0)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x along dim (rank order); identity at tp=1."""
    if _GROUP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_GROUP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
