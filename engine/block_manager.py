"""Paged KV block allocator (pure Python) with prefix caching. A block holds block_size tokens of every layer.

Prefix caching: once a full block's KV is scheduled, the block is registered under a key chaining the
previous block's key, the adapter identity (the LoRA manager's id, new on every (re)load; 0 for the base
model) and the block's tokens. Keys are sha256 digests, so a crafted prompt cannot collide with another
prefix. Blocks are reference-counted; a hit shares a block between sequences. A freed block keeps its key
and can still be hit until it is reused: allocation takes never-cached blocks first, then cached free
blocks least recently freed first (LRU). A table is freed tail first, so a prefix loses its tail before
its head, the part more requests share.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

ROOT_KEY = b""
"""The 'previous key' of a sequence's first block."""


def block_key(parent: bytes, identity: int, tokens: list[int]) -> bytes:
    """Key of a full block: its tokens, the adapter identity and (through parent) everything before it."""
    h = hashlib.sha256(parent)
    h.update(identity.to_bytes(8, "little", signed=True))
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))
        """Free blocks without a key."""
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Free blocks that keep a key (still hittable), least recently freed first."""
        self._refs = [0] * num_blocks
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self.num_queries = 0
        """Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)."""
        self.num_hits = 0
        """Of those, tokens found cached (vLLM's prefix_cache_hits)."""

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated (cached free blocks included: they are evicted on demand)."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Extra blocks a sequence with this table needs to hold num_tokens tokens."""
        need = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, need - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_table, num_tokens) <= self.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks to block_table (in place) so that it holds num_tokens tokens."""
        n = self.blocks_needed(block_table, num_tokens)
        if n > self.num_free:
            raise RuntimeError(f"out of KV blocks: need {n}, {self.num_free} free")
        block_table.extend(self._take() for _ in range(n))

    def _take(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)
            self._drop_key(b)
        self._refs[b] = 1
        return b

    def free(self, block_table: list[int]) -> None:
        for b in reversed(block_table):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._key_of[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        block_table.clear()

    # -- prefix cache --------------------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached blocks holding the longest run of these keys from the start."""
        hit: list[int] = []
        for k in keys:
            b = self._cached.get(k)
            if b is None:
                break
            hit.append(b)
        return hit

    def num_reviving(self, blocks: list[int]) -> int:
        """How many of these cached blocks are free now (sharing them takes them off the free count)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def share(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1

    def register(self, block: int, key: bytes) -> None:
        """Make a block whose KV this step computes findable under key (a duplicate of a cached one stays
        private)."""
        if self._key_of[block] is None and key not in self._cached:
            self._key_of[block] = key
            self._cached[key] = block

    def uncache(self, blocks: list[int]) -> None:
        """Forget the keys of blocks whose KV will not be computed after all (their step did not run)."""
        for b in blocks:
            self._drop_key(b)

    def reset_cache(self) -> None:
        """Forget every key (the KV blocks were overwritten outside the scheduler)."""
        for b in list(self._evictable):
            self._free.append(b)
        self._evictable.clear()
        self._cached.clear()
        self._key_of = [None] * self.num_blocks

    def _drop_key(self, b: int) -> None:
        key = self._key_of[b]
        if key is None:
            return
        self._key_of[b] = None
        if self._cached.get(key) == b:
            del self._cached[key]
        if self._refs[b] == 0 and b in self._evictable:
            del self._evictable[b]
            self._free.append(b)
