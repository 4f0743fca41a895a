"""Token strings, token bytes and OpenAI logprobs objects (completions and chat flavours)."""

from __future__ import annotations

import math
from typing import Any

from tokenizers import decoders
from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte <-> character table

from engine import TokenLogprob

_FLOOR = -9999.0  # JSON has no -Infinity; what vLLM sends for an impossible token


def _lp(v: float) -> float:
    return v if math.isfinite(v) else _FLOOR


class TokenText:
    """Per-token strings and bytes for one tokenizer (cached; used on the event loop thread only)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        byte_level = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
        self._byte_of = {c: b for b, c in bytes_to_unicode().items()} if byte_level else None
        self._special = set(getattr(tokenizer, "all_special_tokens", ()))
        self._str: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        s = self._str.get(token_id)
        if s is None:
            s = self._str[token_id] = self.tok.decode([token_id])
        return s

    def bytes(self, token_id: int) -> list[int]:
        """The token's exact UTF-8 bytes (a byte-level token may hold part of a character)."""
        b = self._bytes.get(token_id)
        if b is None:
            piece = self.tok.convert_ids_to_tokens(token_id)
            if self._byte_of is not None and isinstance(piece, str) and piece not in self._special \
                    and all(c in self._byte_of for c in piece):
                b = [self._byte_of[c] for c in piece]
            else:
                b = list(self.text(token_id).encode("utf-8"))
            self._bytes[token_id] = b
        return b

    def name(self, token_id: int, as_id: bool) -> str:
        """How logprobs name a token: its text, or "token_id:{id}" (vLLM's return_tokens_as_token_ids: tokens
        whose text is empty or shared by several ids stay distinguishable)."""
        return f"token_id:{token_id}" if as_id else self.text(token_id)

    def completion(self, lps: list[TokenLogprob], offset: int, as_ids: bool = False
                   ) -> tuple[dict[str, list[Any]], int]:
        """Completions logprobs for these tokens; text_offset counts from `offset` (in text, whatever names the
        tokens). Returns the next offset."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            s = self.text(lp.token_id)
            name = self.name(lp.token_id, as_ids)
            top = {self.name(t, as_ids): _lp(v) for t, v in lp.top}
            top.setdefault(name, _lp(lp.logprob))
            out["tokens"].append(name)
            out["token_logprobs"].append(_lp(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(s)
        return out, offset

    def chat(self, lps: list[TokenLogprob], as_ids: bool = False) -> list[dict[str, Any]]:
        def entry(t: int, v: float) -> dict[str, Any]:
            return {"token": self.name(t, as_ids), "logprob": _lp(v), "bytes": self.bytes(t)}

        return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]

