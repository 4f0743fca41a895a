"""The Gated DeltaNet layers' per-sequence state on the device (hybrid models): one slot per running sequence
in each layer's conv and recurrent state tensors, and the prefix cache's snapshot slots beside them. Which
sequence holds which slot is the scheduler's (plain ints in ScheduledSeq); which snapshot holds which prefix is
engine.state_snapshots'. This file owns the tensors and the copies a step needs."""

from __future__ import annotations

import logging

import torch

from engine.layers.gdn import GatedDeltaNet
from engine.scheduler import SchedulerOutput
from engine.staging import Uploader

log = logging.getLogger(__name__)


class StateSlots:
    def __init__(self, layers: list[GatedDeltaNet], num_slots: int, num_snapshots: int, scratch: bool,
                 dtype: torch.dtype, device: torch.device, upload: Uploader) -> None:
        """Per layer: conv state [slots, conv_dim, K-1] (dtype) and fp32 recurrent state [slots, Hv, Dk, Dv], with
        one more slot when `scratch` (the padding rows of graph replays), and num_snapshots snapshot slots."""
        self.layers, self.upload = layers, upload
        n = num_slots + (1 if scratch else 0)
        for m in layers:
            m.conv_state = torch.zeros(n, m.conv_dim, m.kernel - 1, dtype=dtype, device=device)
            m.ssm_state = torch.zeros(n, m.hv, m.dk, m.dv, dtype=torch.float32, device=device)
        per_seq = sum(m.conv_state[0].numel() * m.conv_state.element_size() + m.ssm_state[0].numel() * 4
                      for m in layers)
        if layers:
            log.info("linear-attention state pool: %d slots x %.1f MiB", n, per_seq / 2**20)
        self.snapshots = [(torch.zeros_like(m.conv_state[:num_snapshots]),
                           torch.zeros_like(m.ssm_state[:num_snapshots])) for m in layers]
        if num_snapshots and layers:
            log.info("prefix-cache state snapshots: %d slots x %.1f MiB", num_snapshots, per_seq / 2**20)

    def reset(self, step: SchedulerOutput) -> None:
        """A sequence's first chunk starts from zero state (new, or recomputed after preemption)."""
        fresh = [s.state_slot for s in step.seqs if s.start_pos == 0 and s.state_slot >= 0]
        if not fresh or not self.layers:
            return
        index = self.upload(fresh, torch.long)
        for m in self.layers:  # two launches per layer, however many sequences start
            m.conv_state.index_fill_(0, index, 0)
            m.ssm_state.index_fill_(0, index, 0)

    def copy(self, step: SchedulerOutput, restore: bool) -> None:
        """Prefix caching: snapshot -> state slot before a step (a hit), state slot -> snapshot after it."""
        pairs = [(s.state_restore, s.state_slot) if restore else (s.state_slot, s.state_save)
                 for s in step.seqs if (s.state_restore if restore else s.state_save) >= 0]
        if not pairs or not self.snapshots:
            return
        src, dst = (self.upload(list(x), torch.long) for x in zip(*pairs))
        for m, (conv, ssm) in zip(self.layers, self.snapshots):
            for state, snap in ((m.conv_state, conv), (m.ssm_state, ssm)):
                if restore:
                    state.index_copy_(0, dst, snap.index_select(0, src))
                else:
                    snap.index_copy_(0, dst, state.index_select(0, src))
