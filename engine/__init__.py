"""xpulora engine: what the server and the CLI may use."""

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
from engine.device import DEVICE_CHOICES
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
from engine.kernel_check import check_device
from engine.llm_engine import GenerationResult, LLMEngine
from engine.lora.adapter import validate_name
from engine.lora.adapter_files import resolve_under_roots
from engine.protocol import ErrorKind, RequestOutput, SamplingParams, StructuredSpec, TokenLogprob
from engine.served import LoRAStats, ServedModel
from engine.structured import JSON_OPTIONS

__all__ = [
    "DEVICE_CHOICES",
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
    "resolve_under_roots",
    "validate_name",
]
