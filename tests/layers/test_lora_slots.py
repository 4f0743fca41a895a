"""Adapter slot fills (engine.lora.slots): the packed, staged fill writes exactly what the per-slice copies of
the previous set_slot wrote, for every wrapper kind, TP rank and LoRA mode; a refill with a smaller adapter
leaves no stale rows; a fill's copy ops do not grow with the number of layers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import pytest
import torch

from engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    SectionedColumnParallelLinear,
)
from engine.lora.adapter import LoRAModule
from engine.lora.layers import BaseLayerWithLoRA, ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA
from engine.lora.slots import SlotFiller, pack_adapter
from tests.helpers import as_tp_rank
from tools.op_count import CountWrites

R_MAX, SLOTS = 16, 3


def _base(kind: str, p: str = "l") -> tuple[torch.nn.Module, list[str], list[tuple[int, int]]]:
    """A base layer, its checkpoint module names and their FULL (in, out) shapes."""
    qkv = [f"{p}.q", f"{p}.k", f"{p}.v"]
    if kind == "qkv":
        return QKVParallelLinear(64, 16, 4, 2, prefix=f"{p}.qkv"), qkv, [(64, 64), (64, 32), (64, 32)]
    if kind == "qkv_rep":  # one kv head, replicated over 2 ranks
        return QKVParallelLinear(64, 16, 4, 1, prefix=f"{p}.qkv"), qkv, [(64, 64), (64, 16), (64, 16)]
    if kind == "gate_up":
        return MergedColumnParallelLinear(64, [96, 96], prefix=f"{p}.gu"), [f"{p}.g", f"{p}.u"], [(64, 96), (64, 96)]
    if kind == "sectioned":
        return SectionedColumnParallelLinear(64, [32, 32, 64], prefix=f"{p}.s"), [f"{p}.s"], [(64, 128)]
    if kind == "column":
        return ColumnParallelLinear(64, 48, prefix=f"{p}.c"), [f"{p}.c"], [(64, 48)]
    return RowParallelLinear(96, 64, prefix=f"{p}.o"), [f"{p}.o"], [(96, 64)]


def _wrap(kind: str, rank: int, tp: int, full: bool, dtype: torch.dtype, p: str = "l"
          ) -> tuple[BaseLayerWithLoRA, list, list]:
    with as_tp_rank(rank, tp):
        base, names, shapes = _base(kind, p)
        cls = RowParallelLinearWithLoRA if kind == "row" else ColumnParallelLinearWithLoRA
        return cls(base, names, SLOTS, R_MAX, dtype, fully_sharded=full), names, shapes


def _adapter(names: list[str], shapes: list[tuple[int, int]], ranks: list[int | None], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: LoRAModule(torch.randn(r, k, generator=g), torch.randn(o, r, generator=g), r)
            for n, (k, o), r in zip(names, shapes, ranks) if r is not None}


def _legacy_fill(w: BaseLayerWithLoRA, slot: int, modules: Mapping[str, LoRAModule]) -> None:
    """What set_slot did before the packed fills: zero the slot, then per slice copy A and B and set the ranks."""
    for i in range(len(w.module_names)):
        w.lora_a[i][slot].zero_()
        w.lora_b[i][slot].zero_()
    w.ranks_dev[:, slot] = 0
    w.a_ranks_dev[:, slot] = 0
    for i, name in enumerate(w.module_names):
        m = modules.get(name)
        if m is None:
            w.ranks[i][slot] = w.a_ranks[i][slot] = 0
            continue
        a, b = w.shard_a(i, m.a), w.shard_b(i, m.b)
        w.lora_a[i][slot, :a.size(0)].copy_(a)
        w.lora_b[i][slot, :, :m.rank].copy_(b)
        w.ranks[i][slot], w.a_ranks[i][slot] = m.rank, a.size(0)
        w.ranks_dev[i, slot] = m.rank
        w.a_ranks_dev[i, slot] = a.size(0)


def _same(w: BaseLayerWithLoRA, ref: BaseLayerWithLoRA, what: str) -> None:
    for j, (got, want) in enumerate(zip(w.blocks, ref.blocks)):
        assert torch.equal(got, want), f"{what}: block {j} differs"
    assert w.ranks == ref.ranks and w.a_ranks == ref.a_ranks, what
    assert torch.equal(w.ranks_dev, ref.ranks_dev) and torch.equal(w.a_ranks_dev, ref.a_ranks_dev), what


CASES = [(kind, rank, tp, full) for kind in ("qkv", "gate_up", "sectioned", "column", "row")
         for rank, tp, full in ((0, 1, False), (1, 2, False), (0, 2, True), (1, 2, True))] + \
        [("qkv_rep", 1, 2, False), ("qkv_rep", 1, 2, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("kind", "rank", "tp", "full"), CASES,
                         ids=[f"{k}-r{r}of{t}{'-full' if f else ''}" for k, r, t, f in CASES])
def test_packed_fill_equals_per_slice_copies(kind: str, rank: int, tp: int, full: bool, dtype: torch.dtype) -> None:
    w, names, shapes = _wrap(kind, rank, tp, full, dtype)
    ref, _, _ = _wrap(kind, rank, tp, full, dtype)
    filler = SlotFiller([w], torch.device("cpu"), pins_memory=False, staged=True, staging_bytes=4096)
    n = len(names)
    # Full rank everywhere, then mixed ranks per slice (rank_pattern), one slice absent, ranks below a
    # shard's rows (fully sharded A), then an adapter touching only the first module.
    sequence = [[R_MAX] * n, [[4, 16, 1][i % 3] for i in range(n)], [None if i == n - 1 and n > 1 else 2 for i in range(n)],
                [8] + [None] * (n - 1)]
    for step, ranks in enumerate(sequence):
        mods = _adapter(names, shapes, ranks, seed=step)
        for slot in range(SLOTS):
            filler.fill(slot, pack_adapter([w], mods, pin=False)) if slot != 1 else w.set_slot(slot, mods)
            _legacy_fill(ref, slot, mods)
        _same(w, ref, f"fill {step} ({ranks})")
    filler.clear(2)
    for i in range(n):
        ref.lora_a[i][2].zero_()
        ref.lora_b[i][2].zero_()
        ref.ranks[i][2] = ref.a_ranks[i][2] = 0
    ref.ranks_dev[:, 2] = ref.a_ranks_dev[:, 2] = 0
    _same(w, ref, "clear")


def test_refill_with_a_smaller_rank_leaves_no_stale_rows() -> None:
    w, names, shapes = _wrap("qkv", 0, 1, False, torch.float32)
    filler = SlotFiller([w], torch.device("cpu"), pins_memory=False)
    filler.fill(1, filler.pack(_adapter(names, shapes, [16, 16, 16], seed=1)))
    filler.fill(0, filler.pack(_adapter(names, shapes, [16, 16, 16], seed=2)))
    small = _adapter(names, shapes, [3, None, 5], seed=3)
    filler.fill(1, filler.pack(small))
    a, b = w.a_store[1], w.b_store[1]
    assert not a[5:].any() and not b[5:].any()  # rows past the new adapter's largest rank
    assert not a[3:, :64].any() and not b[3:, :64].any()  # q: rank 3
    assert not a[:, 64:128].any() and not b[:, 64:96].any()  # k: absent
    assert torch.equal(a[:3, :64], small["l.q"].a) and torch.equal(b[:3, :64], small["l.q"].b.t())
    assert torch.equal(a[:5, 128:], small["l.v"].a) and torch.equal(b[:5, 96:], small["l.v"].b.t())
    assert w.ranks_dev[:, 1].tolist() == [3, 0, 5] and w.ranks_dev[:, 0].tolist() == [16, 16, 16]
    assert w.a_store[0].any()  # the neighbouring slot is untouched


@pytest.mark.parametrize("layers", [4, 16])
def test_a_fill_issues_a_fixed_number_of_ops(layers: int) -> None:
    """One staging copy and one multi-tensor copy per window (plus one multi-tensor zero when stale rows
    remain), however many wrapped layers; the old path issued ~4 copies per slice."""
    ws, big = [], {}
    for i in range(layers):
        w, names, shapes = _wrap(("qkv", "row", "gate_up", "row")[i % 4], 0, 1, False, torch.bfloat16, p=f"m{i}")
        ws.append(w)
        big.update(_adapter(names, shapes, [16] * len(names), seed=i))
    filler = SlotFiller(ws, torch.device("cpu"), pins_memory=False, staged=True)
    small = {n: LoRAModule(m.a[:4].clone(), m.b[:, :4].clone(), 4) for n, m in big.items()}
    for mods, zero_ops in ((big, 0), (big, 0), (small, 1)):
        pack = filler.pack(mods)
        with CountWrites() as c:
            filler.fill(0, pack)
        assert c.ops == Counter({"copy_": 1, "_foreach_copy_": 1, **({"_foreach_zero_": 1} if zero_ops else {})}), c.ops



@pytest.mark.skipif(not torch.cuda.is_available(), reason="the asynchronous fill is checked on CUDA")
def test_a_gpu_fill_does_not_wait_for_the_device() -> None:
    """A fill queued behind a long-running kernel returns while that kernel still runs (no host sync: pinned
    source, staged copies), and what lands in the slot is the per-slice copies' result."""
    dev = torch.device("cuda")
    ws, refs, mods = [], [], {}
    for i, kind in enumerate(("qkv", "row", "gate_up")):
        with as_tp_rank(0, 1):
            base, names, shapes = _base(kind, f"m{i}")
            ref_base, _, _ = _base(kind, f"m{i}")
        cls = RowParallelLinearWithLoRA if kind == "row" else ColumnParallelLinearWithLoRA
        ws.append(cls(base.to(dev), names, SLOTS, R_MAX, torch.bfloat16))
        refs.append(cls(ref_base.to(dev), names, SLOTS, R_MAX, torch.bfloat16))
        mods.update(_adapter(names, shapes, [R_MAX, 5, 9][:len(names)], seed=i))
    filler = SlotFiller(ws, dev, pins_memory=True)
    pack = filler.pack(mods)
    assert pack.flat.is_pinned()
    filler.fill(0, pack)
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s of device time
    filler.fill(1, pack)
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy, "the fill waited for the device"
    for w, ref in zip(ws, refs):
        for slot in (0, 1):
            _legacy_fill(ref, slot, mods)
        _same(w, ref, type(w.base).__name__)
