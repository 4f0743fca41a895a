"""The interpreter's garbage-collection pauses, measured, and the start-up heap taken out of them.

A full (generation 2) collection walks every tracked object: after start-up that is the model's Python
objects, torch, triton and transformers, 10^5 or more, tens of milliseconds per collection on one core
(`gc.collect()` in an engine process on the demo model: 80 ms on the CI machine). A collection stops the
loop it runs in: in the engine core every running stream waits for it, in the API process every SSE write.
`freeze_startup_heap` moves what start-up built into the permanent generation (gc.freeze), so later full
collections walk only what serving allocated; `GcPauses` counts what collections still cost (/metrics:
`xpulora:gc_seconds`, per process).
"""

from __future__ import annotations

import gc
import time


class GcPauses:
    """Seconds and number of collections since install(), per generation (0, 1, 2), from gc.callbacks."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self.frozen_objects = 0
        """What freeze_startup_heap froze (kept: gc.get_freeze_count() walks the whole frozen list each call)."""
        self._t0 = 0.0

    def install(self) -> GcPauses:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)
        return self

    def uninstall(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.seconds[g] += time.perf_counter() - self._t0
            self.collections[g] += 1

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds)


def freeze_startup_heap() -> int:
    """Collect once, then freeze every surviving object (never collected again; start-up's objects live as
    long as the process anyway). Returns how many objects are frozen, also kept in PROCESS.frozen_objects."""
    gc.collect()
    gc.freeze()
    PROCESS.frozen_objects = gc.get_freeze_count()  # O(frozen objects): once, never per step
    return PROCESS.frozen_objects


PROCESS = GcPauses()
"""This process's pauses: installed by the server's two processes at start-up (server.app.run_server, the
engine core's core_main), read by /metrics."""
