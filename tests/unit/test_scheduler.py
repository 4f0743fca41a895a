"""Scheduler and block manager, without a model (plain objects only)."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import EAGER_STEP_TOKENS, SchedulerConfig, step_budget
from engine.protocol import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus, Sequence
from engine.state_snapshots import SnapshotPool


def _seq(i: int, n: int) -> Sequence:
    return Sequence(i, f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=100))


def _run_step(s: Scheduler) -> list[tuple[int, int, bool]]:
    """Schedule, then pretend the model ran: advance computed tokens and append a token to sampled seqs."""
    out = s.schedule()
    for e, seq in zip(out.seqs, s.scheduled_sequences()):
        seq.num_computed_tokens += len(e.token_ids)
        if e.sample:
            seq.output_token_ids.append(7)
    return [(e.seq_id, len(e.token_ids), e.sample) for e in out.seqs]


def test_token_budget_chunks_prefill_and_mixes_decodes() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10), BlockManager(64, 4))
    s.add(_seq(0, 3))
    s.add(_seq(1, 25))
    assert _run_step(s) == [(0, 3, True), (1, 7, False)]
    assert _run_step(s) == [(0, 1, True), (1, 9, False)]
    assert _run_step(s) == [(0, 1, True), (1, 9, True)]
    assert _run_step(s) == [(0, 1, True), (1, 1, True)]


def test_default_step_budget_is_the_largest_mixed_graph_where_graphs_run() -> None:
    assert step_budget(None, 512, 64) == 512  # a GPU with mixed-step graphs: no step runs eagerly
    assert step_budget(None, 512, 1000) == 1000  # every decode row still fits one step
    assert step_budget(None, None, 64) == EAGER_STEP_TOKENS == 2048  # CPU, hybrid models, graphs off
    assert step_budget(100, 512, 64) == 100 and step_budget(7, None, 64) == 7  # an explicit budget stays
    s = Scheduler(SchedulerConfig(max_num_seqs=8), BlockManager(4096, 4))  # unresolved: the eager budget
    s.add(_seq(0, 3000))
    assert _run_step(s) == [(0, 2048, False)]


def test_max_num_seqs() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), BlockManager(64, 4))
    for i in range(4):
        s.add(_seq(i, 2))
    assert [e[0] for e in _run_step(s)] == [0, 1]
    s.finish(s.running[0])
    assert [e[0] for e in _run_step(s)] == [1, 2]


def test_preemption_recomputes_newest_and_frees_blocks() -> None:
    blocks = BlockManager(4, 4)  # 16 token slots
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), blocks)
    a, b = _seq(0, 7), _seq(1, 7)
    s.add(a)
    s.add(b)
    _run_step(s)  # both prefilled: 7 tokens in 2 blocks each
    assert _run_step(s) == [(0, 1, True), (1, 1, True)]  # position 7 still fits
    assert blocks.num_free == 0
    assert _run_step(s) == [(0, 1, True)]  # a needs a third block: b (newest) is preempted
    assert b.status == SeqStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    s.finish(a)
    assert blocks.num_free == 4
    assert _run_step(s) == [(1, 9, True)]  # recompute: prompt + its 2 generated tokens


def test_finish_returns_blocks_and_reports_ended_ids() -> None:
    blocks = BlockManager(8, 4)
    s = Scheduler(SchedulerConfig(), blocks)
    seq = _seq(0, 9)
    s.add(seq)
    _run_step(s)
    assert blocks.num_free == 5
    s.finish(seq)
    assert blocks.num_free == 8 and seq.block_table == []
    # A step with nothing to run reaches no rank: the ended id waits for the next step that runs.
    assert s.schedule().finished_seq_ids == []
    s.add(_seq(1, 3))
    assert s.schedule().finished_seq_ids == [0]
    s.keep_ended([0])  # that step did not run after all (its adapter could not be read)
    assert s.schedule().finished_seq_ids == [0]


def test_block_manager_accounting() -> None:
    bm = BlockManager(3, 16)
    t: list[int] = []
    assert bm.blocks_needed(t, 17) == 2
    bm.grow(t, 17)
    assert len(t) == 2 and bm.num_free == 1 and abs(bm.usage - 2 / 3) < 1e-9
    assert not bm.can_grow(t, 49)
    bm.free(t)
    assert bm.num_free == 3 and t == []


def test_decode_rows_take_the_budget_before_prompt_chunks() -> None:
    """The budget goes to decode rows first, then running prompts' chunks, then admissions. A hybrid model's
    prompt chunks stop at snapshot points, so a prompt admitted earlier can still be prefilling while a later,
    shorter one decodes: its chunk must not take that row's token (the old running-order rule gave seq 1 its
    3-token chunk at the fifth step and left seq 2 without its last token)."""
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4),
                  BlockManager(128, 4, enable_caching=True), num_state_slots=8, snapshots=SnapshotPool(8),
                  snapshot_interval=4)
    for i, n in enumerate((3, 13, 3)):
        s.add(_seq(i, n))
    steps = []
    for _ in range(7):
        steps.append(_run_step(s))
        s.step_ran()
    assert steps == [
        [(0, 3, True), (1, 1, False)],  # seq 1's chunk stops at the snapshot point 4
        [(0, 1, True), (1, 3, False)],
        [(0, 1, True), (1, 3, False)],
        [(0, 1, True), (1, 1, False), (2, 2, False)],
        [(0, 1, True), (2, 1, True), (1, 2, False)],  # seq 2's last prompt token before seq 1's chunk
        [(0, 1, True), (2, 1, True), (1, 2, False)],
        [(0, 1, True), (1, 1, True), (2, 1, True)],
    ]
