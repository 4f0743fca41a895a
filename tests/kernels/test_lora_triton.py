"""Triton multi-LoRA shrink / expand (kernels.lora_triton, engine.lora.punica.TritonLoRABatch) vs kernels.reference.

Run: .venv/bin/python -m pytest tests/kernels/test_lora_triton.py -q
Compiled Triton needs an accelerator; on a CPU-only machine the kernel cases run in a child pytest with
TRITON_INTERPRET=1 (it must be set before triton is imported), started by test_kernels_under_interpreter.
Everything skips cleanly where triton is not installed.

Tolerances against the reference (fp32 products, fp32 accumulation, one rounding to y's dtype), as
(rtol, atol relative to max|ref|):
- float32: the kernels also multiply and accumulate in fp32 (ieee dots), only the summation order
  differs: ~K * 2^-24 of the terms' size, K <= 96 here, far below 1e-5 of the output scale.
- bfloat16: the shrink is exact up to order (bf16 products are exact in fp32); the expand rounds the
  fp32 shrink result to bf16 (2^-9 relative) for the tensor-core dot on a GPU; the result is rounded to
  bf16 (2^-8) like the reference's, where the two may land one ulp apart, and `y +=` rounds once more.
  So two bf16 ulps relative (1.6e-2) plus 1e-2 of the output scale for outputs near zero.
A wrong slot, a missed rank truncation or a dropped add moves outputs by O(1) of their scale.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.lora.punica import SlotRanks, TritonLoRABatch, group_tokens
from kernels import reference
from tests.kernels.triton_env import DEV, HAS_TRITON, assert_close_rel, needs_kernels, pytest_under_interpreter

REPO = Path(__file__).resolve().parents[2]

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}



def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra}


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert_close_rel(out, ref, TOLERANCES[dtype], what)


def _problem(seed: int, sizes: list[int], dtype: torch.dtype, num_tokens: int = 36, k: int = 96,
             num_slots: int = 5, r_max: int = 64, rank_major: bool = False) -> dict:
    """Random layer with `len(sizes)` slices: A/B padding past each rank filled with garbage (not zeros),
    slots shuffled with -1s and one slot holding a run longer than one M-block. rank_major: each B
    [S, n, r_max] is a transposed view of [S, r_max, n] storage."""
    g = torch.Generator().manual_seed(seed)
    pool = [1, 8, 16, 64, 0]
    ranks = [[pool[(i + s) % len(pool)] for i in range(num_slots)] for s in range(len(sizes))]
    a = [torch.randn(num_slots, r_max, k, generator=g).to(dtype) for _ in sizes]
    b = [(torch.randn(num_slots, n, r_max, generator=g) / 4).to(dtype) for n in sizes]
    if rank_major:
        b = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in b]
    slots = [0] * 18 + [-1] * 6 + [(i % num_slots) for i in range(num_tokens - 24)]
    slots = [slots[i] for i in torch.randperm(len(slots), generator=g).tolist()]
    x = torch.randn(num_tokens, k, generator=g).to(dtype)
    y = torch.randn(num_tokens, sum(sizes) + 3, generator=g).to(dtype)  # 3 extra columns nobody writes
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return dict(a=a, b=b, ranks=ranks, slots=torch.tensor(slots), x=x, y=y, offsets=offsets, num_slots=num_slots)


def _to(p: dict, dev: torch.device) -> dict:
    q = dict(p)
    for key in ("x", "y", "slots"):
        q[key] = p[key].to(dev)
    q["a"] = [t.to(dev) for t in p["a"]]
    q["b"] = [t.to(dev) for t in p["b"]]
    return q


def _ranks(ranks: list[list[int]], dev: torch.device) -> torch.Tensor:
    return torch.tensor(ranks, dtype=torch.int32, device=dev)


@pytest.fixture(params=["split", "fused", "cols"])
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """add_lora as two launches (the K-split shrink, then the split or, cols, up to 64 tokens the column expand) or
    one (the fused kernel)."""
    from kernels import lora_triton

    monkeypatch.setitem(lora_triton.CONFIG_OVERRIDES, "fused", int(request.param == "fused"))
    monkeypatch.setitem(lora_triton.CONFIG_OVERRIDES, "cols", 64 if request.param == "cols" else 0)
    return request.param


class _Boom:
    """Stands in for a kernel that must not launch: `kernel[grid]` raises."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __getitem__(self, grid: object) -> None:
        raise AssertionError(self.why)


def _reference(p: dict, add_inputs: bool) -> torch.Tensor:
    y = p["y"].clone()
    for a, b, r, off in zip(p["a"], p["b"], p["ranks"], p["offsets"]):
        buf = reference.lora_shrink(p["x"], a, p["slots"], r)
        reference.lora_expand(y, buf, b, p["slots"], r, off, add_inputs)
    return y


# ----------------------------------------------------------------------------------------------------
# kernels vs reference


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sizes", [[40], [48, 16], [48, 16, 24]], ids=["1slice", "2slices-rank-major-B", "3slices"])
@pytest.mark.parametrize("add_inputs", [True, False], ids=["add", "replace"])
def test_add_lora_matches_reference(dtype: torch.dtype, sizes: list[int], add_inputs: bool, variant: str) -> None:
    from kernels.lora_triton import add_lora

    assert DEV is not None
    p = _problem(len(sizes) * 10 + add_inputs, sizes, dtype, rank_major=len(sizes) == 2)
    ref = _reference(p, add_inputs)
    d = _to(p, DEV)
    assert d["b"][0].stride(1) == (1 if len(sizes) == 2 else 64)
    info = group_tokens(p["slots"].tolist(), p["num_slots"], device=DEV)
    rt = _ranks(p["ranks"], DEV)
    out = add_lora(d["y"].clone(), d["x"], d["a"], d["b"], info, d["offsets"], rt, add_inputs=add_inputs)
    _assert_close(out, ref, dtype, f"{dtype} {sizes} add={add_inputs}")
    out_cpu, y_cpu = out.cpu(), p["y"]
    none = p["slots"] < 0
    assert torch.equal(out_cpu[none], y_cpu[none]), "slot -1 rows must be untouched"
    assert torch.equal(out_cpu[:, -3:], y_cpu[:, -3:]), "columns outside every slice must be untouched"
    if len(sizes) != 3:
        return
    # Deterministic: the same launch gives the same bits.
    again = add_lora(d["y"].clone(), d["x"], d["a"], d["b"], info, d["offsets"], rt, add_inputs=add_inputs)
    assert torch.equal(out, again)
    # The engine's batch (built from the host slot list) gives the same bits.
    batch = TritonLoRABatch.build(p["slots"].tolist(), p["num_slots"], DEV)
    via = batch.add_lora(d["y"].clone(), d["x"], d["a"], d["b"], SlotRanks(p["ranks"], rt), d["offsets"], add_inputs)
    assert torch.equal(out, via)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_single_slice_shrink_and_expand_match_reference(dtype: torch.dtype) -> None:
    """TritonLoRABatch.shrink / expand (the fully sharded path's separate calls)."""
    assert DEV is not None
    p = _problem(3, [40], dtype, num_tokens=30)
    d = _to(p, DEV)
    a, b, r = p["a"][0], p["b"][0], p["ranks"][0]
    batch, sr = TritonLoRABatch.build(p["slots"].tolist(), p["num_slots"], DEV), SlotRanks([r], _ranks([r], DEV))
    buf_ref = reference.lora_shrink(p["x"], a, p["slots"], r)
    buf = batch.shrink(d["x"], d["a"][0], sr)
    assert buf.dtype == torch.float32 and buf.shape == buf_ref.shape
    _assert_close(buf, buf_ref, torch.float32 if dtype == torch.float32 else torch.bfloat16)
    # Rows of slot -1 and columns past each slot's rank are exactly zero, as in the reference.
    assert torch.equal(buf.cpu() == 0, buf_ref == 0)
    for add_inputs in (True, False):
        ref = reference.lora_expand(p["y"].clone(), buf_ref, b, p["slots"], r, 2, add_inputs)
        out = batch.expand(d["y"].clone(), buf_ref.to(DEV), d["b"][0], sr, 2, add_inputs)
        _assert_close(out, ref, dtype, f"expand add={add_inputs}")
    with pytest.raises(ValueError, match="does not match LoRA B"):  # seed bug 2: a gathered, wider buffer
        batch.expand(d["y"], torch.zeros(30, 128, device=DEV), d["b"][0], sr, 0)


@needs_kernels
def test_rank_zero_slot_replace_writes_zeros(variant: str) -> None:
    from kernels.lora_triton import add_lora

    assert DEV is not None
    p = _problem(7, [24, 8], torch.float32, num_tokens=28)
    p["ranks"] = [[0, 64, 70, 2, 9], [5, 0, 16, 64, 1]]  # 70 > r_max: truncated to r_max like the reference
    d = _to(p, DEV)
    ref = _reference(p, add_inputs=False)
    info = group_tokens(d["slots"], p["num_slots"])
    assert info.has_lora is (True if DEV.type == "cpu" else None)  # a device tensor: unknown without a sync
    rt = _ranks(p["ranks"], DEV)
    out = add_lora(d["y"].clone(), d["x"], d["a"], d["b"], info, d["offsets"], rt, add_inputs=False)
    _assert_close(out, ref, torch.float32)
    rows0 = (p["slots"] == 0).nonzero().flatten()
    assert bool((out.cpu()[rows0, :24] == 0).all()), "slot 0 has rank 0 in slice 0: replace writes zeros"
    with pytest.raises(ValueError, match="int32"):  # the launchers take the device tensor only
        add_lora(d["y"].clone(), d["x"], d["a"], d["b"], info, d["offsets"], rt.long(), add_inputs=False)


@needs_kernels
@pytest.mark.parametrize("block_k, split_k", [(32, 3), (64, 2)], ids=["split3", "split2-uneven-k"])
def test_shrink_split_k_sums_in_order(monkeypatch: pytest.MonkeyPatch, block_k: int, split_k: int) -> None:
    """K cut into splits (partials summed by the expand, or by lora_shrink), K not a multiple of the tile."""
    from kernels import lora_config, lora_triton

    assert DEV is not None
    monkeypatch.setitem(lora_triton.CONFIG_OVERRIDES, "shrink_block_k", block_k)
    monkeypatch.setitem(lora_triton.CONFIG_OVERRIDES, "shrink_split_k", split_k)
    assert lora_config.shrink_config(96)["split_k"] == split_k
    p = _problem(21, [40, 8], torch.float32, num_tokens=30)
    d = _to(p, DEV)
    info, rt = group_tokens(p["slots"].tolist(), p["num_slots"], device=DEV), _ranks(p["ranks"], DEV)
    out = lora_triton.add_lora(d["y"].clone(), d["x"], d["a"], d["b"], info, d["offsets"], rt)
    _assert_close(out, _reference(p, True), torch.float32, f"split_k={split_k}")
    buf = lora_triton.lora_shrink(d["x"], d["a"], info, rt)
    for i in range(2):
        _assert_close(buf[i], reference.lora_shrink(p["x"], p["a"][i], p["slots"], p["ranks"][i]), torch.float32)


@needs_kernels
def test_no_lora_step_launches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import lora_triton

    assert DEV is not None
    p = _to(_problem(1, [16, 8], torch.float32, num_tokens=30), DEV)
    boom = _Boom("a kernel was launched for a step without LoRA tokens")
    monkeypatch.setattr(lora_triton, "_lora_shrink_kernel", boom)
    monkeypatch.setattr(lora_triton, "_lora_expand_kernel", boom)
    monkeypatch.setattr(lora_triton, "_lora_expand_cols_kernel", boom)
    info, rt = group_tokens([-1] * 30, p["num_slots"], device=DEV), _ranks(p["ranks"], DEV)
    assert info.has_lora is False
    y = p["y"].clone()
    for add_inputs in (True, False):
        assert lora_triton.add_lora(y, p["x"], p["a"], p["b"], info, p["offsets"], rt, add_inputs=add_inputs) is y
    assert torch.equal(y, p["y"])
    empty = group_tokens(torch.zeros(0, dtype=torch.long, device=DEV), 4)
    assert empty.num_blocks == 0


@needs_kernels
@pytest.mark.parametrize(("num_tokens", "r_max", "num_slots", "used", "fp8"),
                         [(36, 64, 5, None, False), (36, 16, 5, None, False), (36, 16, 2, None, False),
                          (36, 16, 40, [3, 17, 21, 38, 39], False), (36, 16, 5, None, True), (65, 64, 5, None, False)],
                         ids=["cols", "cols-4-slots-per-dot", "cols-fewer-slots-than-a-dot", "cols-sparse-slots",
                              "cols-fp8", "too-many-tokens-for-cols"])
def test_column_expand_takes_small_steps_only(monkeypatch: pytest.MonkeyPatch, num_tokens: int, r_max: int,
                                              num_slots: int, used: list[int] | None, fp8: bool) -> None:
    """With cols=64 a step of <= 64 tokens expands through the column kernel alone (the split kernel would raise),
    bit for bit as the split expand; a larger step keeps the split kernel (the column kernel would raise). Rank 16
    puts 4 used slots in each dot: of 5 the last dot holds one, of 2 the only dot holds both; 5 used slots spread
    over 40 (some of rank 0 in a slice) share dots across the idle ones between them. fp8 B: each token's sum is
    scaled by its own slot's row scales after the loop over the slot groups, as the split kernel scales per slot."""
    from kernels import lora_triton

    assert DEV is not None
    p = _problem(7, [48, 16, 24], torch.bfloat16, num_tokens=num_tokens, r_max=r_max, num_slots=num_slots)
    p["ranks"] = [[min(r, r_max) for r in row] for row in p["ranks"]]
    if used is not None:  # the tokens' slots drawn from `used` and -1 only
        p["slots"] = torch.tensor([[-1, *used][i % (len(used) + 1)] for i in range(num_tokens)])
    if fp8:
        p = _fp8(p)
    d, info, rt = _to(p, DEV), group_tokens(p["slots"].tolist(), p["num_slots"], device=DEV), _ranks(p["ranks"], DEV)
    scales = ([t.to(DEV) for t in p["sa"]], [t.to(DEV) for t in p["sb"]]) if fp8 else (None, None)
    monkeypatch.setitem(lora_triton.CONFIG_OVERRIDES, "cols", 0)
    monkeypatch.setitem(lora_triton.CONFIG_OVERRIDES, "cols_block_n", 32)  # a GPU's width (the interpreter's: 256)
    split = lora_triton.add_lora(d["y"].clone(), d["x"], d["a"], d["b"], info, d["offsets"], rt, True, *scales)
    monkeypatch.setitem(lora_triton.CONFIG_OVERRIDES, "cols", 64)
    wrong = "_lora_expand_kernel" if num_tokens <= 64 else "_lora_expand_cols_kernel"
    monkeypatch.setattr(lora_triton, wrong, _Boom("the wrong expand kernel ran"))
    out = lora_triton.add_lora(d["y"].clone(), d["x"], d["a"], d["b"], info, d["offsets"], rt, True, *scales)
    _assert_close(out, _reference_scaled(p, True) if fp8 else _reference(p, True), torch.bfloat16,
                  f"{num_tokens} tokens")
    assert torch.equal(out, split), "each token takes its own slot's rows only: the same value as the split expand"


@needs_kernels
@pytest.mark.parametrize("expand", ["split", "cols"])
def test_expand_reads_only_what_the_shrink_wrote(monkeypatch: pytest.MonkeyPatch, expand: str) -> None:
    """expand_partials on partials holding NaN where no shrink writes (columns past each token's rank, rows without
    an adapter), as a joined or split shrink leaves them: both expands equal the reference, which reads each row's
    first r columns only. The column expand loads the sums without waiting on the ranks and must zero the rest."""
    from kernels import lora_triton

    assert DEV is not None
    monkeypatch.setitem(lora_triton.CONFIG_OVERRIDES, "cols", 64 if expand == "cols" else 0)
    monkeypatch.setattr(lora_triton, "_lora_expand_cols_kernel" if expand == "split" else "_lora_expand_kernel",
                        _Boom("the other expand kernel ran"))
    p = _problem(11, [48, 16, 24], torch.bfloat16, r_max=16)
    p["ranks"] = [[min(r, 16) for r in row] for row in p["ranks"]]
    t = p["slots"].numel()
    buf = torch.randn(3, 3, t, 16, generator=torch.Generator().manual_seed(12))
    for s, ranks in enumerate(p["ranks"]):
        for i, slot in enumerate(p["slots"].tolist()):
            buf[:, s, i, ranks[slot] if slot >= 0 else 0:] = float("nan")
    info, rt = group_tokens(p["slots"].tolist(), p["num_slots"], device=DEV), _ranks(p["ranks"], DEV)
    out = lora_triton.expand_partials(p["y"].to(DEV).clone(), buf.to(DEV), [b.to(DEV) for b in p["b"]], info,
                                      p["offsets"], rt)
    ref = p["y"].clone()
    for s, (b, ranks, off) in enumerate(zip(p["b"], p["ranks"], p["offsets"])):
        reference.lora_expand(ref, buf[:, s].sum(0), b, p["slots"], ranks, off, True)
    assert torch.isfinite(out).all(), "a NaN the shrink never wrote reached the output"
    _assert_close(out, ref, torch.bfloat16, expand)


@needs_kernels
@pytest.mark.parametrize("broken", [None, "_lora_expand_kernel", "_lora_expand_cols_kernel"])
def test_start_up_check_runs_both_expands(monkeypatch: pytest.MonkeyPatch, broken: str | None) -> None:
    """The engine's start-up check (engine.lora.impl_check.choose_impl) runs a decode-sized step and one past the column
    kernels' 64 tokens, so a broken split expand or a broken column expand alone sends LoRA to the reference."""
    from engine.lora.impl_check import choose_impl
    from engine.lora.punica import ReferenceLoRABatch, TritonLoRABatch
    from kernels import lora_triton

    assert DEV is not None
    if broken is not None:
        monkeypatch.setattr(lora_triton, broken, _Boom(f"{broken} is broken"))
    impl, choice = choose_impl(["triton", "reference"], 64, [32, 16], 16, 4, torch.float32, DEV)
    if broken is None:
        assert impl is TritonLoRABatch and choice.chosen == "triton" and choice.checked
    else:
        assert impl is ReferenceLoRABatch and choice.chosen == "reference"
        assert choice.rejected[0][0] == "triton" and f"{broken} is broken" in choice.rejected[0][1], choice


@needs_kernels
def test_group_tokens_schedule_and_in_place_update() -> None:
    from kernels.lora_triton import max_blocks

    assert DEV is not None
    g = torch.Generator().manual_seed(5)
    for num_slots, t, bm in ((6, 70, 16), (64, 64, 16), (3, 200, 32)):
        slots = torch.randint(-1, num_slots, (t,), generator=g)
        info = group_tokens(slots.to(DEV), num_slots, block_m=bm)
        assert info.num_blocks == max_blocks(t, num_slots, bm)
        srt = info.part(1).cpu().long()
        assert sorted(srt.tolist()) == list(range(t))
        assert slots[srt].tolist() == sorted(slots.tolist(), key=lambda s: num_slots if s < 0 else s)
        covered: list[int] = []
        for blk, start, end in zip(info.part(4).tolist(), info.part(5).tolist(), info.part(6).tolist()):
            if blk >= num_slots:
                continue
            rows = srt[start:min(start + bm, end)].tolist()
            assert rows and all(int(slots[r]) == blk for r in rows)
            covered += rows
        assert sorted(covered) == sorted((slots >= 0).nonzero().flatten().tolist()), "each LoRA token in one block"
        assert info.part(3).cpu().tolist() == [int((slots == s).sum()) for s in range(num_slots)]
    # A host list (scheduled on the CPU, one copy) and a device tensor (scheduled there) agree.
    slots = torch.randint(-1, 5, (50,), generator=g)
    host = group_tokens(slots.tolist(), 5, device=DEV)
    assert host.has_lora is True and torch.equal(host.meta, group_tokens(slots.to(DEV), 5).meta)
    # In place (graph replay): same tensors, new contents.
    batch = TritonLoRABatch.build([0, 1, -1, 1], 2, DEV)
    info = batch.groups
    ptrs = [info.part(1).data_ptr(), info.part(4).data_ptr()]
    batch.update([1, 1, 1, -1])
    assert batch.groups is info and ptrs == [info.part(1).data_ptr(), info.part(4).data_ptr()]
    assert info.part(3).tolist() == [0, 3]
    with pytest.raises(ValueError, match="outside"):
        group_tokens([0, 2], 2)
    with pytest.raises(ValueError, match="T=4"):
        batch.update([0, 1, 1])


@needs_kernels
def test_shape_checks() -> None:
    from kernels.lora_triton import lora_expand, lora_shrink

    assert DEV is not None
    p = _to(_problem(2, [16, 8], torch.float32, num_tokens=30), DEV)
    info, rt = group_tokens(p["slots"], p["num_slots"]), _ranks(p["ranks"], DEV)
    with pytest.raises(ValueError, match="inputs"):
        lora_shrink(p["x"][:, :50], p["a"], info, rt)
    with pytest.raises(ValueError, match="tokens"):
        lora_shrink(p["x"][:10], p["a"], info, rt)
    with pytest.raises(ValueError, match="slices"):
        lora_shrink(p["x"], p["a"][:1], info, rt)  # rt has two slices
    buf = lora_shrink(p["x"], p["a"], info, rt)
    with pytest.raises(ValueError, match="outside y"):
        lora_expand(p["y"], buf, p["b"], info, [0, p["y"].size(1) - 4], rt)
    with pytest.raises(ValueError, match="does not match"):
        lora_expand(p["y"], torch.zeros(2, 30, 128, device=DEV), p["b"], info, p["offsets"], rt)


def _fp8(p: dict) -> dict:
    """The problem with A and B stored as fp8 e4m3 + float32 scales (per rank row of A, per output row of B)."""
    q = dict(p)
    qa, qb, sa, sb = [], [], [], []
    for a, b in zip(p["a"], p["b"]):
        a8, a_s = reference.fp8_rows(a.float().reshape(-1, a.size(-1)))
        b8, b_s = reference.fp8_rows(b.float().reshape(-1, b.size(-1)))
        qa.append(a8.view(a.shape))
        qb.append(b8.view(b.shape).transpose(1, 2).contiguous().transpose(1, 2))  # rank-major, as the wrappers
        sa.append(a_s.view(a.shape[:2]))
        sb.append(b_s.view(b.shape[:2]))
    q.update(a=qa, b=qb, sa=sa, sb=sb)
    return q


def _reference_scaled(p: dict, add_inputs: bool) -> torch.Tensor:
    y = p["y"].clone()
    for i, (a, b, r, off) in enumerate(zip(p["a"], p["b"], p["ranks"], p["offsets"])):
        buf = reference.lora_shrink(p["x"], a, p["slots"], r, a_scale=p["sa"][i])
        reference.lora_expand(y, buf, b, p["slots"], r, off, add_inputs, b_scale=p["sb"][i])
    return y


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sizes", [[40], [48, 16, 24]], ids=["1slice", "3slices"])
@pytest.mark.parametrize("add_inputs", [True, False], ids=["add", "replace"])
def test_fp8_weights_match_the_dequantizing_reference(dtype: torch.dtype, sizes: list[int], add_inputs: bool, variant: str) -> None:
    """fp8 A/B decoded in the kernel (bit operations) and scaled per row = the reference's dequantized fp32
    weights, to the compute dtype's tolerance: the same quantized values on both sides."""
    from engine.lora.punica import Scales
    from kernels.lora_triton import add_lora, lora_expand, lora_shrink

    assert DEV is not None
    p = _fp8(_problem(40 + len(sizes) + add_inputs, sizes, dtype))
    ref = _reference_scaled(p, add_inputs)
    d = _to(p, DEV)
    sa, sb = [t.to(DEV) for t in p["sa"]], [t.to(DEV) for t in p["sb"]]
    info, rt = group_tokens(p["slots"].tolist(), p["num_slots"], device=DEV), _ranks(p["ranks"], DEV)
    out = add_lora(d["y"].clone(), d["x"], d["a"], d["b"], info, d["offsets"], rt, add_inputs, sa, sb)
    _assert_close(out, ref, dtype, f"fp8 {dtype} {sizes}")
    # The engine batch, and the separate shrink / expand of the fully sharded path.
    batch = TritonLoRABatch.build(p["slots"].tolist(), p["num_slots"], DEV)
    via = batch.add_lora(d["y"].clone(), d["x"], d["a"], d["b"], SlotRanks(p["ranks"], rt), d["offsets"], add_inputs,
                         Scales(sa, sb))
    assert torch.equal(out, via)
    buf = lora_shrink(d["x"], d["a"], info, rt, a_scales=sa)
    buf_ref = [reference.lora_shrink(p["x"], a, p["slots"], r, a_scale=c) for a, r, c in zip(p["a"], p["ranks"], p["sa"])]
    _assert_close(buf, torch.stack(buf_ref), dtype, "fp8 shrink")
    y2 = lora_expand(d["y"].clone(), torch.stack(buf_ref).to(DEV), d["b"], info, d["offsets"], rt, add_inputs, sb)
    _assert_close(y2, ref, dtype, "fp8 expand")
    with pytest.raises(ValueError, match="scales"):
        add_lora(d["y"].clone(), d["x"], d["a"], d["b"], info, d["offsets"], rt, add_inputs)
    assert all(a.dtype == torch.float8_e4m3fn for a in d["a"] + d["b"])


@needs_kernels
@pytest.mark.parametrize(("run", "r_max", "pool"), [(64, 16, [16, 3, 0, 9]), (32, 128, [128, 70, 1, 0, 65])],
                         ids=["runs64-rmax16", "runs32-rmax128"])
def test_runs_of_one_slot_and_wide_ranks(monkeypatch: pytest.MonkeyPatch, run: int, r_max: int,
                                         pool: list[int], variant: str) -> None:
    """A program takes a run of up to `run` tokens of one slot (several 16-row tiles: the slot's weights are read
    once for all of them); ranks above 64 take several rank chunks, each slot computing only below its rank."""
    from kernels import lora_triton

    assert DEV is not None
    monkeypatch.setitem(lora_triton.CONFIG_OVERRIDES, "block_m", 16)
    p = _problem(50 + r_max, [40, 24], torch.float32, num_tokens=70, r_max=r_max, rank_major=True)
    p["ranks"] = [[pool[(i + s) % len(pool)] for i in range(p["num_slots"])] for s in range(2)]
    slots = p["slots"].tolist()
    assert max(slots.count(s) for s in set(slots)) > 16  # a run spanning several tiles
    d = _to(p, DEV)
    info, rt = group_tokens(slots, p["num_slots"], device=DEV, block_m=run), _ranks(p["ranks"], DEV)
    for add_inputs in (True, False):
        out = lora_triton.add_lora(d["y"].clone(), d["x"], d["a"], d["b"], info, d["offsets"], rt, add_inputs)
        _assert_close(out, _reference(p, add_inputs), torch.float32, f"run {run} r_max {r_max} add={add_inputs}")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("r_max", "fp8"), [(16, False), (128, False), (16, True)], ids=["rmax16", "rmax128", "fp8"])
def test_one_token_programs(dtype: torch.dtype, r_max: int, fp8: bool, variant: str) -> None:
    """Runs of one token (TokenGroups.block_m = 1, XPULORA_LORA_CONFIG=run_m=1): each program multiplies one
    token's row without tl.dot's 16-row tile (kernels.lora_kernels._mm), in every kernel, several rank chunks and
    fp8 weights included; slots with many tokens then take one program per token."""
    from kernels import lora_config, lora_triton

    assert DEV is not None
    p = _problem(90 + r_max, [40, 8, 24], dtype, num_tokens=30, r_max=r_max, rank_major=True)
    if fp8:
        p = _fp8(p)
    d = _to(p, DEV)
    scales = ([t.to(DEV) for t in p["sa"]], [t.to(DEV) for t in p["sb"]]) if fp8 else (None, None)
    info, rt = group_tokens(p["slots"].tolist(), p["num_slots"], device=DEV, block_m=1), _ranks(p["ranks"], DEV)
    assert info.block_m == 1 and lora_config.block_m(info.block_m) == 1
    for add_inputs in (True, False):
        out = lora_triton.add_lora(d["y"].clone(), d["x"], d["a"], d["b"], info, d["offsets"], rt, add_inputs,
                                   *scales)
        ref = _reference_scaled(p, add_inputs) if fp8 else _reference(p, add_inputs)
        _assert_close(out, ref, dtype, f"one-token programs, add={add_inputs}")


@needs_kernels
def test_fully_sharded_shapes_and_wrapper_storage(variant: str) -> None:
    """The wrappers' storage: slice views of one [S, rows, n*K] A store (strided rank rows) and of one rank-major
    [S, r_max, sum n] B store; a fully sharded column layer's A holds r_max / tp rows (its shrink result is
    gathered to r_max before the expand)."""
    from kernels.lora_triton import add_lora, lora_expand, lora_shrink

    assert DEV is not None
    g = torch.Generator().manual_seed(9)
    s_, k, sizes, r_max = 4, 48, [32, 16, 16], 16
    a_store = torch.randn(s_, r_max, 3 * k, generator=g)
    b_store = torch.randn(s_, r_max, sum(sizes), generator=g) / 4
    a = [a_store[:, :, i * k:(i + 1) * k] for i in range(3)]
    offs = [0, 32, 48]
    b = [b_store[:, :, o:o + n].transpose(1, 2) for o, n in zip(offs, sizes)]
    ranks = [[16, 5, 0, 9], [3, 16, 1, 0], [0, 2, 16, 16]]
    slots = torch.tensor([3, -1, 0, 1, 1, 2, -1, 0, 3, 3, 2, 1])
    x = torch.randn(len(slots), k, generator=g)
    y = torch.randn(len(slots), sum(sizes), generator=g)
    ref = y.clone()
    for ai, bi, r, off in zip(a, b, ranks, offs):
        reference.lora_expand(ref, reference.lora_shrink(x, ai, slots, r), bi, slots, r, off, True)
    a_d = list(a_store.to(DEV).split(k, dim=2))
    b_st = b_store.to(DEV)
    b_d = [b_st[:, :, o:o + n].transpose(1, 2) for o, n in zip(offs, sizes)]
    info, rt = group_tokens(slots.tolist(), s_, device=DEV), _ranks(ranks, DEV)
    out = add_lora(y.clone().to(DEV), x.to(DEV), a_d, b_d, info, offs, rt)
    _assert_close(out, ref, torch.float32, "wrapper storage")
    # Fully sharded, rank 1 of 2: A rows [8, 16) of each slot; valid rows per slot = clamp(rank - 8, 0, 8).
    a_half = [t[:, 8:] for t in a_d]
    a_ranks = [[max(0, min(8, r - 8)) for r in row] for row in ranks]
    part = lora_shrink(x.to(DEV), a_half, info, _ranks(a_ranks, DEV))
    for i in range(3):
        want = reference.lora_shrink(x, a[i][:, 8:], slots, a_ranks[i])
        _assert_close(part[i], want, torch.float32, f"sharded shrink slice {i}")
    full = torch.stack([reference.lora_shrink(x, ai, slots, r) for ai, r in zip(a, ranks)])
    got = lora_expand(y.clone().to(DEV), full.to(DEV), b_d, info, offs, rt)
    _assert_close(got, ref, torch.float32, "expand of the gathered result")


@pytest.mark.skipif(DEV is None or DEV.type != "cuda", reason="graph capture is checked on CUDA")
def test_cuda_graph_capture_and_replay_with_new_mapping(variant: str) -> None:
    """The kernels need no host sync: capture once, then replay after writing a new mapping in place."""
    from kernels.lora_triton import add_lora

    assert DEV is not None
    p = _problem(11, [48, 16, 24], torch.bfloat16, num_tokens=40)
    d = _to(p, DEV)
    ranks = _ranks(p["ranks"], DEV)
    info = group_tokens(d["slots"], p["num_slots"])
    y = d["y"].clone()
    add_lora(y, d["x"], d["a"], d["b"], info, d["offsets"], ranks)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora(y, d["x"], d["a"], d["b"], info, d["offsets"], ranks)
    new_slots = p["slots"].roll(7)
    group_tokens(new_slots.to(DEV), p["num_slots"], out=info)
    y.copy_(d["y"])
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(y, _reference(dict(p, slots=new_slots), True), torch.bfloat16, "graph replay")


# ----------------------------------------------------------------------------------------------------
# the same cases on the CPU under the Triton interpreter


def test_kernels_under_interpreter() -> None:
    pytest_under_interpreter(__file__, "not interpreter and not bench and not cuda_graph")


def test_imports_and_reference_backends_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch, engine.lora.punica as P, kernels.attention as A, kernels.lora_triton as LT\n"
        "import kernels.triton_env as TE\nassert LT.triton is None and TE.triton is None and not TE.usable()\n"
        "r = P.SlotRanks([[2]], torch.tensor([[2]], dtype=torch.int32))\n"
        "y = P.ReferenceLoRABatch.build([0, -1], 1, torch.device('cpu')).add_lora(\n"
        "    torch.zeros(2, 4), torch.ones(2, 3), [torch.ones(1, 2, 3)], [torch.ones(1, 4, 2)], r, [0])\n"
        "assert y[0].tolist() == [6.0] * 4 and y[1].tolist() == [0.0] * 4\n"
        "info = P.group_tokens([0, -1], 1)\n"
        "try:\n"
        "    LT.add_lora(torch.zeros(2, 4), torch.ones(2, 3), [torch.ones(1, 2, 3)], [torch.ones(1, 4, 2)], info, [0],\n"
        "                r.device)\n"
        "except RuntimeError as e:\n"
        "    assert 'triton' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no error without triton')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------------------
# benchmark scripts: a CPU smoke run (--quick), so they cannot rot between runs on a GPU


@pytest.mark.parametrize("script", ["bench_lora.py", "bench_int4.py"])
def test_bench_quick_runs_on_cpu(script: str) -> None:
    # The triton columns under the interpreter on CPU-only machines (an accelerator runs them compiled).
    interp = HAS_TRITON and DEV is None
    extra = {"TRITON_INTERPRET": "1"} if interp else {}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--quick", "--device", "cpu"],
                          cwd=REPO, env=_env(**extra), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if script == "bench_lora.py":  # one line per layer kind and case, then one per decoder-layer step
        lines = [rec for rec in lines if rec.get("case") == "layer"]
    assert lines and all("us" in json.dumps(rec) for rec in lines), proc.stdout[-3000:]
    if interp:
        key = "eager_us" if script == "bench_lora.py" else "triton_us"
        assert any(rec.get(key) is not None for rec in lines), proc.stdout[-3000:]


@pytest.mark.skipif(not HAS_TRITON, reason="the script's add_lora needs triton (the interpreter on a CPU)")
@pytest.mark.skipif(DEV is not None and DEV.type != "cpu",
                    reason="a CPU test (make test runs it); the GPU image's triton 3.6 interpreter hands loop bounds "
                    "to numpy 2.5 as one-element arrays, which int() refuses")
def test_ncu_lora_script_checks_its_cases_on_cpu() -> None:
    """benchmarks/ncu_lora.py --quick: every layer and adapter count checked against the torch reference before its
    (here unprofiled) launch; the case lines name what a profile's kernels belong to."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ncu_lora.py"), "--quick", "--device", "cpu",
                           "--tokens", "8", "--adapters", "4", "1"], cwd=REPO, env=_env(TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    assert lines[-1] == {"checked": 16, "failures": 0}
    cases = [(r["case"], r["layer"], r["adapters"], r.get("variant")) for r in lines[:-1]]
    assert cases == [case for lay in ("qkv", "o", "gate_up", "down") for n in (4, 1)
                     for case in [("copy", lay, n, None), ("add_lora", lay, n, "split"), ("add_lora", lay, n, "cols")]]
