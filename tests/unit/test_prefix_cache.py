"""Prefix caching in the block manager and scheduler, without a model (plain objects only)."""

from __future__ import annotations

from pathlib import Path

from engine.block_manager import ROOT_KEY, BlockManager, block_key
from engine.config import LoRAConfig, SchedulerConfig
from engine.lora.manager import LoRAManager
from engine.protocol import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus, Sequence
from engine.state_snapshots import SnapshotPool
from tests.helpers import demo_shapes

BS = 4
DEMO = Path(__file__).resolve().parents[2] / "demo" / "adapters"


def _seq(i: int, tokens: list[int], lora_id: int | None = None) -> Sequence:
    return Sequence(i, f"r{i}", list(tokens), SamplingParams(max_tokens=100), lora_id)


def _sched(num_blocks: int = 64, budget: int = 100, caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
                     BlockManager(num_blocks, BS, enable_caching=caching))


def _step(s: Scheduler) -> dict[int, tuple[int, int]]:
    """Schedule and pretend the model ran; seq_id -> (start_pos, tokens computed)."""
    out = s.schedule()
    for e, seq in zip(out.seqs, s.scheduled_sequences()):
        seq.num_computed_tokens += len(e.token_ids)
        if e.sample:
            seq.output_token_ids.append(99)
    return {e.seq_id: (e.start_pos, len(e.token_ids)) for e in out.seqs}


def _run(s: Scheduler, seq: Sequence) -> tuple[int, int]:
    """Admit one sequence alone, prefill it, finish it; its (start_pos, computed) at admission."""
    s.add(seq)
    got = _step(s)[seq.seq_id]
    s.finish(seq)
    return got


PROMPT = list(range(1, 14))  # 13 tokens: 3 full blocks, the last token in a 4th


def test_a_hit_starts_after_the_cached_blocks_and_keeps_the_last_token() -> None:
    s = _sched()
    assert _run(s, _seq(0, PROMPT)) == (0, 13)
    b = _seq(1, [*PROMPT, 50, 51])
    assert _run(s, b) == (12, 3) and b.num_cached_tokens == 12
    exact = _seq(2, PROMPT[:12])  # 3 full blocks: the third is recomputed, so that the step samples
    assert _run(s, exact) == (8, 4)
    other = _seq(3, [7, *PROMPT[1:]])  # the first token differs: the chain breaks at block 0
    assert _run(s, other) == (0, 13)
    assert (s.blocks.num_queries, s.blocks.num_hits) == (13 + 15 + 12 + 13, 12 + 8)


def test_keys_separate_adapters_and_reloads() -> None:
    lora = LoRAManager(LoRAConfig(enable_lora=True, max_loras=2), demo_shapes())
    rev, up = (lora.load(n, str(DEMO / n)) for n in ("reverse", "upper"))
    s = Scheduler(SchedulerConfig(max_num_seqs=8), BlockManager(64, BS, enable_caching=True), lora)
    _run(s, _seq(0, PROMPT, rev))
    assert _run(s, _seq(1, PROMPT, up)) == (0, 13)  # another adapter
    assert _run(s, _seq(2, PROMPT, None)) == (0, 13)  # the base model has its own identity
    assert _run(s, _seq(3, PROMPT, rev)) == (12, 1)
    assert _run(s, _seq(4, PROMPT, None)) == (12, 1)
    lora.unload("reverse")
    reloaded = lora.load("reverse", str(DEMO / "sort"))  # the same name, other weights: a new identity
    assert _run(s, _seq(5, PROMPT, reloaded)) == (0, 13)
    assert block_key(ROOT_KEY, 0, [1, 2]) != block_key(ROOT_KEY, 1, [1, 2]) != block_key(b"x", 1, [1, 2])


def test_copies_admitted_in_one_step_share_the_blocks_the_first_computes() -> None:
    s = _sched()
    copies = [_seq(i, PROMPT) for i in range(3)]
    for c in copies:
        s.add(c)
    assert _step(s) == {0: (0, 13), 1: (12, 1), 2: (12, 1)}
    assert copies[1].block_table[:3] == copies[2].block_table[:3] == copies[0].block_table[:3]
    assert len({c.block_table[3] for c in copies}) == 3  # each its own last (partial) block
    assert s.blocks.num_free == 64 - 3 - 3


def test_refcounts_lru_eviction_and_free_accounting() -> None:
    s = _sched(num_blocks=8)
    a = _seq(0, PROMPT)
    s.add(a)
    _step(s)
    b = _seq(1, PROMPT)
    s.add(b)
    assert _step(s) == {0: (13, 1), 1: (12, 1)}  # b shares a's 3 full blocks
    s.finish(a)
    assert s.blocks.num_free == 8 - 4  # the shared blocks are still held by b
    s.finish(b)
    assert s.blocks.num_free == 8  # cached free blocks count as free
    # A 32-token prompt needs all 8 blocks: it evicts the cached ones; never-cached blocks go first.
    big = _seq(2, list(range(100, 132)))
    s.add(big)
    assert _step(s) == {2: (0, 32)}
    s.finish(big)
    assert _run(s, _seq(3, PROMPT)) == (0, 13)  # evicted: nothing left to hit


def test_lru_evicts_the_least_recently_freed_prefix_tail_first() -> None:
    s = _sched(num_blocks=9)
    _run(s, _seq(0, PROMPT))  # blocks of PROMPT freed first
    _run(s, _seq(1, [60 + t for t in PROMPT]))  # then those of another prompt
    # 4 blocks: the 3 never-cached ones, then PROMPT's tail block (the least recently freed).
    _run(s, _seq(2, list(range(200, 216))))
    assert _run(s, _seq(3, [60 + t for t in PROMPT])) == (12, 1)  # intact; its new block evicts PROMPT's block 1
    assert _run(s, _seq(4, PROMPT)) == (4, 9)  # PROMPT's head block survived


def test_preempted_sequence_hits_its_own_blocks_including_generated_tokens() -> None:
    s = _sched(num_blocks=6)
    a, b = _seq(0, PROMPT[:7]), _seq(1, [40 + t for t in PROMPT[:7]])
    s.add(a)
    s.add(b)
    _step(s)  # 7 tokens each: 2 blocks each
    _step(s)  # 8 tokens each: block 1 is full now and registered
    _step(s)  # a and b each need a third block: 2 free, fine
    _step(s)
    _step(s)
    _step(s)  # 12 tokens each
    assert a.num_tokens == 13 and s.blocks.num_free == 0
    assert _step(s) == {0: (12, 1)}  # a needs a 4th block: b is preempted
    assert b.status == SeqStatus.WAITING
    s.finish(a)
    # a's new block evicted b's tail block (the least recently freed); blocks 0-1 are left, and block 1
    # holds a generated token (position 7).
    assert _step(s) == {1: (8, 5)}


def test_uncache_and_reset_forget_keys() -> None:
    s = _sched()
    a = _seq(0, PROMPT)
    s.add(a)
    s.schedule()  # registered at scheduling ...
    s.unschedule([a])  # ... but that step did not run
    s.finish(a)
    assert _run(s, _seq(1, PROMPT)) == (0, 13)
    s.blocks.reset_cache()
    assert _run(s, _seq(2, PROMPT)) == (0, 13) and s.blocks.num_free == 64


def test_caching_off_never_hits() -> None:
    s = _sched(caching=False)
    _run(s, _seq(0, PROMPT))
    assert _run(s, _seq(1, PROMPT)) == (0, 13)
    assert s.blocks.num_queries == s.blocks.num_hits == 0


def test_chunked_prefill_registers_only_the_blocks_computed_so_far() -> None:
    s = _sched(budget=10)
    a, b = _seq(0, PROMPT), _seq(1, PROMPT)
    s.add(a)
    assert _step(s) == {0: (0, 10)}  # blocks 0-1 and half of block 2
    keys = [block_key(ROOT_KEY, 0, PROMPT[:4])]
    for i in (1, 2):
        keys.append(block_key(keys[-1], 0, PROMPT[4 * i:4 * i + 4]))
    assert s.blocks.lookup(keys) == a.block_table[:2]
    s.add(b)
    assert _step(s) == {0: (10, 3), 1: (12, 1)}  # a completes block 2 in this step, b shares it
    assert s.blocks.lookup(keys) == a.block_table[:3] == b.block_table[:3]


def _hybrid(snapshots: int, num_blocks: int = 64) -> Scheduler:
    """A hybrid model's scheduler: state slots, snapshots every 8 tokens (2 blocks)."""
    return Scheduler(SchedulerConfig(max_num_seqs=8), BlockManager(num_blocks, BS, enable_caching=True),
                     num_state_slots=8, snapshots=SnapshotPool(snapshots), snapshot_interval=8)


def _hybrid_step(s: Scheduler) -> dict[int, tuple[int, int, int, int]]:
    """Like _step, then the step 'ran'; seq_id -> (start_pos, tokens, restore slot, save slot)."""
    out = s.schedule()
    for e, seq in zip(out.seqs, s.scheduled_sequences()):
        seq.num_computed_tokens += len(e.token_ids)
        if e.sample:
            seq.output_token_ids.append(99)
    s.step_ran()
    return {e.seq_id: (e.start_pos, len(e.token_ids), e.state_restore, e.state_save) for e in out.seqs}


def test_hybrid_chunks_end_on_snapshot_points_and_hits_restore_them() -> None:
    s = _hybrid(snapshots=1)
    a = _seq(0, PROMPT)
    s.add(a)
    assert _hybrid_step(s) == {0: (0, 8, -1, 0)}  # the chunk stops at 8, where the state is saved
    assert _hybrid_step(s) == {0: (8, 5, -1, -1)}
    s.finish(a)
    b = _seq(1, PROMPT)
    s.add(b)
    # 3 full blocks are cached, but the state exists only at 8: the hit is cut back to it.
    assert _hybrid_step(s) == {1: (8, 5, 0, -1)} and b.num_cached_tokens == 8
    s.finish(b)
    c = _seq(2, [50 + t for t in PROMPT])
    s.add(c)
    assert _hybrid_step(s) == {2: (0, 8, -1, 0)}  # the one snapshot slot goes to c (LRU)
    _hybrid_step(s)
    s.finish(c)
    d = _seq(3, PROMPT)
    s.add(d)
    assert _hybrid_step(s) == {3: (0, 8, -1, 0)}  # PROMPT's KV is still cached, its state is not: no hit


def test_hybrid_copies_in_one_step_do_not_share_a_state_not_saved_yet() -> None:
    s = _hybrid(snapshots=4)
    for i in range(2):
        s.add(_seq(i, PROMPT))
    assert _hybrid_step(s) == {0: (0, 8, -1, 0), 1: (0, 8, -1, -1)}  # one snapshot per key
    s.add(_seq(2, PROMPT))
    assert _hybrid_step(s) == {0: (8, 5, -1, -1), 1: (8, 5, -1, -1), 2: (8, 5, 0, -1)}


def test_hybrid_snapshot_of_a_step_that_did_not_run_is_never_hit() -> None:
    s = _hybrid(snapshots=2)
    a = _seq(0, PROMPT)
    s.add(a)
    assert s.schedule().seqs[0].state_save == 0
    s.unschedule([a])  # that step did not run
    s.finish(a)
    s.step_ran()
    b = _seq(1, PROMPT)
    s.add(b)
    assert _hybrid_step(s) == {1: (0, 8, -1, 0)}  # no hit; the abandoned slot was free again
