"""Captured decode steps (CUDA graphs; XPU graphs where torch has them).

A decode-only step of B sequences replays the graph captured for the smallest size >= B. Inputs are
copied into static buffers; rows past B are padding that writes its K/V into a scratch block that no
sequence owns and attends only to it (in hybrid models they also update a scratch linear-attention
state slot). Steps with LoRA tokens replay a graph captured with the LoRA
kernels; the per-step token grouping is rewritten in place into the tensors that graph reads, and the
adapter buffers and their ranks are updated in place by set_slot, so new adapters stay valid.
"""

from __future__ import annotations

import logging

import torch

from engine.device import Device
from engine.forward_context import AttentionMetadata, ForwardContext, forward_context
from engine.lora.punica import TritonLoRABatch
from engine.scheduler import SchedulerOutput
from engine.staging import Staging

log = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, device: Device, sizes: list[int], max_blocks_per_seq: int,
                 block_size: int, scratch_block: int, lora_slots: int, scratch_state: int | None) -> None:
        self.model, self.device, self.sizes = model, device, sorted(sizes)
        self.block_size, self.scratch = block_size, scratch_block
        self.scratch_state = scratch_state
        """Hybrid models: the linear-attention state slot that padding rows update (None: no such layers)."""
        self.lora_slots = lora_slots
        dev, n = device.torch_device, self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.state_index = torch.full((n,), scratch_state or 0, dtype=torch.long, device=dev)
        self._longs, self._ints = Staging(device, torch.long), Staging(device, torch.int32)
        """The replay's inputs go to the device in one copy per dtype (no host wait), then into the static
        buffers."""
        self.graphs: dict[tuple[int, bool], tuple[object, torch.Tensor, TritonLoRABatch | None]] = {}
        pool = device.graph_pool()
        for size in reversed(self.sizes):
            for with_lora in ((False, True) if lora_slots else (False,)):
                self.graphs[(size, with_lora)] = self._capture(size, with_lora, pool)
        log.info("captured decode graphs for batch sizes %s (LoRA variants: %s)", self.sizes, bool(lora_slots))

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
        meta = AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size], self.context_lens[:size],
                                 self.cu_q[: size + 1], cu_q_list=[], context_lens_list=[], max_q_len=1)
        states = self.state_index[:size] if self.scratch_state is not None else None
        return ForwardContext(attn=meta, lora=info, state_index=states)

    @torch.inference_mode()
    def _capture(self, size: int, with_lora: bool, pool: object) -> tuple[object, torch.Tensor, TritonLoRABatch | None]:
        self._pad(0, size)
        info = None
        if with_lora:
            # Shapes only: every replay rewrites the grouping in place.
            info = TritonLoRABatch.build([0] * size, self.lora_slots, self.device.torch_device)
        ctx = self._context(size, info)
        with forward_context(ctx):
            for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
                self.model(self.input_ids[:size], self.positions[:size])
        self.device.synchronize()
        graph = self.device.new_graph()
        with self.device.graph_capture(graph, pool), forward_context(ctx):
            out = self.model(self.input_ids[:size], self.positions[:size])
        return graph, out, info

    def can_run(self, step: SchedulerOutput) -> bool:
        return all(len(s.token_ids) == 1 for s in step.seqs) and len(step.seqs) <= self.sizes[-1]

    @torch.inference_mode()
    def run(self, step: SchedulerOutput, pending_at: list[int], pending_rows: list[int], prev_tokens: torch.Tensor
            ) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode-only step. Rows pending_at take their token from
        prev_tokens[pending_rows] (the last step's sampled ids, under async scheduling)."""
        b = len(step.seqs)
        size = next(s for s in self.sizes if s >= b)
        bs = self.block_size
        pos = [s.start_pos for s in step.seqs]
        # Only the columns some sequence uses: attention reads a row's blocks below its context length, so
        # the rest of a row may hold anything (a full-width table is 2048 columns at 32k tokens).
        width = max(len(s.block_table) for s in step.seqs)
        table = [blk for s in step.seqs for blk in s.block_table + [self.scratch] * (width - len(s.block_table))]
        states = [s.state_slot for s in step.seqs] if self.scratch_state is not None else []
        ids, positions, slot_t, index, at_t, rows_t = self._longs.send([
            [s.token_ids[0] for s in step.seqs], pos,
            [s.block_table[p // bs] * bs + p % bs for s, p in zip(step.seqs, pos)], states, pending_at, pending_rows])
        ctx, table_t = self._ints.send([[p + 1 for p in pos], table])
        self.input_ids[:b].copy_(ids)
        if pending_at:
            self.input_ids.index_copy_(0, at_t, prev_tokens.index_select(0, rows_t))
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(slot_t)
        self.block_tables[:b, :width].copy_(table_t.view(b, width))
        self.context_lens[:b].copy_(ctx)
        if self.scratch_state is not None:
            self.state_index[:b].copy_(index)
        slots = [s.lora_slot for s in step.seqs]
        self._pad(b, size)
        with_lora = any(x >= 0 for x in slots) and (size, True) in self.graphs
        graph, out, info = self.graphs[(size, with_lora)]
        if with_lora:
            padded = slots + [-1] * (size - b)
            info.update(padded)  # type: ignore[union-attr]
        graph.replay()  # type: ignore[attr-defined]
        return out[:b]
