"""Plain messages between the server, the engine and the workers (no tensors, no devices)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from engine.errors import RequestError

FinishReason = Literal["stop", "length", "abort", "error"]
ErrorKind = Literal["internal", "adapter"]
"""Why a request ended in "error": an engine fault, or its adapter's files (unreadable, changed on disk)."""
StructuredKind = Literal["json", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredSpec:
    """What a request's output must match (a plain value: it travels in SamplingParams)."""

    kind: StructuredKind
    """json: a JSON schema; regex; choice: one of a JSON list of strings; grammar: Lark (llguidance's
    dialect, %json allowed) or GBNF."""
    text: str
    """The schema / regex / JSON list / grammar source."""
    start_after: int | None = None
    """A token id (the reasoning end, `</think>`): the output is free until it appears, then constrained.
    None: constrained from the first token."""


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
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's, in [0, 1]; 0 is off."""
    repetition_penalty: float = 1.0
    """> 0; tokens seen in the prompt or the output get positive logits divided by it, negative ones
    multiplied (1 is off)."""
    presence_penalty: float = 0.0
    """In [-2, 2]; subtracted once from the logit of every token already in the output."""
    frequency_penalty: float = 0.0
    """In [-2, 2]; subtracted from a token's logit once per time it is already in the output."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before the penalties; bias in [-100, 100]."""
    seed: int | None = None
    """Per-request seed: the same seed, prompt and params give the same tokens."""
    stop: tuple[str, ...] = ()
    """Stop strings; the output ends before the first one and does not contain it."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the output (the EOS ids always do unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating past the EOS ids (stop_token_ids still end the output)."""
    min_tokens: int = 0
    """EOS and stop_token_ids are masked out, and stop strings not checked, until this many tokens exist."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string (or the stop token's text) at the end of the output."""
    logprobs: int | None = None
    """None: no logprobs. N >= 0: the chosen token's logprob plus the N most likely."""
    prompt_logprobs: bool = False
    """Reserved; echo with logprobs needs it. Not supported yet."""
    skip_special_tokens: bool = True
    """Leave special tokens (e.g. <|endoftext|>) out of the text."""
    structured: StructuredSpec | None = None
    """The output must match this grammar (engine/structured.py); None: free."""

    def validate(self, max_logprobs: int = 20, vocab_size: int | None = None) -> None:
        """Raise RequestError naming the first bad field (vLLM's ranges); vocab_size bounds the token ids."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0):
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (0.0 < self.repetition_penalty < math.inf):
            raise RequestError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (-2.0 <= v <= 2.0):
                raise RequestError(f"{name} must be in [-2, 2], got {v!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise RequestError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens!r}")
        if self.min_tokens and self.structured is not None:
            # A grammar that completes before min_tokens would leave no allowed token (EOS masked).
            raise RequestError("min_tokens cannot be combined with structured output (response_format, "
                               "structured_outputs, or a forced tool call)")
        if self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                               f"got {self.min_tokens}")
        for tid, bias in self.logit_bias:
            if not (-100.0 <= bias <= 100.0):
                raise RequestError(f"logit_bias value for token {tid} must be in [-100, 100], got {bias!r}")
        if vocab_size is not None:
            for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
                bad = [t for t in ids if not 0 <= t < vocab_size]
                if bad:
                    raise RequestError(f"{name} has out-of-vocabulary token id(s) {bad[:8]} "
                                       f"(the vocabulary is [0, {vocab_size}))")
        if self.logprobs is not None and not (0 <= self.logprobs <= max_logprobs):
            raise RequestError(f"logprobs must be between 0 and {max_logprobs}, got {self.logprobs!r}")
        if self.prompt_logprobs:
            raise RequestError("prompt_logprobs is not supported")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_history(self) -> bool:
        """The penalties need the tokens seen so far (the runner keeps them on the device)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def ends_with(self, token: int, num_output_tokens: int, eos_ids: frozenset[int]) -> bool:
        """Whether `token`, the num_output_tokens-th of the output, ends it as vLLM does: EOS (unless
        ignore_eos) or a stop_token_id, and only after the first min_tokens tokens (the sampler masks them
        before). The core finishes the request on it; the output processor leaves its text out unless
        include_stop_str_in_output."""
        return num_output_tokens > self.min_tokens and (
            (not self.ignore_eos and token in eos_ids) or token in self.stop_token_ids)

    @property
    def uses_processors(self) -> bool:
        """Anything beyond temperature / top-k / top-p / min-p touches the logits."""
        return self.uses_history or bool(self.logit_bias) or self.min_tokens > 0


@dataclass
class TokenLogprob:
    """Logprob of one generated token and the top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationResult:
    """One finished request (offline API)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    error: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""


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
    error_kind: ErrorKind = "internal"
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens)."""
