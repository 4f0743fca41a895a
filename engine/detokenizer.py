"""Turn generated token ids into text one token at a time, plus stop-string helpers.

Incremental detokenization is the tokenizers library's ``DecodeStream``: it decodes a short window of
tokens and emits only what the newest token adds, holding text back while it ends inside a UTF-8
character (a byte-level or byte-fallback token can carry part of one). The stream starts from the last
few prompt tokens as context, so decoders that depend on neighbours (SentencePiece's leading space)
give the first output token its right text. ``flush`` (the stream's end) is ours: DecodeStream has none.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context before the first output token.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text deltas for one sequence's output tokens; ``text`` is everything emitted so far."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._skip = skip_special_tokens
        self._context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._context_text = self._decode(self._context)
        if self._context_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character: its tail cannot serve as context, since the first
            # output bytes would change how it decodes.
            self._context, self._context_text = [], ""
        self._stream = DecodeStream(self._context, skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._text = ""

    @property
    def text(self) -> str:
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Feed one output token; return the text it completes ("" while a character is partial)."""
        self._ids.append(token_id)
        delta = self._stream.step(self._backend, token_id) or ""
        self._text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream: emit whatever is held back, invalid bytes as U+FFFD."""
        full = self._decode(self._context + self._ids)[len(self._context_text):]
        delta = full[len(self._text):]
        self._text += delta
        return delta


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
