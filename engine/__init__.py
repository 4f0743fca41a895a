"""xpulora engine: what the server and the CLI may use."""

from engine.async_engine import (
    AsyncEngine,
    EngineFailedError,
    EngineStats,
    OverloadedError,
    RequestStream,
)
from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    KernelConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from engine.device import DEVICE_CHOICES
from engine.kernel_check import check_device
from engine.llm_engine import GenerationResult, LLMEngine
from engine.loader import CheckpointError
from engine.lora.adapter import AdapterError, AdapterNotFoundError, AdapterPathForbiddenError, validate_name
from engine.lora.adapter_files import resolve_under_roots
from engine.lora.manager import AdapterNotLoadedError
from engine.protocol import ErrorKind, ModelNotFoundError, RequestError, RequestOutput, SamplingParams, TokenLogprob

__all__ = [
    "DEVICE_CHOICES",
    "AdapterError",
    "AdapterNotFoundError",
    "AdapterNotLoadedError",
    "AdapterPathForbiddenError",
    "AsyncEngine",
    "CacheConfig",
    "CheckpointError",
    "ConfigError",
    "EngineConfig",
    "EngineFailedError",
    "EngineStats",
    "ErrorKind",
    "GenerationResult",
    "KernelConfig",
    "LLMEngine",
    "LoRAConfig",
    "ModelConfig",
    "ModelNotFoundError",
    "OverloadedError",
    "ParallelConfig",
    "RequestError",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "SchedulerConfig",
    "TokenLogprob",
    "check_device",
    "resolve_under_roots",
    "validate_name",
]
