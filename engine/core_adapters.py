"""Adapter load / unload / autoload for the engine client (engine/core_client.py), on the API side.

The core only executes an AdapterCall; what decides which calls to make lives here: the per-name locks
that serialize a load with autoload, the explicit-unload rule (DESIGN.md §6) and autoload from the
lora roots.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import AsyncIterator, Sequence

from engine.config import EngineConfig
from engine.errors import AdapterError, RequestError
from engine.lora.adapter import validate_name
from engine.lora.adapter_files import resolve_under_roots
from engine.messages import AdapterCall, Reply, Utility
from engine.served import ServedModel

log = logging.getLogger(__name__)


class AdapterCalls:
    config: EngineConfig
    served: ServedModel
    _adapters: dict[str, str]
    """The core's registry (name -> path) after its last reply."""
    _unloaded: set[str]
    """Names explicitly unloaded and not explicitly loaded since."""
    _load_locks: dict[str, tuple[asyncio.Lock, list[int]]]
    """Per adapter name (loads, autoloads), with a count of holders and waiters: dropped when the count
    returns to 0, or a churn of new names would grow this dict without bound."""
    _call_ids: itertools.count[int]

    async def _call(self, msg: AdapterCall | Utility) -> Reply:
        raise NotImplementedError

    async def load_adapter(self, name: str, path: str, roots: Sequence[str] = (), replace: bool = False) -> None:
        """Load (validated, on a thread of the core); serialized per name with autoload. roots: confine the
        load (and later re-reads) to these folders, checked on the opened files. An explicit load lifts
        an earlier explicit unload (see unload_adapter); replace swaps a loaded adapter of that name."""
        async with self._name_lock(name):
            await self._call(AdapterCall(next(self._call_ids), "load", name, path, tuple(roots), replace))
            self._unloaded.discard(name)

    async def unload_adapter(self, name: str) -> None:
        """Unregister; until an explicit load_adapter of this name, autoload does not bring it back
        (an operator who unloads an adapter to retire it expects it gone, DESIGN.md §6)."""
        if name in self.served.names:
            raise AdapterError(f"{name!r} is the base model; it cannot be unloaded")
        async with self._name_lock(name):  # not between an autoload's check and its load
            await self._call(AdapterCall(next(self._call_ids), "unload", name))
            if self._autoload_path(name) is not None:  # only names autoload could find: a bounded set
                self._unloaded.add(name)

    def _autoload_path(self, name: str) -> str | None:
        """The folder autoload would load `name` from, or None (autoload off, or no such folder)."""
        cfg = self.config.lora
        if not self.served.lora_enabled or not cfg.lora_autoload or name in self.served.names:
            return None
        try:
            validate_name(name)
            path = resolve_under_roots(name, cfg.lora_roots)
        except AdapterError:
            return None  # not a loadable name: add_request answers "model not found"
        return path if os.path.isdir(path) else None

    async def ensure_adapter(self, name: str) -> None:
        """Autoload: a model name that is not loaded but names a folder under a lora root is loaded
        once (concurrent first requests wait for the same load), unless it was explicitly unloaded."""
        if not self.served.lora_enabled or name in self._adapters or name in self._unloaded:
            return
        path = self._autoload_path(name)
        if path is None:
            return
        async with self._name_lock(name):
            if name in self._adapters or name in self._unloaded:
                return
            try:
                await self._call(AdapterCall(next(self._call_ids), "load", name, path, self.config.lora.lora_roots))
            except AdapterError as e:
                raise RequestError(f"model {name!r}: loading it from {path} failed: {e}") from e
            log.info("autoloaded adapter %r from %s", name, path)

    @contextlib.asynccontextmanager
    async def _name_lock(self, name: str) -> AsyncIterator[None]:
        lock, users = self._load_locks.setdefault(name, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._load_locks[name]
