"""A module imported on its first attribute read: for modules whose light parts the API process imports
(device names, grammar compiling, adapter names and paths) while their other parts need torch, which the
API process never loads (DESIGN.md §3; tests/e2e/test_core_process.py checks a running server).

    if TYPE_CHECKING:
        import torch
    else:
        torch = LazyModule("torch")

Every attribute read is kept on the stand-in, so after the first one a read is a plain attribute lookup.
Only for attribute use inside functions: a module-level `torch.x` would import torch at import time again.
"""

from __future__ import annotations

import importlib
import types
from typing import Any


class LazyModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        value = getattr(importlib.import_module(self.__name__), attr)
        setattr(self, attr, value)
        return value
