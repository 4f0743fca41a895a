"""Token deltas -> client outputs: incremental detokenization, stop strings and their hold-back, usage.

The engine core ends a request only on token-level conditions (EOS / stop_token_ids under min_tokens and
ignore_eos, max_tokens, max_model_len, a completed grammar); stop strings are matched here, on the text.
When a stop string ends a request the core does not know it yet: `process` returns its id among the
ones to abort, and outputs the core still sends for it are ignored. One implementation for both the
offline `LLMEngine.step()` and the API process's engine client.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from engine.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback
from engine.messages import TokenDelta
from engine.protocol import FinishReason, RequestOutput, SamplingParams


@dataclass
class _State:
    params: SamplingParams
    detok: IncrementalDetokenizer
    num_output_tokens: int = 0
    emitted: int = 0
    """Characters of text already reported."""
    stop_floor: int = 0
    """Text length after the first min_tokens tokens: a stop string must end beyond it."""


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_ids: Collection[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self._states: dict[str, _State] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._states[request_id] = _State(
            params, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens))

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def process(self, deltas: list[TokenDelta]) -> tuple[list[RequestOutput], list[str]]:
        """The outputs for the requests still tracked, and the ids a stop string ended (abort them in the core)."""
        outs: list[RequestOutput] = []
        stopped: list[str] = []
        for d in deltas:
            st = self._states.get(d.request_id)
            if st is None:  # ended here already (stop string, abort) or never tracked
                continue
            out = self._one(st, d)
            outs.append(out)
            if out.finished:
                del self._states[d.request_id]
                if d.finish_reason is None:
                    stopped.append(d.request_id)
        return outs, stopped

    def _one(self, st: _State, d: TokenDelta) -> RequestOutput:
        p = st.params
        reason: FinishReason | None = d.finish_reason
        if reason in ("error", "abort"):
            return RequestOutput(d.request_id, [], "", None, True, reason, error=d.error, error_kind=d.error_kind,
                                 num_prompt_tokens=d.num_prompt_tokens, num_output_tokens=st.num_output_tokens,
                                 num_cached_tokens=d.num_cached_tokens)
        override: str | None = None
        for tok in d.new_token_ids:
            st.num_output_tokens += 1
            # A stop token's own text is left out unless include_stop_str_in_output.
            if p.include_stop_str_in_output or not p.ends_with(tok, st.num_output_tokens, self.eos_ids):
                st.detok.add(tok)
        text = st.detok.text
        # As vLLM, stop strings are matched only in the text after the first min_tokens tokens.
        checks = st.num_output_tokens > p.min_tokens
        if reason != "stop" and p.stop and checks:  # the core's "stop" is a token or a grammar: no string check
            cut = find_stop(text, p.stop, st.emitted, st.stop_floor)
            if cut is not None:
                if p.include_stop_str_in_output:
                    cut += len(next(s for s in p.stop if text.startswith(s, cut)))
                reason, override = "stop", text[:cut]
        elif p.stop and not checks:
            st.stop_floor = len(text)
        if reason is not None:
            if override is None:
                st.detok.flush()
                override = st.detok.text
            new_text = override[st.emitted:]
        else:
            hold = stop_holdback(text, p.stop) if p.stop and checks else 0
            new_text = text[st.emitted: len(text) - hold]
        st.emitted += len(new_text)
        return RequestOutput(
            request_id=d.request_id, new_token_ids=list(d.new_token_ids), new_text=new_text,
            new_logprobs=d.logprobs if p.logprobs is not None else None, finished=reason is not None,
            finish_reason=reason, num_prompt_tokens=d.num_prompt_tokens, num_output_tokens=st.num_output_tokens,
            num_cached_tokens=d.num_cached_tokens)
