"""Which linear-attention state snapshots a hybrid model keeps for prefix caching (pure Python; the model
runner holds the tensors).

A prefix-cache hit on a hybrid model needs, besides the attention KV blocks, the Gated DeltaNet conv and
recurrent state after the reused prefix. The scheduler ends prompt chunks on multiples of the snapshot
interval and asks for a snapshot there; the runner copies the sequence's state into the snapshot slot
after the step. A snapshot is keyed like the KV block that ends at its point (tokens, adapter identity and
everything before), so it is only found by a sequence with the same prefix under the same identity. A
snapshot becomes findable only after its step ran (commit): unlike a KV block, it cannot be shared within
the step that computes it. Slots are reused least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict


class SnapshotPool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._ready: OrderedDict[bytes, int] = OrderedDict()
        """key -> slot of snapshots whose step ran, least recently used first."""
        self._pending: dict[bytes, tuple[int, int]] = {}
        """key -> (slot, seq_id) of snapshots the scheduled step will take."""
        self._free = list(range(num_slots - 1, -1, -1))

    def find(self, key: bytes) -> int | None:
        slot = self._ready.get(key)
        if slot is not None:
            self._ready.move_to_end(key)
        return slot

    def reserve(self, key: bytes, seq_id: int) -> int:
        """A slot for a snapshot at this key taken by the coming step (-1: already kept, or no slot)."""
        if key in self._ready or key in self._pending:
            return -1
        if self._free:
            slot = self._free.pop()
        elif self._ready:
            _, slot = self._ready.popitem(last=False)  # a restore from it in this step runs before the save
        else:
            return -1
        self._pending[key] = (slot, seq_id)
        return slot

    def commit(self) -> None:
        """The step ran: its snapshots are findable."""
        for key, (slot, _) in self._pending.items():
            self._ready[key] = slot
        self._pending.clear()

    def abandon(self, seq_ids: set[int]) -> None:
        """These sequences' part of the step will not run: their snapshots are not taken."""
        for key, (slot, sid) in list(self._pending.items()):
            if sid in seq_ids:
                del self._pending[key]
                self._free.append(slot)

    def clear(self) -> None:
        self._free.extend(self._ready.values())
        self._ready.clear()
