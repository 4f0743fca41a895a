"""Per-request state kept by the scheduler (pure Python, no tensors)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.protocol import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_id: int | None = None
    """Internal adapter id (changes on every reload); None = base model."""
    lora_slot: int = -1
    """Device slot of the adapter while running (-1: none)."""
    state_slot: int = -1
    """Slot in the linear-attention state pool while running (hybrid models; -1: none)."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache."""
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    block_keys: list[bytes] = field(default_factory=list)
    """Prefix-cache keys of the full blocks hashed so far (they stay valid across preemption)."""
    num_cached_blocks: int = 0
    """Leading blocks of block_table that are registered in (or were hit from) the prefix cache."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache at first admission (usage.prompt_tokens_details)."""
    num_pending: int = 0
    """Tokens sampled by a launched step whose ids have not reached the host yet (async scheduling: 0 or 1)."""
    max_total: int = 1 << 62
    """num_tokens at which the sequence ends for certain (prompt + max_tokens, capped at max_model_len)."""
    arrival: float = 0.0
    """time.perf_counter() at add_core; 0.0 once its first step was launched (its queue wait is counted)."""

    @property
    def num_tokens(self) -> int:
        """Tokens known on the host: the prompt and the outputs read back so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_total(self) -> int:
        """Tokens the sequence has, pending ones included (what the scheduler plans with)."""
        return self.num_tokens + self.num_pending

    @property
    def ends_for_certain(self) -> bool:
        """Its pending token is its last one (max_tokens or max_model_len): nothing more to schedule."""
        return self.num_pending > 0 and self.num_total >= self.max_total

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
