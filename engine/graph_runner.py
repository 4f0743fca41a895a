"""Captured steps (CUDA graphs; XPU graphs where torch has them): decode-only steps and mixed steps.

A step replays the graph captured for the smallest size that holds it. Its inputs go to the device in one
copy (int64, narrowed on the device) and into static buffers; the graph reads only those, so the host's part of
a step is a few device copies and one launch, whatever the model's depth.

- DecodeGraphs: B sequences of one token each, captured per B, lm_head and greedy argmax included (a greedy
  step needs nothing after the replay; others sample from the graph's logits). Rows past B are padding that
  writes its K/V into a scratch block no sequence owns and attends only to it (hybrid models: a scratch state
  slot too).
- MixedGraphs (dense attention models): any mix of prefill chunks and decodes, captured per token count T,
  attention included. The varlen attention kernel reads only device tensors; its grid is sized for T queries
  and max_num_seqs sequences, and the sequences a step does not use are zero-length (their programs exit at
  once). Rows past the step's tokens belong to no sequence: they write their K/V into the scratch block, use
  no adapter and are never sampled; nothing else mixes rows, so whatever they hold stays in them.

Steps with LoRA tokens replay a graph captured with the LoRA kernels; the token grouping is rewritten in place
into the tensors that graph reads, and set_slot updates adapter buffers and ranks in place, so new adapters
stay valid. Rows a step marks pending (async scheduling) take their token from the last step's sampled ids on
the device.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from engine.device import Device
from engine.forward_context import AttentionMetadata, ForwardContext, forward_context
from engine.lora.punica import TritonLoRABatch
from engine.scheduler import SchedulerOutput
from engine.staging import Staging

log = logging.getLogger(__name__)

MIXED_SIZES = (16, 32, 48, 64, 80, 96, 128, 160, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
"""Token counts captured for mixed steps (those up to max_num_batched_tokens and
EngineConfig.max_mixed_graph_tokens, 2048 by default). Larger steps run eagerly, which costs the host more than
the device (H200, 36 layers, 32 adapters: a 1304-token eager step took 124 ms for 37 ms of kernels), so the
default step budget is the largest captured size (SchedulerConfig). Spaced so that a step pads by at most a
third up to 512 (with powers of two a step of 64 decodes and one short prompt, ~80 tokens, ran the 128-token
graph), by at most a half beyond."""


def mixed_sizes(budget: int | None, max_tokens: int) -> list[int]:
    """The mixed-step sizes to capture: MIXED_SIZES up to max_tokens and the step budget (None: not yet
    resolved, it will follow the largest); at least the smallest."""
    return [s for s in MIXED_SIZES if s <= max_tokens and (budget is None or s <= budget)] or [MIXED_SIZES[0]]


class _Graphs:
    """Static buffers for up to `tokens` rows and `seqs` sequences, capture and replay (the subclasses fill the
    buffers from a step)."""

    kind = ""

    def __init__(self, model: torch.nn.Module, device: Device, sizes: list[int], tokens: int, seqs: int,
                 max_blocks_per_seq: int, block_size: int, scratch_block: int, lora_slots: int) -> None:
        self.model, self.device, self.sizes = model, device, sorted(sizes)
        self.block_size, self.scratch, self.lora_slots = block_size, scratch_block, lora_slots
        dev = device.torch_device
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((tokens,), scratch_block * block_size, dtype=torch.long, device=dev)
        self.block_tables = torch.full((seqs, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(seqs, dtype=torch.int32, device=dev)
        self.cu_q = torch.zeros(seqs + 1, dtype=torch.int32, device=dev)
        self._longs = Staging(device, torch.long)
        self.graphs: dict[tuple[int, bool], tuple[object, tuple[torch.Tensor, ...], TritonLoRABatch | None]] = {}
        self.replays = 0
        """Steps run through these graphs (checks and benchmarks read it)."""

    def _capture_all(self) -> None:
        gc.collect()  # garbage with device memory goes before the captures take the pool (once, not per graph)
        t0, (free0, _) = time.perf_counter(), self.device.mem_get_info()
        pool = self.device.graph_pool()
        for size in reversed(self.sizes):
            for with_lora in ((False, True) if self.lora_slots else (False,)):
                self.graphs[(size, with_lora)] = self._capture(size, with_lora, pool)
        # what the sizes cost at start-up, in seconds and device memory (--max-mixed-graph-tokens trades both)
        log.info("captured %s graphs for sizes %s (LoRA variants: %s) in %.1f s, %.0f MiB of device memory",
                 self.kind, self.sizes, bool(self.lora_slots), time.perf_counter() - t0,
                 (free0 - self.device.mem_get_info()[0]) / 2**20)

    def _context(self, size: int, info: TritonLoRABatch | None) -> ForwardContext:
        raise NotImplementedError

    @torch.inference_mode()
    def _capture(self, size: int, with_lora: bool, pool: object
                 ) -> tuple[object, tuple[torch.Tensor, ...], TritonLoRABatch | None]:
        # Shapes only: every replay rewrites the grouping in place.
        info = TritonLoRABatch.build([0] * size, self.lora_slots, self.device.torch_device) if with_lora else None
        ctx = self._context(size, info)
        with forward_context(ctx):
            for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
                self._outputs(self.model(self.input_ids[:size], self.positions[:size]), size)
        self.device.synchronize()
        graph = self.device.new_graph()
        with self.device.graph_capture(graph, pool), forward_context(ctx):
            out = self._outputs(self.model(self.input_ids[:size], self.positions[:size]), size)
        return graph, out, info

    def _outputs(self, h: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
        """What the graph leaves in its static outputs: the hidden states (DecodeGraphs: the greedy ids)."""
        return (h,)

    def _replay(self, size: int, token_slots: list[int]) -> tuple[torch.Tensor, ...]:
        with_lora = any(x >= 0 for x in token_slots) and (size, True) in self.graphs
        graph, out, info = self.graphs[(size, with_lora)]
        if with_lora:
            assert info is not None
            info.update(token_slots + [-1] * (size - len(token_slots)))
        self.replays += 1
        graph.replay()  # type: ignore[attr-defined]
        return out

    def _fill_pending(self, at_t: torch.Tensor, rows_t: torch.Tensor, prev_tokens: torch.Tensor) -> None:
        if at_t.numel():
            self.input_ids.index_copy_(0, at_t, prev_tokens.index_select(0, rows_t))


@dataclass(frozen=True)
class DecodeOut:
    """A replayed decode step's results on the device, rows in step order."""

    logits: torch.Tensor
    """[B, vocab], the model's dtype: a view of the buffer every decode graph writes, so read it (queue the work
    that reads it) before the next decode replay."""
    ids: torch.Tensor
    """[B] long: each row's greedy id (argmax of its logits, ties to the lowest id)."""
    packed: torch.Tensor
    """[B] float64: the ids as sampler.DeviceSample packs them for the host."""


class DecodeGraphs(_Graphs):
    kind = "decode"

    def __init__(self, model: torch.nn.Module, device: Device, sizes: list[int], max_blocks_per_seq: int,
                 block_size: int, scratch_block: int, lora_slots: int, scratch_state: int | None) -> None:
        n = max(sizes)
        super().__init__(model, device, sizes, n, n, max_blocks_per_seq, block_size, scratch_block, lora_slots)
        self.scratch_state = scratch_state
        """Hybrid models: the linear-attention state slot that padding rows update (None: no such layers)."""
        self.context_lens.fill_(1)
        self.cu_q.copy_(torch.arange(n + 1, dtype=torch.int32))
        self.state_index = torch.full((n,), scratch_state or 0, dtype=torch.long, device=device.torch_device)
        self.logits: torch.Tensor | None = None
        """[largest size, vocab] in the model's dtype, written by every decode graph (allocated at the first
        warm-up, outside the graph pool)."""
        self._capture_all()

    def _pad(self, start: int, end: int) -> None:
        """Rows start:end write into and read only the scratch block."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.scratch * self.block_size
        self.block_tables[start:end, 0] = self.scratch  # context length 1: only the first block is read
        self.context_lens[start:end] = 1
        if self.scratch_state is not None:
            self.state_index[start:end] = self.scratch_state

    def _context(self, size: int, info: TritonLoRABatch | None) -> ForwardContext:
        self._pad(0, size)
        meta = AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size], self.context_lens[:size],
                                 self.cu_q[: size + 1], cu_q_list=[], context_lens_list=[], max_q_len=1)
        states = self.state_index[:size] if self.scratch_state is not None else None
        return ForwardContext(attn=meta, lora=info, state_index=states)

    def can_run(self, step: SchedulerOutput) -> bool:
        return all(len(s.token_ids) == 1 for s in step.seqs) and len(step.seqs) <= self.sizes[-1]

    def _outputs(self, h: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
        # The lm_head and the greedy pick run in the graph too: a greedy step then launches nothing after the
        # replay but the copy of its ids to the host. The logits go to one buffer shared by every size (a step
        # reads them, in stream order, before the next replay writes them); each graph keeps its own ids, which
        # the next step's placeholders read.
        logits = self.model.compute_logits(h)
        if self.logits is None:
            self.logits = logits.new_empty((self.sizes[-1], logits.size(-1)))
        buf = self.logits[:size]
        buf.copy_(logits)
        ids = buf.argmax(dim=-1)  # the first maximal index: ties go to the lowest id, as the sampler's
        return ids, ids.double()

    @torch.inference_mode()
    def run(self, step: SchedulerOutput, pending_at: list[int], pending_rows: list[int], prev_tokens: torch.Tensor
            ) -> DecodeOut:
        """Logits and greedy ids of a decode-only step's B rows. Rows pending_at take their token from
        prev_tokens[pending_rows] (the last step's sampled ids, under async scheduling)."""
        b = len(step.seqs)
        size = next(s for s in self.sizes if s >= b)
        bs, pad = self.block_size, size - b
        pos = [s.start_pos for s in step.seqs]
        # Only the columns some sequence uses: attention reads a row's blocks below its context length, so
        # the rest of a row may hold anything (a full-width table is 2048 columns at 32k tokens).
        width = max(len(s.block_table) for s in step.seqs)
        table = [blk for s in step.seqs for blk in s.block_table + [self.scratch] * (width - len(s.block_table))]
        table += [self.scratch] * (width * pad)
        states = ([s.state_slot for s in step.seqs] + [self.scratch_state] * pad
                  if self.scratch_state is not None else [])
        # One copy to the device holds every input, the padding rows' too (scratch block, context length 1);
        # copy_ narrows the int32 ones.
        ids, positions, slot_t, ctx, table_t, index, at_t, rows_t = self._longs.send([
            [s.token_ids[0] for s in step.seqs] + [0] * pad, pos + [0] * pad,
            [s.block_table[p // bs] * bs + p % bs for s, p in zip(step.seqs, pos)] + [self.scratch * bs] * pad,
            [p + 1 for p in pos] + [1] * pad, table, states, pending_at, pending_rows])
        self.input_ids[:size].copy_(ids)
        self._fill_pending(at_t, rows_t, prev_tokens)
        self.positions[:size].copy_(positions)
        self.slot_mapping[:size].copy_(slot_t)
        self.block_tables[:size, :width].copy_(table_t.view(size, width))
        self.context_lens[:size].copy_(ctx)
        if self.scratch_state is not None:
            self.state_index[:size].copy_(index)
        greedy, packed = self._replay(size, [s.lora_slot for s in step.seqs])
        assert self.logits is not None
        return DecodeOut(self.logits[:b], greedy[:b], packed[:b])


class MixedGraphs(_Graphs):
    kind = "mixed-step"

    def __init__(self, model: torch.nn.Module, device: Device, sizes: list[int], max_seqs: int,
                 max_blocks_per_seq: int, block_size: int, scratch_block: int, lora_slots: int) -> None:
        super().__init__(model, device, sizes, max(sizes), max_seqs, max_blocks_per_seq, block_size, scratch_block,
                         lora_slots)
        self.max_seqs = max_seqs
        self._capture_all()

    def _context(self, size: int, info: TritonLoRABatch | None) -> ForwardContext:
        # Captured with every sequence empty (cu_q all 0): the kernels' grids are fixed by the sizes, what they
        # compute is read from the buffers at replay.
        meta = AttentionMetadata(self.slot_mapping[:size], self.block_tables, self.context_lens, self.cu_q,
                                 cu_q_list=[], context_lens_list=[], max_q_len=size)
        return ForwardContext(attn=meta, lora=info)

    def can_run(self, step: SchedulerOutput) -> bool:
        return step.num_tokens <= self.sizes[-1] and len(step.seqs) <= self.max_seqs

    @torch.inference_mode()
    def run(self, step: SchedulerOutput, pending_at: list[int], pending_rows: list[int], prev_tokens: torch.Tensor
            ) -> torch.Tensor:
        """Hidden states [T, hidden] of a step of T tokens (any mix of prefill chunks and decodes); rows
        pending_at take their token from prev_tokens[pending_rows]."""
        seqs, bs = step.seqs, self.block_size
        t, b = step.num_tokens, len(seqs)
        size = next(s for s in self.sizes if s >= t)
        ids: list[int] = []
        pos: list[int] = []
        cu = [0]
        slots: list[int] = []
        width = max(len(s.block_table) for s in seqs)
        table: list[int] = []
        token_slots: list[int] = []
        for s in seqs:
            n, start, blocks = len(s.token_ids), s.start_pos, s.block_table
            ids += s.token_ids
            p = range(start, start + n)
            pos += p
            slots += [blocks[i // bs] * bs + i % bs for i in p]
            cu.append(cu[-1] + n)
            table += blocks
            table += [self.scratch] * (width - len(blocks))
            token_slots += [s.lora_slot] * n
        ids_t, pos_t, slot_t, at_t, rows_t, cu_t, ctx_t, table_t = self._longs.send([
            ids, pos, slots, pending_at, pending_rows, cu + [t] * (self.max_seqs - b),
            [s.start_pos + len(s.token_ids) for s in seqs], table])  # one copy; copy_ narrows the int32 parts
        self.input_ids[:t].copy_(ids_t)
        self._fill_pending(at_t, rows_t, prev_tokens)
        self.positions[:t].copy_(pos_t)
        self.slot_mapping[:t].copy_(slot_t)
        self.slot_mapping[t:size] = self.scratch * bs  # padding rows write only the scratch block
        self.cu_q.copy_(cu_t)
        self.context_lens[:b].copy_(ctx_t)
        self.block_tables[:b, :width].copy_(table_t.view(b, width))
        return self._replay(size, token_slots)[0][:t]
