"""The engine: add_request / step / abort over a scheduler and a model runner.

Requests are validated here (bad input raises RequestError and leaves nothing behind); each core step
schedules, runs the model, appends sampled tokens, applies the token-level stop conditions and reports
per-request token deltas (what the engine-core process sends). `step()` (the offline API) passes those
through the OutputProcessor that the API process uses too: detokenization and stop strings.

Async scheduling (on GPUs at tp=1 by default): a core step schedules and launches step N+1 before it waits for
step N's sampled ids, so the host's scheduling and input preparation run while the device computes, and the
device never waits for the host between steps. Step N+1 feeds the ids step N sampled straight from the device
(ScheduledSeq.pending); the deltas a core step returns are step N's. A step whose sequences need their last
token on the host first (a grammar's bitmask, the penalties' history) waits for step N before it is scheduled.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

from transformers import AutoTokenizer

from engine.block_manager import BlockManager
from engine.config import EngineConfig, step_budget
from engine.device import Device, detect, rank_device
from engine.errors import AdapterError, ConfigError, ModelNotFoundError, RequestError
from engine.loader import eos_ids, inspect_checkpoint
from engine.lora.adapter import LoRAAdapter
from engine.lora.manager import LoRAManager
from engine.messages import StepCounts, TokenDelta
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.protocol import ErrorKind, FinishReason, GenerationResult, RequestOutput, SamplingParams, TokenLogprob
from engine.sampler import StepFuture
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import SeqStatus, Sequence
from engine.state_snapshots import SnapshotPool
from engine.structured import GrammarCompiler, GrammarMatchers
from engine.worker import make_executor

log = logging.getLogger(__name__)


@dataclass
class _Request:
    seq: Sequence


@dataclass
class _Launched:
    """A step on the device whose sampled ids the host has not read yet."""

    step: SchedulerOutput
    seqs: list[Sequence]
    future: StepFuture


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = False) -> None:
        kind = detect(config.parallel.device)
        if config.async_scheduling is None:  # on where the host can run ahead (not the CPU), at tp=1 (see config)
            config = replace(config, async_scheduling=rank_device(kind, 0).pins_memory
                             and config.parallel.tensor_parallel_size == 1)
        self.config = config
        self.async_scheduling: bool = bool(config.async_scheduling)
        info = inspect_checkpoint(config.model.path)
        self.hf_config = info.text_config
        limit = int(self.hf_config.get("max_position_embeddings", 32768))
        self.max_model_len = config.model.max_model_len or limit
        if self.max_model_len > limit:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings {limit}")
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self.eos_ids = eos_ids(config.model.path, self.tokenizer, self.hf_config)
        self.served_model_name = config.model.served_model_name or os.path.basename(
            os.path.normpath(config.model.path))
        self.base_names = frozenset((self.served_model_name, *config.model.extra_served_model_names))
        """Every name that means the base model (the first served name is the one reported)."""
        self.executor = make_executor(config, info, kind, self.max_model_len, progress, self.eos_ids)
        sched = config.scheduler  # the default step budget follows the mixed-step graphs (SchedulerConfig)
        largest = self.runner.mixed.sizes[-1] if self.runner.mixed is not None else None
        config = self.config = replace(config, scheduler=replace(
            sched, max_num_batched_tokens=step_budget(sched.max_num_batched_tokens, largest, sched.max_num_seqs)))
        self.vocab_size = int(self.hf_config["vocab_size"])
        kv = self.executor.kv
        if kv.num_blocks * kv.block_size < self.max_model_len:
            raise ConfigError(f"the KV cache ({kv.num_blocks} blocks x {kv.block_size} tokens) cannot hold one "
                              f"sequence of max_model_len={self.max_model_len}; raise num_blocks or lower "
                              "max_model_len")
        self.blocks = BlockManager(kv.num_blocks, kv.block_size, config.cache.enable_prefix_caching)
        self.lora: LoRAManager | None = None
        if config.lora.enable_lora:
            self.lora = LoRAManager(config.lora, self.executor.lora_target_shapes(), prepare=self.runner.prepare_lora)
            for name, path in config.lora.lora_modules:
                self.lora.load(name, path)
        snapshots = SnapshotPool(self.runner.num_state_snapshots) if self.runner.num_state_snapshots else None
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.lora, self.runner.num_state_slots, snapshots,
                                   config.cache.hybrid_snapshot_interval)
        self.runner.on_kv_overwrite = self.reset_prefix_cache
        self.grammar = GrammarMatchers(GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids),
                                       parallel=self.device.kind != "cpu")
        """Structured output: a matcher per request that has one; rank 0's runner reads its bitmasks."""
        self.runner.grammar = self.grammar
        self.requests: dict[str, _Request] = {}
        self.output = OutputProcessor(self.tokenizer, self.eos_ids)
        """Text for step() (offline); the engine-core process leaves it empty (add_core, core_step)."""
        self._seq_ids = itertools.count()
        self.num_preemptions = 0
        self.steps = StepCounts()
        """What the steps held and cost (/metrics; benchmarks compare the server's steps with the offline loop's)."""
        self._launched: _Launched | None = None

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's model runner (tests read logits through it)."""
        return self.executor.runner

    @property
    def device(self) -> Device:
        """Rank 0's device."""
        return self.executor.runner.device

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (no-op at tp=1)."""
        self.executor.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- requests ----------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError("a token-id prompt must be a list of integers")
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    lora_name: str | None = None) -> list[int]:
        """Queue a request for step() (lora_name None: the base model); raises RequestError, queuing
        nothing, if it cannot be served. Returns the prompt's token ids."""
        ids = self.add_core(request_id, prompt, params, lora_name)
        self.output.add(request_id, ids, params)
        return ids

    def add_core(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                 lora_name: str | None = None) -> list[int]:
        """add_request without the text side (core_step reports token deltas only)."""
        lora_id = self._resolve_lora(lora_name)
        if request_id in self.requests:
            raise RequestError(f"duplicate request id {request_id!r}")
        params.validate(self.config.max_logprobs, int(self.hf_config["vocab_size"]))
        ids = self.tokenize(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; this model's max_model_len is "
                               f"{self.max_model_len} (prompt + output)")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                               f"max_model_len {self.max_model_len}")
        seq = Sequence(next(self._seq_ids), request_id, ids, params, lora_id,
                       max_total=min(len(ids) + params.max_tokens, self.max_model_len), arrival=time.perf_counter())
        if params.structured is not None:
            self.grammar.add(seq.seq_id, params.structured)  # RequestError if invalid (the server compiled it)
        if lora_id is not None and self.lora is not None:
            self.lora.add_user(lora_id)
        self.requests[request_id] = _Request(seq)
        self.scheduler.add(seq)
        return ids

    def _resolve_lora(self, lora_name: str | None) -> int | None:
        if lora_name is None:
            return None
        if self.lora is None:
            raise RequestError(f"model {lora_name!r}: LoRA is not enabled on this engine (start it with --enable-lora)")
        lora_id = self.lora.resolve(lora_name)
        if lora_id is None:
            raise ModelNotFoundError(f"model {lora_name!r} does not exist (not the base model, not a loaded adapter)")
        return lora_id

    # -- adapters ------------------------------------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str, pin: bool = False, roots: Seq[str] = (),
                          replace: bool = False) -> int:
        """Validate and register an adapter (safe while the engine steps in another thread); roots: the
        folders it must lie in (runtime loads); replace: a loaded adapter of that name is swapped for the
        new one once it has loaded (vLLM's load_inplace)."""
        if self.lora is None:
            raise AdapterError("LoRA is not enabled on this engine (start it with --enable-lora)")
        if name in self.base_names:
            raise AdapterError(f"adapter name {name!r} is the base model's name")
        return self.lora.load(name, path, pin, roots, replace)

    def unload_lora_adapter(self, name: str) -> None:
        if self.lora is None:
            raise AdapterError("LoRA is not enabled on this engine (start it with --enable-lora)")
        self.lora.unload(name)

    def _end(self, req: _Request) -> None:
        """Bookkeeping when a request leaves the engine (finished, aborted or failed)."""
        self.scheduler.finish(req.seq)
        self.grammar.drop(req.seq.seq_id)
        del self.requests[req.seq.request_id]
        if req.seq.lora_id is not None and self.lora is not None:
            self.lora.remove_user(req.seq.lora_id)

    def abort(self, request_id: str) -> bool:
        self.output.drop(request_id)
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._end(req)
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay; nothing is hit until computed again)."""
        self.scheduler.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._launched is not None

    # -- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One core step with its text: what a client sees (requests a stop string ended are aborted)."""
        outputs, stopped = self.output.process(self.core_step())
        for rid in stopped:
            self.abort(rid)
        return outputs

    def core_step(self) -> list[TokenDelta]:
        """Schedule and launch the next step, then read back the previous one (async scheduling) or this one;
        the deltas of the step read back."""
        t0 = time.perf_counter()
        try:
            return self._core_step()
        finally:
            self.steps.seconds += time.perf_counter() - t0

    def _core_step(self) -> list[TokenDelta]:
        outputs: list[TokenDelta] = []
        if self._launched is not None and self._needs_ids(self._launched):
            outputs += self._read_back()
        launched = self._launch(outputs)
        if self._launched is not None:
            outputs += self._read_back()
        self._launched = launched
        if not self.async_scheduling and launched is not None:
            outputs += self._read_back()
        return outputs

    def _launch(self, outputs: list[TokenDelta]) -> _Launched | None:
        """Schedule and launch a step (None: nothing to run); adapter failures go to outputs."""
        step = self.scheduler.schedule()
        self.num_preemptions += step.num_preempted
        if not step.seqs:
            return None
        seqs = self.scheduler.scheduled_sequences()
        loads: list[tuple[int, LoRAAdapter]] = []
        if step.lora_loads:
            step, seqs, failed, loads = self._resolve_loads(step, seqs)
            outputs += failed
            if not step.seqs:
                self.scheduler.keep_ended(step.finished_seq_ids)
                return None
        launch_t = time.perf_counter()  # before the launch: on the CPU it runs the whole step
        future = self.executor.launch(step, loads)  # EngineDeadError once a rank is gone, at every later step too
        self.scheduler.step_ran()
        self.steps.count(step.num_tokens, len(step.seqs))
        for entry, seq in zip(step.seqs, seqs):
            if seq.arrival:
                self.steps.admitted += 1
                self.steps.queue_seconds += launch_t - seq.arrival
                seq.arrival = 0.0
            seq.num_computed_tokens += len(entry.token_ids)
            seq.num_pending += entry.sample
        return _Launched(step, seqs, future)

    def _needs_ids(self, launched: _Launched) -> bool:
        """The launched step sampled for a running sequence whose next step needs that token on the host: its
        grammar's bitmask, or the penalties' token history."""
        return any(e.sample and s.status is SeqStatus.RUNNING and (e.params.structured is not None
                                                                   or e.params.uses_history)
                   for e, s in zip(launched.step.seqs, launched.seqs))

    def _read_back(self) -> list[TokenDelta]:
        """Wait for the launched step's sampled ids and append them (sequences ended meanwhile are skipped: an
        abort, or an EOS read back after the next step was launched)."""
        launched, self._launched = self._launched, None
        assert launched is not None
        sampled = launched.future.result()
        outputs: list[TokenDelta] = []
        k = 0
        for entry, seq in zip(launched.step.seqs, launched.seqs):
            if not entry.sample:
                continue
            tok, lp = sampled.token_ids[k], sampled.logprobs[k]
            k += 1
            seq.num_pending -= 1
            if seq.status is not SeqStatus.FINISHED:
                outputs.append(self._append(seq, tok, lp))
        return outputs

    def _append(self, seq: Sequence, tok: int, lp: TokenLogprob | None) -> TokenDelta:
        p = seq.params
        seq.output_token_ids.append(tok)
        grammar_done = self.grammar.accept(seq.seq_id, tok)
        # Stop strings are the output processor's (text) business.
        reason: FinishReason | None = None
        # A complete grammar allows nothing more (vLLM stops there too).
        if p.ends_with(tok, len(seq.output_token_ids), self.eos_ids) or grammar_done:
            reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        out = TokenDelta(seq.request_id, [tok], [lp] if lp is not None and p.logprobs is not None else None,
                         reason, seq.num_prompt_tokens, seq.num_cached_tokens)
        if reason is not None:
            self._end(self.requests[seq.request_id])
        return out

    def _resolve_loads(self, step: SchedulerOutput, seqs: list[Sequence]
                       ) -> tuple[SchedulerOutput, list[Sequence], list[TokenDelta], list[tuple[int, LoRAAdapter]]]:
        """Fetch the adapters that must be copied into slots; requests whose adapter can no longer be read
        fail with its error, and nothing a file holds stops the step loop."""
        assert self.lora is not None
        failed: dict[int, tuple[str, ErrorKind]] = {}
        loads: list[tuple[int, LoRAAdapter]] = []
        for slot, lora_id in step.lora_loads:
            try:
                loads.append((slot, self.lora.adapter(lora_id)))
            except AdapterError as e:  # the re-read raises nothing else for what the files hold
                failed[slot] = (str(e), "adapter")
            except Exception as e:  # a bug, not a file: fail these requests, keep serving the others
                log.exception("re-reading adapter %s failed", lora_id)
                failed[slot] = (f"re-reading the adapter failed: {e}", "internal")
        if not failed:
            return step, seqs, [], loads
        outputs = []
        keep = [(e, s) for e, s in zip(step.seqs, seqs) if e.lora_slot not in failed]
        self.scheduler.unschedule([s for e, s in zip(step.seqs, seqs) if e.lora_slot in failed])
        for e, s in zip(step.seqs, seqs):
            if e.lora_slot in failed:
                req = self.requests[s.request_id]
                self._end(req)
                message, kind = failed[e.lora_slot]
                outputs.append(TokenDelta(s.request_id, [], None, "error", s.num_prompt_tokens, error=message,
                                          error_kind=kind))
        for slot in failed:
            self.lora.forget_slot(slot)
        step = SchedulerOutput([e for e, _ in keep], [], step.finished_seq_ids, step.num_preempted)
        return step, [s for _, s in keep], outputs, loads

    # -- offline convenience -----------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams],
                 lora_names: list[str | None] | None = None) -> list[GenerationResult]:
        """Run all prompts to completion; a request that cannot be served gets its error, the rest run."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        names = lora_names or [None] * len(prompts)
        results: dict[str, GenerationResult] = {}
        order: list[str] = []
        for i, (prompt, sp) in enumerate(zip(prompts, plist)):
            rid = f"gen-{i}"
            order.append(rid)
            try:
                ids = self.add_request(rid, prompt, sp, names[i])
                results[rid] = GenerationResult(rid, "", [], None, [] if sp.logprobs is not None else None,
                                                len(ids), prompt_token_ids=ids)
            except RequestError as e:
                results[rid] = GenerationResult(rid, "", [], "error", error=str(e))
        while self.has_unfinished():
            for out in self.step():
                r = results[out.request_id]
                r.text += out.new_text
                r.token_ids.extend(out.new_token_ids)
                if r.logprobs is not None and out.new_logprobs is not None:
                    r.logprobs.extend(out.new_logprobs)
                if out.finished:
                    r.finish_reason = out.finish_reason
                    r.error = out.error
                    r.num_cached_tokens = out.num_cached_tokens
        return [results[rid] for rid in order]
