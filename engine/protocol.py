"""Plain messages between the server, the engine and the workers (no tensors, no devices)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


class RequestError(ValueError):
    """A request the engine refuses; the message is meant for the client (HTTP 400)."""


class ModelNotFoundError(RequestError):
    """The request names a model that is neither the base nor a loaded adapter (HTTP 404)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request."""

    max_tokens: int = 16
    """Tokens to generate at most (>= 1)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    seed: int | None = None
    """Per-request seed: the same seed, prompt and params give the same tokens."""
    stop: tuple[str, ...] = ()
    """Stop strings; the output ends before the first one and does not contain it."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the output (the EOS ids always do unless ignore_eos)."""
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: no logprobs. N >= 0: the chosen token's logprob plus the N most likely."""
    prompt_logprobs: bool = False
    """Reserved; echo with logprobs needs it. Not supported yet."""
    skip_special_tokens: bool = True

    def validate(self, max_logprobs: int = 20) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0):
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        if self.logprobs is not None and not (0 <= self.logprobs <= max_logprobs):
            raise RequestError(f"logprobs must be between 0 and {max_logprobs}, got {self.logprobs!r}")
        if self.prompt_logprobs:
            raise RequestError("prompt_logprobs is not supported")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class TokenLogprob:
    """Logprob of one generated token and the top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What the engine reports for one request after a step (deltas since the last report)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: FinishReason | None = None
    prompt_token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens)."""
