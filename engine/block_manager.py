"""Paged KV block allocator (pure Python). A block holds block_size tokens of every layer."""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Extra blocks a sequence with this table needs to hold num_tokens tokens."""
        need = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, need - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_table, num_tokens) <= len(self._free)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks to block_table (in place) so that it holds num_tokens tokens."""
        n = self.blocks_needed(block_table, num_tokens)
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {n}, {len(self._free)} free")
        block_table.extend(self._free.popleft() for _ in range(n))

    def free(self, block_table: list[int]) -> None:
        self._free.extend(block_table)
        block_table.clear()
