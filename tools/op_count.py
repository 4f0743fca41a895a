"""Counting the data-writing torch ops a piece of code dispatches (views and metadata excluded): what the slot
fill's test and benchmark compare (one multi-tensor copy against thousands of small ones)."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class CountWrites(TorchDispatchMode):
    WRITES = ("copy_", "_foreach_copy_", "zero_", "_foreach_zero_", "fill_", "index_put_", "_to_copy")

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in self.WRITES:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))
