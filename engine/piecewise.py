"""Captured mixed steps: graphs around everything but attention (piecewise capture).

A step that holds a prefill chunk cannot replay a decode graph: its attention depends on the step's layout
of sequences (lengths, chunk offsets). Eagerly, such a step is a few launches per op over every layer, and on
a GPU the host's launch time, not the device, sets its length. Here the forward over a padded token count is
captured as a chain of graphs split at the attention calls: graph 0 runs the embedding up to layer 0's q/k/v,
graph i the rest of layer i-1 up to layer i's q/k/v, the last one up to the final norm. A replay runs graph
0, layer 0's attention eagerly on the step's real rows with the step's metadata (K/V write included), graph 1,
and so on. Rows past the step's tokens are padding: they carry stale but finite values through the graphs,
use no adapter, write no K/V and are never sampled. Graphs of one engine share one memory pool; the tensors
that pass between graphs and attention stay referenced here, so no capture reuses them.

Dense attention models only: a hybrid model's linear-attention layers keep per-sequence state with their own
varlen layout, and its mixed steps run eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.device import Device
from engine.forward_context import AttentionMetadata, ForwardContext, forward_context
from engine.layers.attention import Attention
from engine.lora.punica import LoRABatch

log = logging.getLogger(__name__)

MIXED_SIZES = (16, 32, 64, 128, 256, 512)
"""Token counts captured for mixed steps (those up to max_num_batched_tokens); larger steps run eagerly,
where the device's work dwarfs the launches."""


@dataclass
class _Split:
    layer: Attention
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    """Static outputs of the graph before this attention ([size, heads*dim])."""
    o: torch.Tensor
    """Static input of the graph after it: attention's output is copied here."""


@dataclass
class _Chain:
    graphs: list[object] = field(default_factory=list)
    splits: list[_Split] = field(default_factory=list)
    out: torch.Tensor | None = None
    lora: LoRABatch | None = None


class _Recorder:
    """The forward context's `split` during a capture: ends the running graph at an attention call, runs the
    attention eagerly into a static buffer and begins the next graph."""

    def __init__(self, device: Device, pool: object, chain: _Chain, meta: AttentionMetadata) -> None:
        self.device, self.pool, self.chain, self.meta = device, pool, chain, meta

    def begin(self) -> None:
        graph = self.device.new_graph()
        self.device.begin_capture(graph, self.pool)
        self.chain.graphs.append(graph)

    def __call__(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.device.end_capture(self.chain.graphs[-1])
        o = layer.attend(q, k, v, self.meta)
        self.chain.splits.append(_Split(layer, q, k, v, o))
        self.begin()
        return o


class MixedGraphs:
    def __init__(self, model: torch.nn.Module, device: Device, sizes: list[int], scratch_block: int,
                 block_size: int, lora_impl: type[LoRABatch] | None, lora_slots: int) -> None:
        self.model, self.device, self.sizes = model, device, sorted(sizes)
        dev, n = device.torch_device, self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        # Capture-time metadata: every row a 1-token sequence in the scratch block that no sequence owns.
        self.meta = AttentionMetadata(
            slot_mapping=torch.full((n,), scratch_block * block_size, dtype=torch.long, device=dev),
            block_tables=torch.full((n, 1), scratch_block, dtype=torch.int32, device=dev),
            context_lens=torch.ones(n, dtype=torch.int32, device=dev),
            cu_q=torch.arange(n + 1, dtype=torch.int32, device=dev), cu_q_list=list(range(n + 1)),
            context_lens_list=[1] * n, max_q_len=1)
        self.chains: dict[tuple[int, bool], _Chain] = {}
        self.replays = 0
        """Steps run through these graphs (checks and benchmarks read it)."""
        pool = device.graph_pool()
        for size in reversed(self.sizes):
            for with_lora in ((False, True) if lora_impl is not None else (False,)):
                lora = lora_impl.build([0] * size, lora_slots, dev) if lora_impl is not None and with_lora else None
                self.chains[(size, with_lora)] = self._capture(size, lora, pool)
        log.info("captured mixed-step graphs for %s tokens (%d graphs each)", self.sizes,
                 len(next(iter(self.chains.values())).graphs))

    def _meta(self, size: int) -> AttentionMetadata:
        m = self.meta
        return AttentionMetadata(m.slot_mapping[:size], m.block_tables[:size], m.context_lens[:size],
                                 m.cu_q[: size + 1], m.cu_q_list[: size + 1], m.context_lens_list[:size], 1)

    @torch.inference_mode()
    def _capture(self, size: int, lora: LoRABatch | None, pool: object) -> _Chain:
        meta = self._meta(size)
        ids, pos = self.input_ids[:size], self.positions[:size]
        with forward_context(ForwardContext(attn=meta, lora=lora)):
            for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
                self.model(ids, pos)
        chain = _Chain(lora=lora)
        recorder = _Recorder(self.device, pool, chain, meta)
        with self.device.capture_session(), forward_context(ForwardContext(attn=meta, lora=lora, split=recorder)):
            recorder.begin()
            chain.out = self.model(ids, pos)
            self.device.end_capture(chain.graphs[-1])
        return chain

    def can_run(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            lora_slots: list[int]) -> torch.Tensor:
        """Hidden states [T, hidden] of a step of T tokens (any mix of prefill chunks and decodes)."""
        t = input_ids.numel()
        size = next(s for s in self.sizes if s >= t)
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        with_lora = any(x >= 0 for x in lora_slots) and (size, True) in self.chains
        chain = self.chains[(size, with_lora)]
        self.replays += 1
        if chain.lora is not None:
            chain.lora.update(lora_slots + [-1] * (size - t))
        for i, graph in enumerate(chain.graphs):
            graph.replay()  # type: ignore[attr-defined]
            if i < len(chain.splits):
                s = chain.splits[i]
                s.o[:t].copy_(s.layer.attend(s.q[:t], s.k[:t], s.v[:t], meta))
        assert chain.out is not None
        return chain.out[:t]
