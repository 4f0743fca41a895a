"""One engine request of an OpenAI request: a (prompt, choice) pair, what it produced so far, and what the
response reports of the choices (finish reason, usage)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine import ErrorKind, RequestOutput, SamplingParams
from server.chat_tools import ChatOutput


@dataclass
class Choice:
    """One engine request: a (prompt, choice) pair and what it produced so far."""

    index: int
    prompt_index: int
    ids: list[int]
    params: SamplingParams
    prefix: str = ""  # echoed prompt text (chat: the echoed last message)
    role: str = "assistant"  # chat: the reply's role
    text: str = ""
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_kind: ErrorKind = "internal"
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    started: bool = False  # streaming: the echo prefix was sent
    offset: int = 0  # completions text_offset of the next token
    out: ChatOutput | None = None  # chat: the reply's reasoning / tool-call split
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:{id}" (return_tokens_as_token_ids)

    def apply(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.logprobs.extend(out.new_logprobs or ())
        self.num_output_tokens = out.num_output_tokens or self.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens or self.num_cached_tokens
        if out.finished:
            self.finish_reason, self.error, self.error_kind = out.finish_reason, out.error, out.error_kind


def reported_reason(c: Choice, reason: str | None) -> str | None:
    """A reply that ends with tool calls reports "tool_calls" (OpenAI's and vLLM's reason)."""
    return "tool_calls" if reason == "stop" and c.out is not None and c.out.called else reason


def usage(choices: list[Choice]) -> dict[str, Any]:
    firsts = [c for c in choices if c.index == 0 or c.prompt_index != choices[c.index - 1].prompt_index]
    prompt = sum(len(c.ids) for c in firsts)
    completion = sum(c.num_output_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in firsts)}}
