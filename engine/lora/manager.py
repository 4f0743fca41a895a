"""Adapter registry, host LRU cache and device-slot bookkeeping (pure Python + CPU tensors).

- Names map to internal ids; every (re)load gets a new id, so nothing kept under an old id (slot
  contents, cached state) is reused by a same-name reload.
- Host cache: at most `max_cpu_loras` adapters keep their tensors in memory (LRU); an evicted one is
  re-read from disk when it next needs a slot (confined to the roots it was loaded under), and refused,
  before anything is parsed, if its files' bytes are not the ones loaded.
- Device slots: `max_loras`, LRU, refcounted by running sequences, pinnable. A slot is only reused
  when no running sequence holds it.
- Unload removes the name at once; the adapter lives on until its last request ends.
Load/unload come from server threads while the engine steps: one lock guards all state.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from engine.config import LoRAConfig
from engine.errors import AdapterError, AdapterNotLoadedError, ModelNotFoundError
from engine.lora.adapter import Fingerprint, LoRAAdapter, load_adapter


@dataclass
class _Entry:
    id: int
    name: str
    path: str
    fingerprint: Fingerprint
    roots: tuple[str, ...]
    """The --lora-root folders a runtime load was confined to (re-reads are too); () for startup loads."""
    pinned: bool = False
    users: int = 0
    """Sequences (waiting or running) that use this adapter."""
    slot_refs: int = 0
    """Running sequences holding its slot."""
    registered: bool = True
    """False after unload; the entry goes away with its last user."""


class LoRAManager:
    def __init__(self, config: LoRAConfig, target_shapes: Mapping[str, tuple[int, int]],
                 prepare: Callable[[LoRAAdapter], object] | None = None) -> None:
        """prepare: called with every adapter read from disk before it enters the host cache, on the reading
        thread (the model runner's prepare_lora: the slot-ready packed form is made there, not in a step)."""
        self.config = config
        self.target_shapes = dict(target_shapes)
        self.prepare = prepare
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._by_name: dict[str, _Entry] = {}
        self._by_id: dict[int, _Entry] = {}
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._slots: list[int | None] = [None] * config.max_loras
        self._slot_lru: OrderedDict[int, None] = OrderedDict()  # slot -> None, least recent first
        self.num_loads = self.num_unloads = self.num_evictions = 0

    # -- registry ------------------------------------------------------------------------------------
    def load(self, name: str, path: str, pin: bool = False, roots: Sequence[str] = (), replace: bool = False) -> int:
        """Validate and register; raises AdapterError (nothing registered, nothing replaced) on any problem.
        roots: the folders the adapter must lie in (runtime loads), checked on the opened files. replace: an
        adapter already registered under `name` is unregistered (as by unload) once the new one has loaded,
        in one step under the lock; the new one gets a new id."""
        with self._lock:
            if name in self._by_name and not replace:
                raise AdapterError(f"adapter {name!r} is already loaded; unload it first")
        adapter = load_adapter(name, path, self.target_shapes, self.config.max_lora_rank, roots)  # slow, unlocked
        if self.prepare is not None:
            self.prepare(adapter)
        with self._lock:
            if name in self._by_name:
                if not replace:
                    raise AdapterError(f"adapter {name!r} is already loaded; unload it first")
                self.unload(name)
            e = _Entry(next(self._ids), name, adapter.path, adapter.fingerprint, tuple(roots), pinned=pin)
            self._by_name[name] = e
            self._by_id[e.id] = e
            self._cache(e.id, adapter)
            self.num_loads += 1
            return e.id

    def unload(self, name: str) -> None:
        with self._lock:
            e = self._by_name.pop(name, None)
            if e is None:
                raise AdapterNotLoadedError(f"adapter {name!r} is not loaded")
            e.registered = False
            self.num_unloads += 1
            self._maybe_drop(e)

    def resolve(self, name: str) -> int | None:
        with self._lock:
            e = self._by_name.get(name)
            return e.id if e is not None else None

    def list_adapters(self) -> list[tuple[str, str, int]]:
        """(name, path, id) of every registered adapter, in load order."""
        with self._lock:
            return [(e.name, e.path, e.id) for e in self._by_name.values()]

    def name_of(self, adapter_id: int) -> str | None:
        with self._lock:
            e = self._by_id.get(adapter_id)
            return e.name if e is not None else None

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._by_name

    # -- users (requests) -----------------------------------------------------------------------------
    def add_user(self, adapter_id: int) -> None:
        """Raises ModelNotFoundError (HTTP 404) if the adapter was unloaded since the caller resolved its
        name: an unload on a server thread can fall between resolve() and this call in the step thread
        (a KeyError here used to kill the step loop)."""
        with self._lock:
            e = self._by_id.get(adapter_id)
            if e is None or not e.registered:
                raise ModelNotFoundError(f"model {e.name!r} was unloaded" if e else "the adapter was unloaded")
            e.users += 1

    def remove_user(self, adapter_id: int) -> None:
        with self._lock:
            e = self._by_id[adapter_id]
            e.users -= 1
            self._maybe_drop(e)

    def _maybe_drop(self, e: _Entry) -> None:
        if e.registered or e.users > 0 or e.slot_refs > 0:
            return
        self._by_id.pop(e.id, None)
        self._host.pop(e.id, None)
        for s, held in enumerate(self._slots):
            if held == e.id:
                self._slots[s] = None
                self._slot_lru.pop(s, None)

    # -- host cache ------------------------------------------------------------------------------------
    def _cache(self, adapter_id: int, adapter: LoRAAdapter) -> None:
        self._host[adapter_id] = adapter
        self._host.move_to_end(adapter_id)
        while len(self._host) > self.config.cpu_cache_size:
            self._host.popitem(last=False)

    def adapter(self, adapter_id: int) -> LoRAAdapter:
        """The adapter's tensors, from the host cache or re-read (and checked unchanged) from disk."""
        with self._lock:
            e = self._by_id[adapter_id]
            hit = self._host.get(adapter_id)
            if hit is not None:
                self._host.move_to_end(adapter_id)
                return hit
        # Re-read through the same confined reader; it compares the size, then the checksum of the raw
        # bytes, with what was loaded before it parses anything (the config was validated at load).
        try:
            adapter = load_adapter(e.name, e.path, self.target_shapes, self.config.max_lora_rank, e.roots,
                                   expect=e.fingerprint)
        except AdapterError as err:
            raise type(err)(f"{err}; the adapter cannot be re-read from disk: unload and load it again") from None
        if self.prepare is not None:
            self.prepare(adapter)
        with self._lock:
            self._cache(adapter_id, adapter)
        return adapter

    # -- device slots (scheduler) ------------------------------------------------------------------------
    def slot_of(self, adapter_id: int) -> int | None:
        with self._lock:
            for s, held in enumerate(self._slots):
                if held == adapter_id:
                    return s
            return None

    def acquire_slot(self, adapter_id: int) -> tuple[int, bool] | None:
        """(slot, needs_load) for a sequence starting to run, or None if every slot is busy."""
        with self._lock:
            e = self._by_id[adapter_id]
            slot = self.slot_of(adapter_id)
            needs_load = False
            if slot is None:
                slot = self._free_slot()
                if slot is None:
                    return None
                self._slots[slot] = adapter_id
                needs_load = True
            e.slot_refs += 1
            self._slot_lru.pop(slot, None)
            self._slot_lru[slot] = None
            return slot, needs_load

    def _free_slot(self) -> int | None:
        for s, held in enumerate(self._slots):
            if held is None:
                return s
        for s in self._slot_lru:  # least recently used first
            held = self._slots[s]
            e = self._by_id.get(held) if held is not None else None
            if e is None or (e.slot_refs == 0 and not e.pinned):
                self._slots[s] = None
                self.num_evictions += 1
                return s
        return None

    def release_slot(self, adapter_id: int) -> None:
        with self._lock:
            e = self._by_id[adapter_id]
            e.slot_refs -= 1
            self._maybe_drop(e)

    def forget_slot(self, slot: int) -> None:
        """The slot's contents are unknown (a failed copy): never treat it as holding its adapter."""
        with self._lock:
            self._slots[slot] = None
            self._slot_lru.pop(slot, None)

    def slots_snapshot(self) -> list[int | None]:
        with self._lock:
            return list(self._slots)
