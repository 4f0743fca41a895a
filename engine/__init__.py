"""xpulora engine: what the server and the CLI may use.

The API process imports this package and must not load the model code it never runs (DESIGN.md §3): the
names that live with it (LLMEngine, check_device, DEVICE_CHOICES) are imported on first
use (`__getattr__`), everything else here is light (messages, configs, the engine client).
"""

from typing import TYPE_CHECKING, Any

from engine.config import (
    CacheConfig,
    EngineConfig,
    KernelConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from engine.core_client import EngineClient
from engine.core_stream import EngineStats, RequestStream
from engine.errors import (
    AdapterError,
    AdapterNotFoundError,
    AdapterNotLoadedError,
    AdapterPathForbiddenError,
    CheckpointError,
    ConfigError,
    EngineCoreExitedError,
    EngineFailedError,
    ModelNotFoundError,
    OverloadedError,
    RequestError,
)
from engine.gc_pauses import PROCESS as GC_PAUSES
from engine.gc_pauses import freeze_startup_heap
from engine.lora.adapter import validate_name
from engine.lora.adapter_files import resolve_under_roots
from engine.protocol import ErrorKind, GenerationResult, RequestOutput, SamplingParams, StructuredSpec, TokenLogprob
from engine.served import LoRAStats, ServedModel
from engine.structured import JSON_OPTIONS

if TYPE_CHECKING:
    from engine.device import DEVICE_CHOICES
    from engine.kernel_check import check_device
    from engine.llm_engine import LLMEngine

_LAZY = {"DEVICE_CHOICES": "engine.device", "check_device": "engine.kernel_check", "LLMEngine": "engine.llm_engine"}


def __getattr__(name: str) -> Any:
    """The heavy names, imported on first use and kept as module attributes from then on."""
    if name not in _LAZY:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "DEVICE_CHOICES",
    "GC_PAUSES",
    "JSON_OPTIONS",
    "AdapterError",
    "AdapterNotFoundError",
    "AdapterNotLoadedError",
    "AdapterPathForbiddenError",
    "CacheConfig",
    "CheckpointError",
    "ConfigError",
    "EngineClient",
    "EngineConfig",
    "EngineCoreExitedError",
    "EngineFailedError",
    "EngineStats",
    "ErrorKind",
    "GenerationResult",
    "KernelConfig",
    "LLMEngine",
    "LoRAConfig",
    "LoRAStats",
    "ModelConfig",
    "ModelNotFoundError",
    "OverloadedError",
    "ParallelConfig",
    "RequestError",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "SchedulerConfig",
    "ServedModel",
    "StructuredSpec",
    "TokenLogprob",
    "check_device",
    "freeze_startup_heap",
    "resolve_under_roots",
    "validate_name",
]
