"""Turn generated token ids into text one token at a time, plus stop-string helpers.

Incremental detokenization (the idea serving engines share, e.g. vLLM's and TGI's): keep two offsets
into the token list. ``prefix_offset..read_offset`` is a short window of tokens whose text was
already emitted; ``prefix_offset..end`` is that window plus the tokens not emitted yet. Decode both;
the new text is what the longer one adds. A byte-level BPE token may hold only part of a UTF-8
character, which decodes to U+FFFD; while the longer text ends with U+FFFD, emit nothing and wait for
the bytes that complete it. Decoding a few tokens of context (instead of one token alone) also keeps
decoders that depend on neighbours (SentencePiece's leading space) right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context before the first output token.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text deltas for one sequence's output tokens; ``text`` is everything emitted so far."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._decode = _make_decoder(tokenizer, skip_special_tokens)
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character: its tail cannot serve as context, since the first
            # output bytes would change how it decodes.
            self._ids, self._read_offset, self._prefix_text = [], 0, ""
        self._text = ""

    @property
    def text(self) -> str:
        return self._text

    def add(self, token_id: int) -> str:
        """Feed one output token; return the text it completes ("" while a character is partial)."""
        self._ids.append(token_id)
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT):
            # Nothing visible yet (a skipped special token) or a character still incomplete.
            return ""
        delta = new_text[len(self._prefix_text) :]
        # Slide the window: what was unread becomes the context for the next token.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream: emit whatever is held back, invalid bytes as U+FFFD."""
        if self._read_offset == len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset :])
        if delta:
            self._text += delta
        return delta


def _make_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The Rust decoder directly: what tokenizer.decode does for a fast tokenizer, minus the
        # Python overhead and the whole-text space clean-up (wrong on windows).
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def find_stop(text: str, stops: Sequence[str], start: int, floor: int = 0) -> int | None:
    """Earliest index where a stop string begins, searching only where a new match can be.

    ``start`` is where the newly added text begins; a stop that ends in it may begin up to
    ``len(stop) - 1`` characters earlier, so the search starts at ``start - max_len + 1`` (>= 0).
    A match must also end beyond ``floor`` (text never checked before, e.g. under min_tokens).
    """
    if not stops:
        return None
    lo = max(start - max(len(s) for s in stops) + 1, 0)
    best: int | None = None
    for s in stops:
        i = text.find(s, max(lo, floor - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters could be the start of a stop string (hold them back when streaming)."""
    hold = 0
    for s in stops:
        # Only proper prefixes: a whole stop string is find_stop's business.
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold
