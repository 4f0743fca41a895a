"""Turns a scheduler step into device tensors, runs the model, samples. The only place that creates
device tensors for a step; everything above it deals in plain Python objects."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from engine.config import EngineConfig
from engine.device import Device
from engine.distributed import all_reduce_min, broadcast, tp_rank, tp_size
from engine.forward_context import AttentionMetadata, ForwardContext, forward_context
from engine.graph_runner import DecodeGraphs, DecodeOut, MixedGraphs, mixed_sizes
from engine.kernel_check import check_kernels, kernel_shapes
from engine.layers.attention import Attention
from engine.layers.gdn import GatedDeltaNet
from engine.loader import CheckpointInfo, build_model, is_hybrid, load_weights
from engine.logits_processors import LogitsProcessors
from engine.lora.adapter import LoRAAdapter
from engine.lora.impl_check import choose_impl
from engine.lora.layers import BaseLayerWithLoRA, wrap_model
from engine.lora.punica import LoRABatch, ReferenceLoRABatch, TritonLoRABatch, build_mapping
from engine.lora.slots import AdapterPack, SlotFiller
from engine.protocol import SamplingParams
from engine.sampler import MIN_TEMPERATURE, DeviceSample, Sampler, SamplerOutput, StepFuture, make_generator
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.staging import Staging, Uploader
from engine.state_slots import StateSlots
from engine.structured import GrammarMatchers
from kernels.registry import Choice

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LORA_DTYPES = {**DTYPES, "fp8": torch.float8_e4m3fn}
GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
"""Decode batch sizes captured as graphs (those up to max_num_seqs)."""


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int


def _plain_greedy(p: SamplingParams) -> bool:
    """The row's token is its logits' argmax as they come from the model: greedy, no processor, no logprobs."""
    return p.temperature < MIN_TEMPERATURE and not p.uses_processors and p.logprobs is None


def _sample_rows(step: SchedulerOutput) -> list[int]:
    """The flat row of each sampling sequence's last token."""
    rows, end = [], 0
    for s in step.seqs:
        end += len(s.token_ids)
        if s.sample:
            rows.append(end - 1)
    return rows


def resolve_dtype(name: str, device: Device) -> torch.dtype:
    return device.default_dtype() if name == "auto" else DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, info: CheckpointInfo, device: Device, max_model_len: int,
                 progress: bool = False, eos_ids: frozenset[int] = frozenset()) -> None:
        """eos_ids: what min_tokens masks besides stop_token_ids (only rank 0 samples, so only it needs them)."""
        self.config, self.device = config, device
        self.dtype = resolve_dtype(config.model.dtype, device)
        self.max_model_len = max_model_len
        kc = config.kernels
        self.kernel_choices: list[Choice]
        """What the start-up checks chose per op (log, /metrics, xpulora check-device)."""
        self.kernels, self.kernel_choices = check_kernels(
            device.kernels(kc.attention, kc.fused, kc.gdn, kc.int4, is_hybrid(info)),
            kernel_shapes(info, config.cache.block_size), self.dtype, device.torch_device)
        self.model = build_model(info, self.dtype, device.torch_device, self.kernels)
        load_weights(self.model, info, progress=progress)
        self.model.eval()
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.lora_layers: list[BaseLayerWithLoRA] = []
        auto = config.lora.lora_dtype == "auto"
        self.lora_dtype = device.lora_dtype(self.dtype) if auto else LORA_DTYPES[config.lora.lora_dtype]
        """How adapter A/B are stored in the slots (fp8: e4m3 + per-row scales)."""
        if config.lora.enable_lora:
            self.lora_layers = wrap_model(self.model, self.model.lora_targets, config.lora.max_loras,
                                          config.lora.max_lora_rank, self.dtype, config.lora.fully_sharded_loras,
                                          self.lora_dtype)
        self.lora_impl: type[LoRABatch] = ReferenceLoRABatch
        self.lora_fill = SlotFiller(self.lora_layers, device.torch_device, device.pins_memory)
        self._lora_packs: weakref.WeakKeyDictionary[LoRAAdapter, AdapterPack] = weakref.WeakKeyDictionary()
        """Each host-cached adapter's packed form, made once and dropped with the adapter."""
        if self.lora_layers:
            self.lora_impl = self._choose_lora_impl()
        self.gdn_layers = [m for m in self.model.modules() if isinstance(m, GatedDeltaNet)]
        self.num_state_slots = config.scheduler.max_num_seqs if self.gdn_layers else 0
        self.num_state_snapshots = self.num_state_slots if config.cache.enable_prefix_caching else 0
        """Hybrid models: snapshot slots for prefix caching (engine.state_snapshots), as many as state slots."""
        self.use_graphs = (device.supports_graphs and not config.enforce_eager
                           and self.kernels.attention == "triton"
                           and (not self.lora_layers or self.lora_impl is TritonLoRABatch))
        self.upload = Uploader(device)
        self.states = StateSlots(self.gdn_layers, self.num_state_slots, self.num_state_snapshots, self.use_graphs,
                                 self.dtype, device.torch_device, self.upload)  # before the KV cache takes the rest
        self.kv = self._allocate_kv_cache()
        self.on_kv_overwrite: Callable[[], None] | None = None
        """Called when KV blocks are written outside a scheduled step (prompt_logits): the engine's prefix
        cache forgets what those blocks held."""
        self.sampler = Sampler(self.upload)
        self._longs, self._ints = Staging(device, torch.long), Staging(device, torch.int32)
        self.processors = LogitsProcessors(int(info.text_config["vocab_size"]), device.torch_device, eos_ids,
                                           self.upload)
        self._prev_tokens = torch.zeros(0, dtype=torch.long, device=device.torch_device)
        self._prev_rows: dict[int, int] = {}
        """The last launched step's sampled ids on the device and each sampled sequence's row in them: what
        the next step's placeholders (ScheduledSeq.pending) read under async scheduling."""
        self.generators: dict[int, torch.Generator] = {}
        self.grammar: GrammarMatchers | None = None
        """Rank 0: the engine's structured-output matchers (set by the engine)."""
        self.graphs: DecodeGraphs | None = None
        if self.use_graphs:
            bs = self.kv.block_size
            sizes = [s for s in GRAPH_SIZES if s <= config.scheduler.max_num_seqs] or [1]
            self.graphs = DecodeGraphs(self.model, device, sizes, (max_model_len + bs - 1) // bs, bs,
                                       self.kv.num_blocks, config.lora.max_loras if self.lora_layers else 0,
                                       self.num_state_slots if self.gdn_layers else None)
        self.mixed: MixedGraphs | None = None
        if self.use_graphs and config.mixed_graphs and not self.gdn_layers:
            bs = self.kv.block_size
            sizes = mixed_sizes(config.scheduler.max_num_batched_tokens, config.max_mixed_graph_tokens)
            self.mixed = MixedGraphs(self.model, device, sizes, config.scheduler.max_num_seqs,
                                     (max_model_len + bs - 1) // bs, bs, self.kv.num_blocks,
                                     config.lora.max_loras if self.lora_layers else 0)

    # -- KV cache --------------------------------------------------------------------------------
    def _block_bytes(self) -> int:
        a = self.attn_layers[0]
        el = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * len(self.attn_layers) * self.config.cache.block_size * a.num_kv_heads * a.head_dim * el

    def _num_blocks(self) -> int:
        cc, bs = self.config.cache, self.config.cache.block_size
        per_seq = (self.max_model_len + bs - 1) // bs
        if cc.num_blocks is not None:
            return cc.num_blocks
        if self.device.kind == "cpu":
            # Enough for every sequence at full length, capped at a quarter of the free RAM.
            free, _ = self.device.mem_get_info()
            want = per_seq * self.config.scheduler.max_num_seqs
            return max(per_seq, min(want, int(free * 0.25) // self._block_bytes()))
        free, total = self.device.mem_get_info()
        budget = total * cc.gpu_memory_utilization - (total - free) - 512 * 2**20  # activations headroom
        n = int(budget // self._block_bytes())
        if n < per_seq:
            raise RuntimeError(f"not enough device memory for one sequence of {self.max_model_len} tokens "
                               f"({n} KV blocks fit); lower --max-model-len or raise gpu_memory_utilization")
        return n

    def _allocate_kv_cache(self) -> KVCacheSpec:
        # Every rank must agree on the block count (the scheduler's block ids index all of them).
        n, bs = all_reduce_min(self._num_blocks(), self.device.torch_device), self.config.cache.block_size
        extra = 1 if self.use_graphs else 0  # a scratch block for the padding rows of graph replays
        for a in self.attn_layers:
            shape = (n + extra, bs, a.num_kv_heads, a.head_dim)
            a.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device.torch_device)
            a.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device.torch_device)
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB)", n, bs, n * self._block_bytes() / 2**20)
        return KVCacheSpec(n, bs)

    def _choose_lora_impl(self) -> type[LoRABatch]:
        """Check the device's LoRA candidates on the first wrapped layer's real shapes (few tokens)."""
        w, candidates = self.lora_layers[0], self.device.lora_candidates(self.config.kernels.lora)
        impl, choice = choose_impl(candidates, w.base.in_features, w.b_sizes(), w.max_rank, self.config.lora.max_loras,
                                   self.dtype, self.device.torch_device, self.lora_dtype)
        self.kernel_choices.append(choice)
        return impl

    # -- LoRA slots ------------------------------------------------------------------------------------
    def lora_target_shapes(self) -> dict[str, tuple[int, int]]:
        """Every module an adapter may target -> unsharded (in, out)."""
        shapes: dict[str, tuple[int, int]] = {}
        for w in self.lora_layers:
            shapes.update(w.full_shapes())
        return shapes

    def prepare_lora(self, adapter: LoRAAdapter) -> AdapterPack:
        """The adapter laid out for this rank's slot buffers (host work, once per adapter object)."""
        pack = self._lora_packs.get(adapter)
        if pack is None:
            pack = self._lora_packs[adapter] = self.lora_fill.pack(adapter.modules)
        return pack

    def load_lora(self, slot: int, adapter: LoRAAdapter) -> None:
        """Queue the copy of an adapter into `slot` of every wrapped layer (a few device ops, no host wait)."""
        self.lora_fill.fill(slot, self.prepare_lora(adapter))

    # -- one step ----------------------------------------------------------------------------------
    def _token_slots(self, step: SchedulerOutput) -> list[int]:
        """Each token's adapter slot (-1: none); empty when LoRA is off."""
        out: list[int] = []
        if self.lora_layers:
            for s in step.seqs:
                out += [s.lora_slot] * len(s.token_ids)
        return out

    def _prepare(self, step: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, list[int]]:
        """The step's inputs from per-sequence host lists (one Python pass over the sequences), sent in one
        copy per dtype; per-token positions and KV slots are derived on the device."""
        bs, seqs = self.kv.block_size, step.seqs
        ids: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        cu = [0]
        sample_rows: list[int] = []
        width = max(len(s.block_table) for s in seqs)
        table: list[int] = []
        for s in seqs:
            n = len(s.token_ids)
            ids += s.token_ids
            starts.append(s.start_pos)
            lens.append(n)
            cu.append(cu[-1] + n)
            table += s.block_table
            table += [0] * (width - len(s.block_table))
            if s.sample:
                sample_rows.append(cu[-1] - 1)
        ctx_lens = [a + n for a, n in zip(starts, lens)]
        states = [s.state_slot for s in seqs] if self.gdn_layers else []
        at, rows = self._pending(step)
        input_ids, start_t, len_t, index, at_t, rows_t = self._longs.send([ids, starts, lens, states, at, rows])
        if at:
            input_ids.index_copy_(0, at_t, self._prev_tokens.index_select(0, rows_t))
        ctx_t, cu_t, table_t = self._ints.send([ctx_lens, cu, table])
        table_t = table_t.view(len(seqs), width)
        t, dev = cu[-1], self.device.torch_device
        if t == len(seqs):  # one token per sequence
            seq_of, positions = torch.arange(t, device=dev), start_t
        else:  # output_size: no host sync to size the result
            seq_of = torch.repeat_interleave(torch.arange(len(seqs), device=dev), len_t, output_size=t)
            positions = start_t[seq_of] + torch.arange(t, device=dev) - cu_t[:-1].long()[seq_of]
        slot_mapping = table_t[seq_of, positions // bs].long() * bs + positions % bs
        meta = AttentionMetadata(slot_mapping=slot_mapping, block_tables=table_t, context_lens=ctx_t, cu_q=cu_t,
                                 cu_q_list=cu, context_lens_list=ctx_lens, max_q_len=max(lens))
        lora = (build_mapping(self._token_slots(step), dev, self.lora_impl, self.config.lora.max_loras)
                if self.lora_layers else None)
        ctx = ForwardContext(attn=meta, lora=lora, state_slots=states if self.gdn_layers else None,
                             state_index=index if self.gdn_layers else None)
        return input_ids, positions, ctx, sample_rows

    def _pending(self, step: SchedulerOutput) -> tuple[list[int], list[int]]:
        """Flat token index of every placeholder of the step and its row in the last step's sampled ids."""
        at: list[int] = []
        rows: list[int] = []
        end = 0
        for s in step.seqs:
            end += len(s.token_ids)
            if s.pending:
                at.append(end - 1)
                rows.append(self._prev_rows[s.seq_id])
        return at, rows

    def execute(self, step: SchedulerOutput, lora_loads: Iterable[tuple[int, LoRAAdapter]] = ()) -> SamplerOutput:
        """launch, then wait for the sampled ids (tests, tensor-parallel ranks > 0)."""
        return self.launch(step, lora_loads).result()

    def launch(self, step: SchedulerOutput, lora_loads: Iterable[tuple[int, LoRAAdapter]] = ()) -> StepFuture:
        """Copy the step's new adapters into their slots and queue the step on this rank, with no host wait
        for the device; only rank 0 samples (the others' futures are empty). Rows come back in step.seqs'
        order."""
        if not self.lora_layers or self.lora_impl is not ReferenceLoRABatch:
            return StepFuture(self._launch(step, lora_loads), self.device)
        # The reference LoRA ops read a slot's tokens as a slice (no gathers) when they are contiguous: run
        # the sequences grouped by slot (row order is free: every per-row input travels with its sequence).
        order = sorted(range(len(step.seqs)), key=lambda i: step.seqs[i].lora_slot)
        sample = self._launch(replace(step, seqs=[step.seqs[i] for i in order]), lora_loads)
        sampled = [i for i in order if step.seqs[i].sample]  # original index of each returned row
        back = sorted(range(len(sampled)), key=sampled.__getitem__)
        return StepFuture(sample, self.device, back)

    @torch.inference_mode()
    def _launch(self, step: SchedulerOutput, lora_loads: Iterable[tuple[int, LoRAAdapter]]) -> DeviceSample | None:
        for slot, adapter in lora_loads:
            self.load_lora(slot, adapter)
        for sid in step.finished_seq_ids:
            self.generators.pop(sid, None)
        self.states.reset(step)
        self.states.copy(step, restore=True)
        sampling_rank = tp_rank() == 0
        if sampling_rank:
            self.processors.release(step.finished_seq_ids)
            self.processors.observe(step.seqs)
        decoded: DecodeOut | None = None
        if self.graphs is not None and self.graphs.can_run(step):
            decoded = self.graphs.run(step, *self._pending(step), self._prev_tokens)
            # One row per sequence; a 1-token prefill chunk that is not a prompt's last does not sample.
            rows = [i for i, s in enumerate(step.seqs) if s.sample]
        elif self.mixed is not None and self.mixed.can_run(step):
            h = self.mixed.run(step, *self._pending(step), self._prev_tokens)
            rows = _sample_rows(step)
        else:
            input_ids, positions, ctx, rows = self._prepare(step)
            with forward_context(ctx):
                h = self.model(input_ids, positions)
        self.states.copy(step, restore=False)
        sampled = [s for s in step.seqs if s.sample]
        if not sampled:
            return None
        if decoded is not None:  # the graph ran the lm_head (on every rank: it gathers across ranks)
            if len(rows) != len(step.seqs):
                idx = self.upload(rows, torch.long)
                decoded = DecodeOut(decoded.logits[idx], decoded.ids[idx], decoded.packed[idx])
            logits = decoded.logits
        else:  # the lm_head gathers logits across ranks, so every rank computes them; only rank 0 samples
            logits = self.model.compute_logits(h if len(rows) == h.size(0) else h[self.upload(rows, torch.long)])
        if not sampling_rank:
            if self.config.async_scheduling:  # the next step's placeholders read rank 0's ids
                self._keep_sampled(broadcast(torch.empty(len(sampled), dtype=torch.long, device=logits.device)),
                                   sampled)
            return None
        # Grammar bitmasks are filled on the host here, while a GPU still runs the launched step.
        bitmask = self.grammar.fill([s.seq_id for s in sampled]) if self.grammar is not None else None
        if decoded is not None and bitmask is None and all(_plain_greedy(s.params) for s in sampled):
            sample = DeviceSample(decoded.ids, decoded.packed, [], 0, [])  # the graph's argmax is the sample
        else:
            gens = [self._generator(s.seq_id, s.params.seed) for s in sampled]
            logits = logits.float()
            sample = self.sampler.sample(self.processors.apply(logits, sampled, bitmask),
                                         [s.params for s in sampled], gens, raw=logits)
        if self.config.async_scheduling and tp_size() > 1:
            broadcast(sample.tokens)
        self._keep_sampled(sample.tokens, sampled)
        return sample

    def _keep_sampled(self, tokens: torch.Tensor, sampled: list[ScheduledSeq]) -> None:
        self._prev_tokens = tokens
        self._prev_rows = {s.seq_id: i for i, s in enumerate(sampled)}

    def _generator(self, seq_id: int, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = self.generators.get(seq_id)
        if g is None:
            g = self.generators[seq_id] = make_generator(seed, self.device.torch_device)
        return g

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], lora_slot: int = -1) -> torch.Tensor:
        """Logits at every position of one prompt, for tests. It writes the first KV blocks, so call it
        only while no request is running."""
        bs = self.kv.block_size
        nblk = (len(token_ids) + bs - 1) // bs
        if nblk > self.kv.num_blocks:
            raise ValueError("prompt longer than the KV cache")
        step = SchedulerOutput([ScheduledSeq(-1, token_ids, 0, list(range(nblk)), False, SamplingParams(),
                                                lora_slot, 0 if self.gdn_layers else -1)])
        if self.on_kv_overwrite is not None:
            self.on_kv_overwrite()
        self.states.reset(step)
        input_ids, positions, ctx, _ = self._prepare(step)
        with forward_context(ctx):
            h = self.model(input_ids, positions)
        return self.model.compute_logits(h).float()
