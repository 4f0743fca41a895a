"""The messages between the API process and the engine-core process (msgpack via msgspec; no pickle).

In (API -> core): Add, Abort, AdapterCall, Utility. Out (core -> API): Ready or StartupFailed once, then
Outputs (one per loop iteration: acceptances, one TokenDelta per request that sampled a token, stats),
Reply (to AdapterCall / Utility) and Failed. Token-level only: text, stop strings and logprob formatting
are the API process's business (engine/output_processor.py). Leaf module: no torch, no engine internals.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from engine import errors
from engine.protocol import ErrorKind, FinishReason, SamplingParams, TokenLogprob

# -- in ------------------------------------------------------------------------------------------------


class Add(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    lora_name: str | None


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class AdapterCall(msgspec.Struct, tag=True, array_like=True):
    """load: name, path, roots, replace; unload: name. Runs on a thread of the core, answered by Reply."""

    call_id: int
    op: Literal["load", "unload"]
    name: str
    path: str = ""
    roots: tuple[str, ...] = ()
    replace: bool = False


class Utility(msgspec.Struct, tag=True, array_like=True):
    """abort_all: end every request with "abort"; shutdown: abort_all, reply, exit the loop."""

    call_id: int
    op: Literal["reset_prefix_cache", "abort_all", "shutdown"]


Inbound = Add | Abort | AdapterCall | Utility

# -- out -----------------------------------------------------------------------------------------------


class ErrorInfo(msgspec.Struct, array_like=True):
    """An engine.errors (or builtin) exception by class name and message."""

    kind: str
    message: str


class Accepted(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int] | None
    error: ErrorInfo | None = None


class TokenDelta(msgspec.Struct, array_like=True):
    """What one step did to one request: the token(s) it sampled and, when it ended, why."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None
    error_kind: ErrorKind = "internal"


class StepCounts(msgspec.Struct, array_like=True):
    """Running totals over an engine's launched steps (counters: readers take differences). LLMEngine keeps one;
    the core sends a copy in each Stats (/metrics), benchmarks compare a server's with the offline loop's."""

    steps: int = 0
    tokens: int = 0
    """Tokens computed (prompt chunks plus one per decoding sequence)."""
    sequences: int = 0
    """Sequences in the steps (rows sampled or chunked)."""
    mixed: int = 0
    """Steps that hold a prompt chunk of more than one token (they cost more than a decode step)."""
    seconds: float = 0.0
    """Host time in core_step: scheduling, launch and the wait for the read-back."""
    admitted: int = 0
    """Requests whose first step was launched."""
    queue_seconds: float = 0.0
    """Their waits, summed: from add_core (the core's loop reading them) to their first step's launch."""

    def count(self, tokens: int, sequences: int) -> None:
        self.steps += 1
        self.tokens += tokens
        self.sequences += sequences
        self.mixed += tokens > sequences


class Stats(msgspec.Struct, array_like=True, frozen=True):
    """The core's counters as the API process exposes them (/metrics reads the last one, lock-free)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    lora_loads: int = 0
    lora_unloads: int = 0
    lora_evictions: int = 0
    timestamp: float = 0.0
    """When the core took these counts (time.time())."""
    steps: StepCounts = msgspec.field(default_factory=StepCounts)
    """The core's step totals when it took these counts (a copy)."""
    idle_seconds: float = 0.0
    """The core loop's time blocked on its inbox with nothing to run."""
    gc_seconds: float = 0.0
    """The engine-core process's time in garbage collection (engine.gc_pauses; 0 when the core runs on a
    thread of the API process, whose own count covers it)."""
    gc_full_collections: int = 0
    gc_frozen_objects: int = 0
    """Objects the engine-core process froze out of collection after start-up (engine.gc_pauses)."""


class Outputs(msgspec.Struct, tag=True, array_like=True):
    accepted: list[Accepted]
    deltas: list[TokenDelta]
    stats: Stats | None


class Reply(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    error: ErrorInfo | None = None
    adapters: list[tuple[str, str]] | None = None
    """(name, path) of every registered adapter after an AdapterCall."""


class Ready(msgspec.Struct, tag=True, array_like=True):
    """What the API process needs from the core's start-up."""

    names: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    eos_ids: list[int]
    lora_enabled: bool
    max_num_seqs: int
    adapters: list[tuple[str, str]]
    kernels: list[tuple[str, str, list[tuple[str, str]], bool]]
    """kernels.registry.Choice fields (op, chosen, rejected, checked)."""
    pid: int
    tokenizer_class: str = ""
    """module.name of the tokenizer class AutoTokenizer chose in the core (the API process loads the same)."""


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    error: ErrorInfo


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The step loop died (a step raised, a tensor-parallel rank is gone)."""

    message: str


Outbound = Outputs | Reply | Ready | StartupFailed | Failed

# -- errors across the boundary ----------------------------------------------------------------------------

_ERRORS: dict[str, type[BaseException]] = {
    c.__name__: c for c in (*vars(errors).values(), ValueError, OSError, KeyError, RuntimeError)
    if isinstance(c, type) and issubclass(c, Exception)}


def error_info(e: BaseException) -> ErrorInfo:
    """By the nearest class the API process knows (FileNotFoundError travels as OSError)."""
    kind = next((c.__name__ for c in type(e).__mro__ if c.__name__ in _ERRORS), "RuntimeError")
    return ErrorInfo(kind, str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e))


def raise_error(info: ErrorInfo) -> BaseException:
    """The exception to raise in the API process: the same engine.errors class, the same message."""
    return _ERRORS.get(info.kind, RuntimeError)(info.message)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def inbound_decoder() -> msgspec.msgpack.Decoder[Inbound]:
    return msgspec.msgpack.Decoder(Inbound)


def outbound_decoder() -> msgspec.msgpack.Decoder[Outbound]:
    return msgspec.msgpack.Decoder(Outbound)
