"""Continuous batching under token, sequence and KV budgets. Returns plain objects (no tensors).

Each step first continues the running sequences, preempting the newest running sequence not yet scheduled
in this step (by recompute) when KV blocks run out, then admits waiting sequences in arrival order while
the budgets allow. Prompts longer than the token budget are prefilled in chunks. The token budget
(max_num_batched_tokens) goes to the decode rows first (one token each), then to the next chunks of the
running prompts in arrival order, then to new prompts: a long prompt never holds the running requests'
next tokens back (inter-token latency stays one step), and a started prompt finishes before later ones
take its budget (TTFT is first come, first served).

LoRA: a sequence takes its adapter's device slot when it starts running, so one step never holds
more distinct adapters than there are slots. A request whose adapter cannot get a slot waits; once
one waits, later adapter requests are not admitted ahead of it (base-model requests still are), so
the running adapters drain, a slot frees and no adapter starves.

Prefix caching (when the block manager has it on): a sequence admitted with nothing computed (new, or
preempted) first takes the cached blocks of its longest cached prefix under its own adapter identity and
starts computing after them, like a prefill chunk whose earlier tokens are in the cache; at least its last
token is computed, so it samples. Every full block a step computes is registered when it is scheduled,
so a request admitted later in the same step (the copies of an n > 1 request) can share it: attention
writes a step's K/V before it reads the cache, so the block is filled before the sharer reads it.
Hybrid models also need the linear-attention state at the hit's end: their prompt chunks end on
multiples of the snapshot interval, where the state is kept (engine.state_snapshots), and a hit is cut
back to the last point that has a snapshot (no snapshot: no hit, never a partial state).

Async scheduling (the engine schedules step N+1 while step N runs): a sequence that step N samples has one
pending token whose id is not on the host yet. Its next entry feeds a placeholder (`pending`) that the
runner replaces on the device; a sequence whose pending token is its last for certain (max_tokens) is not
scheduled again; one whose pending token turns out to end it (EOS) computes one wasted row. A block is
registered in the prefix cache once its tokens are all known (one step late when the pending token fills
it), and a preempted sequence is not admitted again until its pending token has arrived.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import ROOT_KEY, BlockManager, block_key
from engine.config import SchedulerConfig, step_budget
from engine.lora.manager import LoRAManager
from engine.protocol import SamplingParams
from engine.sequence import SeqStatus, Sequence
from engine.state_snapshots import SnapshotPool


@dataclass(frozen=True)
class ScheduledSeq:
    seq_id: int
    token_ids: list[int]
    """Tokens whose K/V this step computes (prompt chunk, recompute, or the last sampled token)."""
    start_pos: int
    """Position of token_ids[0] (= tokens already in the cache)."""
    block_table: list[int]
    sample: bool
    """True when this step reaches the end of the sequence, so a next token is sampled."""
    params: SamplingParams
    lora_slot: int = -1
    """Adapter slot of this sequence's tokens (-1: base model)."""
    state_slot: int = -1
    """Linear-attention state slot (hybrid models); zeroed by the runner when start_pos is 0."""
    num_prompt_tokens: int = 0
    """Positions below this are prompt, the rest output (the penalties and min_tokens tell them apart)."""
    state_restore: int = -1
    """Snapshot slot the runner copies into state_slot before this step (a prefix-cache hit; -1: none)."""
    state_save: int = -1
    """Snapshot slot the runner copies state_slot into after this step (-1: none)."""
    pending: bool = False
    """Async scheduling: the last of token_ids is a placeholder for the token the previous step samples for
    this sequence, which the runner takes from that step's device output."""


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    lora_loads: list[tuple[int, int]] = field(default_factory=list)
    """(slot, adapter id) pairs to copy into the device slots before this step runs."""
    finished_seq_ids: list[int] = field(default_factory=list)
    """Sequences that ended since the previous step (the runner drops their per-sequence state)."""
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, lora: LoRAManager | None = None,
                 num_state_slots: int = 0, snapshots: SnapshotPool | None = None, snapshot_interval: int = 0) -> None:
        self.config = config
        self.budget = step_budget(config.max_num_batched_tokens, None, config.max_num_seqs)
        """Tokens per step (LLMEngine resolves the config's None first; a scheduler alone knows of no graphs)."""
        self.snapshots, self.snapshot_interval = snapshots, snapshot_interval
        self.lora = lora
        self.uses_state = num_state_slots > 0
        self._free_states: list[int] = list(range(num_state_slots - 1, -1, -1))
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ended: list[int] = []
        self._scheduled: list[Sequence] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (finished or aborted) and free its blocks."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.blocks.free(seq.block_table)
        self._ended.append(seq.seq_id)

    def _release(self, seq: Sequence) -> None:
        if seq.lora_id is not None and self.lora is not None and seq.lora_slot >= 0:
            self.lora.release_slot(seq.lora_id)
        seq.lora_slot = -1
        if seq.state_slot >= 0:
            self._free_states.append(seq.state_slot)
            seq.state_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        self.blocks.free(seq.block_table)
        seq.num_computed_tokens = seq.num_cached_blocks = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _keys(self, seq: Sequence, count: int) -> list[bytes]:
        """The prefix-cache keys of the sequence's first `count` full blocks (hashed once each)."""
        bs, keys = self.blocks.block_size, seq.block_keys
        identity = seq.lora_id if seq.lora_id is not None else 0  # adapter ids start at 1
        while len(keys) < count:
            i = len(keys)
            keys.append(block_key(keys[-1] if keys else ROOT_KEY, identity, seq.token_slice(i * bs, (i + 1) * bs)))
        return keys[:count]

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], int]:
        """Cached blocks a sequence with nothing computed can start from (never its last token's block), and
        the state snapshot at their end (hybrid models; -1: none)."""
        if not self.blocks.enable_caching or seq.num_computed_tokens or seq.block_table:
            return [], -1
        if seq.params.uses_history:  # the penalties' token history is built from the tokens steps feed
            return [], -1
        keys = self._keys(seq, (seq.num_tokens - 1) // self.blocks.block_size)
        hit = self.blocks.lookup(keys)
        if self.snapshots is None:
            return hit, -1
        per = self.snapshot_interval // self.blocks.block_size
        for j in range(len(hit) // per * per, 0, -per):
            slot = self.snapshots.find(keys[j - 1])
            if slot is not None:
                return hit[:j], slot
        return [], -1

    def _chunk(self, seq: Sequence, start: int, budget: int) -> int:
        """Tokens to compute from start; a hybrid model's chunk stops at the next snapshot point."""
        n = min(seq.num_total - start, budget)
        if self.snapshots is not None:
            n = min(n, (start // self.snapshot_interval + 1) * self.snapshot_interval - start)
        return n

    def _entry(self, seq: Sequence, n: int, restore: int = -1) -> ScheduledSeq:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        known = min(end, seq.num_tokens)  # a pending token is the entry's last one (end - known <= 1)
        full = known // self.blocks.block_size
        if self.blocks.enable_caching and full > seq.num_cached_blocks:  # register the full blocks this step fills
            for i, key in enumerate(self._keys(seq, full)[seq.num_cached_blocks:], seq.num_cached_blocks):
                self.blocks.register(seq.block_table[i], key)
            seq.num_cached_blocks = full
        save = -1
        if self.snapshots is not None and end == known and end % self.snapshot_interval == 0:
            save = self.snapshots.reserve(seq.block_keys[full - 1], seq.seq_id)
        tokens = seq.token_slice(start, known) + [0] * (end - known)
        return ScheduledSeq(seq.seq_id, tokens, start, list(seq.block_table), end == seq.num_total, seq.params,
                            seq.lora_slot, seq.state_slot, seq.num_prompt_tokens, restore, save, end > known)

    def schedule(self) -> SchedulerOutput:
        budget = self.budget
        out: list[ScheduledSeq] = []
        self._scheduled = []
        preempted = 0
        # Decode rows first, then the running prompts' next chunks (arrival order), then admissions: a long
        # prompt's chunk takes only what the decode rows leave, so it never stalls them.
        live = [s for s in self.running if not s.ends_for_certain]
        decoding = [s for s in live if s.num_total - s.num_computed_tokens == 1]
        prefilling = [s for s in live if s.num_total - s.num_computed_tokens > 1]
        for seq in decoding + prefilling:
            if budget <= 0:
                break
            if seq.status != SeqStatus.RUNNING:  # preempted earlier in this step
                continue
            n = self._chunk(seq, seq.num_computed_tokens, budget)
            while not self.blocks.can_grow(seq.block_table, seq.num_computed_tokens + n):
                # The newest running sequence not scheduled in this step (at worst seq itself) is recomputed.
                victim = next(v for v in reversed(self.running) if v not in self._scheduled)
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status != SeqStatus.RUNNING:
                continue
            self.blocks.grow(seq.block_table, seq.num_computed_tokens + n)
            out.append(self._entry(seq, n))
            self._scheduled.append(seq)
            budget -= n
        # Admit new work only when nothing was preempted (the freed blocks go to the preempted first).
        loads: list[tuple[int, int]] = []
        lora_blocked = False
        for seq in list(self.waiting) if not preempted else []:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if (seq.lora_id is not None and lora_blocked) or seq.num_pending:
                continue
            hit, restore = self._cached_prefix(seq)
            start = len(hit) * self.blocks.block_size
            n = self._chunk(seq, start, budget)
            if self.blocks.blocks_needed(hit, start + n) + self.blocks.num_reviving(hit) > self.blocks.num_free:
                break
            if seq.lora_id is not None:
                assert self.lora is not None
                got = self.lora.acquire_slot(seq.lora_id)
                if got is None:  # every slot is held by running requests
                    lora_blocked = True
                    continue
                seq.lora_slot = got[0]
                if got[1]:
                    loads.append((got[0], seq.lora_id))
            if self.uses_state:  # one state slot per running sequence: the max_num_seqs check covers it
                seq.state_slot = self._free_states.pop()
            self.waiting.remove(seq)
            if self.blocks.enable_caching and not seq.num_computed_tokens:
                self._take_prefix(seq, hit)
            self.blocks.grow(seq.block_table, seq.num_computed_tokens + n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(self._entry(seq, n, restore))
            self._scheduled.append(seq)
            budget -= n
        # Ended ids travel with the next step that runs, so every rank drops their per-sequence state.
        ended, self._ended = (self._ended, []) if out else ([], self._ended)
        return SchedulerOutput(out, loads, ended, preempted)

    def _take_prefix(self, seq: Sequence, hit: list[int]) -> None:
        self.blocks.share(hit)
        seq.block_table.extend(hit)
        seq.num_computed_tokens = len(hit) * self.blocks.block_size
        seq.num_cached_blocks = len(hit)
        self.blocks.num_queries += seq.num_tokens
        self.blocks.num_hits += seq.num_computed_tokens
        if not seq.num_preemptions:
            seq.num_cached_tokens = seq.num_computed_tokens

    def unschedule(self, seqs: list[Sequence]) -> None:
        """These sequences' part of the last step will not run: forget the keys of the blocks it was to fill
        (and the snapshots it was to take)."""
        if self.snapshots is not None:
            self.snapshots.abandon({s.seq_id for s in seqs})
        bs = self.blocks.block_size
        for seq in seqs:
            done = seq.num_computed_tokens // bs
            self.blocks.uncache(seq.block_table[done:])
            seq.num_cached_blocks = min(seq.num_cached_blocks, done)

    def step_ran(self) -> None:
        """The last scheduled step ran: its state snapshots can be hit from now on."""
        if self.snapshots is not None:
            self.snapshots.commit()

    def reset_prefix_cache(self) -> None:
        self.blocks.reset_cache()
        if self.snapshots is not None:
            self.snapshots.clear()

    def keep_ended(self, seq_ids: list[int]) -> None:
        """A step that will not run after all hands its ended ids back for the next one."""
        self._ended[:0] = seq_ids

    def scheduled_sequences(self) -> list[Sequence]:
        """The Sequence objects behind the last schedule() output, in the same order."""
        return self._scheduled
