"""xpulora engine: what the server and the CLI may use."""

from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from engine.llm_engine import GenerationResult, LLMEngine
from engine.loader import CheckpointError
from engine.protocol import RequestError, RequestOutput, SamplingParams, TokenLogprob

__all__ = [
    "CacheConfig",
    "CheckpointError",
    "ConfigError",
    "EngineConfig",
    "GenerationResult",
    "LLMEngine",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "TokenLogprob",
]
