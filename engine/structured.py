"""Structured output with llguidance: grammars compiled and cached by (kind, text), one matcher per request,
token bitmasks filled on the host and applied to the logits on the device (rank 0 only samples).

Flow: the server compiles a request's grammar off the engine loop (GrammarCompiler.compile, thread-safe,
LRU-cached; an invalid schema / regex / grammar is a RequestError carrying llguidance's message). The
engine takes a fresh matcher from the cached template when it accepts the request, advances it with every
token it appends (Sequence.output_token_ids never shrinks, so preemption by recompute leaves the matcher in
step with the output and nothing is rolled back), and drops it when the request ends. At each step the
model runner asks for the bitmasks of the sampled rows that have a grammar (GrammarMatchers.fill) after it
has launched the forward pass, so on a GPU the host fills them while the device computes; on the CPU the
step is synchronous and the fill simply precedes sampling. The masks go to the device in one copy and
set the disallowed logits of those rows to -inf (apply_bitmask); rows without a grammar are untouched and
a step with no grammar does no work at all.

The llguidance tokenizer is built with the model's (padded) vocabulary size, so the mask has a bit for
every logit column and the columns past the tokenizer's last token are never allowed. EOS is whatever ends
the request in the engine (all the model's EOS ids); a grammar that is complete allows only those.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
from transformers import PreTrainedTokenizerBase

from engine.lazy import LazyModule
from engine.protocol import RequestError, StructuredSpec

if TYPE_CHECKING:
    import torch
else:  # the API process only compiles grammars; the bitmasks (torch) are the engine core's
    torch = LazyModule("torch")

log = logging.getLogger(__name__)

# JSON as Python's json.dumps writes it (and as Qwen writes tool calls): ", " and ": ", no other
# whitespace. Flexible whitespace lets a weak model pad forever; a schema's x-guidance can still ask for it.
_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _grammar_source(spec: StructuredSpec) -> str:
    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        items = json.loads(spec.text)
        if not isinstance(items, list) or not items or not all(isinstance(x, str) for x in items):
            raise RequestError("'choice' must be a non-empty list of strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(x) for x in items))
    return llguidance.grammar_from("grammar", spec.text)


class GrammarCompiler:
    """Compiles StructuredSpecs into matcher templates for one tokenizer; thread-safe, LRU-cached."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: Iterable[int],
                 cache_size: int = 256) -> None:
        """vocab_size: the logits' width (the model's padded vocabulary)."""
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.eos_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.compile_seconds = 0.0
        """Total time spent compiling (the metrics export these three counters)."""

    def compile(self, spec: StructuredSpec, count_hit: bool = True) -> llguidance.LLMatcher:
        """The template matcher of spec (do not advance it: take copies with `matcher`); RequestError if
        the schema / regex / grammar is invalid. A miss compiles outside the lock (llguidance drops the GIL)."""
        key = (spec.kind, spec.text)
        with self._lock:
            got = self._cache.get(key)
            if got is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += count_hit
                return got
        t0 = time.perf_counter()
        try:
            source = _grammar_source(spec)
        except (ValueError, TypeError) as e:
            raise RequestError(f"invalid {_NAMES[spec.kind]}: {e}") from e
        matcher = llguidance.LLMatcher(self.tokenizer, source, log_level=0)
        if matcher.is_error():
            raise RequestError(f"invalid {_NAMES[spec.kind]}: {matcher.get_error().strip()}")
        elapsed = time.perf_counter() - t0
        with self._lock:
            self.num_compiles += 1
            self.compile_seconds += elapsed
            self._cache[key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        """A fresh matcher for one request (the engine's lookup after the server's compile is no new hit)."""
        return self.compile(spec, count_hit=False).deep_copy()


@dataclass
class _Track:
    matcher: llguidance.LLMatcher
    started: bool
    """False while the output is before spec.start_after (nothing is constrained yet)."""
    start_after: int | None


@dataclass(frozen=True)
class TokenBitmask:
    """Allowed tokens of some sampled rows: bit j of word w of mask row i allows token 32*w + j in row rows[i]."""

    rows: list[int]
    mask: torch.Tensor
    """[len(rows), ceil(vocab / 32)] int32, on the host."""


class GrammarMatchers:
    """The live matchers, by sequence id (owned by the engine, read by rank 0's model runner)."""

    def __init__(self, compiler: GrammarCompiler, parallel: bool = True) -> None:
        """parallel: fill the rows on llguidance's thread pool (not when the model itself computes on the
        host's cores: the pool's spinning threads would compete with it)."""
        self.compiler, self.parallel = compiler, parallel
        self._tracks: dict[int, _Track] = {}
        self._executor: llguidance.LLExecutor | None = None
        self.words = (compiler.vocab_size + 31) // 32

    def _eos_only(self) -> torch.Tensor:
        allowed = torch.zeros(self.words * 32, dtype=torch.bool)
        allowed[self.compiler.eos_ids] = True
        return pack_bits(allowed)

    def add(self, seq_id: int, spec: StructuredSpec) -> None:
        self._tracks[seq_id] = _Track(self.compiler.matcher(spec), spec.start_after is None, spec.start_after)

    def drop(self, seq_id: int) -> None:
        self._tracks.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tracks

    def accept(self, seq_id: int, token: int) -> bool:
        """Advance seq_id's matcher with an appended token; True when the grammar is complete (stopped)."""
        t = self._tracks.get(seq_id)
        if t is None:
            return False
        if not t.started:
            t.started = token == t.start_after
            return False
        if not t.matcher.consume_token(token):
            log.error("sequence %d: token %d rejected by its grammar: %s", seq_id, token, t.matcher.get_error())
        return t.matcher.is_stopped()

    def fill(self, seq_ids: Sequence[int]) -> TokenBitmask | None:
        """Bitmasks of the rows (seq_ids[i] is row i) whose grammar is active; None when there is none."""
        rows = [i for i, sid in enumerate(seq_ids) if (t := self._tracks.get(sid)) is not None and t.started]
        if not rows:
            return None
        mask = torch.empty(len(rows), self.words, dtype=torch.int32)
        work = []
        for k, i in enumerate(rows):
            m = self._tracks[seq_ids[i]].matcher
            if m.is_error():  # cannot happen through the mask; end the request instead of sampling garbage
                mask[k] = self._eos_only()
            else:
                work.append((m, k))
        if len(work) == 1 or not self.parallel:
            for m, k in work:
                m.unsafe_compute_mask_ptr(mask[k].data_ptr(), self.words * 4)
        elif work:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(work, mask.data_ptr(), self.words * 4, len(rows))
        return TokenBitmask(rows, mask)


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """[..., 32 * W] bool -> [..., W] int32 words, token 32*w + j at bit j of word w (llguidance's layout)."""
    bits = allowed.reshape(*allowed.shape[:-1], -1, 32).long() << torch.arange(32)
    words = bits.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def apply_bitmask(logits: torch.Tensor, bm: TokenBitmask) -> None:
    """Set the disallowed logits of bm's rows to -inf, in place, on logits' device (columns past the mask's
    width, if the logits are wider, are disallowed too)."""
    dev = logits.device
    # Page-locked, non_blocking: a copy from pageable memory would wait for the step queued before it.
    words = bm.mask if bm.mask.device == dev else bm.mask.pin_memory().to(dev, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [rows, words * 32]
    width = logits.shape[1]
    if allowed.shape[1] < width:
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]), value=False)
    idx = torch.tensor(bm.rows, dtype=torch.long)
    idx = idx if idx.device == dev else idx.pin_memory().to(dev, non_blocking=True)
    x = logits.index_select(0, idx).masked_fill_(~allowed[:, :width], float("-inf"))
    logits.index_copy_(0, idx, x)
