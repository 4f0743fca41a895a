"""The reference LoRA batch (engine.lora.punica.ReferenceLoRABatch) against a per-token loop oracle."""

from __future__ import annotations

import pytest
import torch

from engine.lora.punica import ReferenceLoRABatch, SlotRanks
from kernels import reference

CPU = torch.device("cpu")


def _r(host: list[list[int]]) -> SlotRanks:
    return SlotRanks(host, torch.tensor(host, dtype=torch.int32))


def add_lora(y, x, a_list, b_list, ranks, offsets, slots, add_inputs=True):
    return ReferenceLoRABatch.build(slots.tolist(), a_list[0].size(0), CPU).add_lora(
        y, x, a_list, b_list, _r(ranks), offsets, add_inputs)


def expand(y, buf, b, slots, ranks, offset, add_inputs=True):
    return ReferenceLoRABatch.build(slots.tolist(), b.size(0), CPU).expand(y, buf, b, _r([ranks]), offset, add_inputs)


def _oracle(y, x, a_list, b_list, ranks, offsets, slots, add_inputs):
    y = y.clone()
    for t, s in enumerate(slots):
        if s < 0:
            continue
        for a, b, r, off in zip(a_list, b_list, ranks, offsets):
            n = b.size(1)
            val = (x[t] @ a[s, : r[s]].t()) @ b[s, :, : r[s]].t()
            y[t, off:off + n] = (y[t, off:off + n] + val) if add_inputs else val
    return y


@pytest.fixture(params=["auto", "dense", "grouped"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each formulation of ReferenceLoRABatch.add_lora (the cost model's choice, and each one forced)."""
    monkeypatch.setattr(ReferenceLoRABatch, "mode", request.param)
    return request.param


@pytest.mark.parametrize("add_inputs", [True, False])
def test_add_lora_mixed_slots_and_ranks(add_inputs: bool, mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    slots_n, r_max, k = 4, 16, 32
    sizes = [24, 8]
    ranks = [[16, 1, 8, 0], [4, 16, 0, 8]]
    a_list = [torch.randn(slots_n, r_max, k, generator=g) for _ in sizes]
    b_list = [torch.randn(slots_n, n, r_max, generator=g) for n in sizes]
    # Garbage beyond each slot's rank must be ignored (rank truncation).
    slots = [3, -1, 0, 2, 1, -1, 0, 3, 2, 1]
    x = torch.randn(len(slots), k, generator=g)
    y = torch.randn(len(slots), sum(sizes), generator=g)
    ref = _oracle(y, x, a_list, b_list, ranks, [0, 24], slots, add_inputs)
    out = add_lora(y.clone(), x, a_list, b_list, ranks, [0, 24], torch.tensor(slots), add_inputs)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    # Tokens with slot -1 are untouched (never routed to the last slot by a negative index).
    assert torch.equal(out[1], y[1]) and torch.equal(out[5], y[5])


@pytest.mark.parametrize("order", ["grouped", "scattered"])
def test_add_lora_rows_grouped_by_slot_and_not(order: str, mode: str) -> None:
    """As the model runner orders a step (base rows, then each slot's rows: one span, slices) and in any order
    (index rows); an unused slot between used ones, a slot of rank 0, garbage past each rank, and a base row
    whose input would overflow every adapter's product (inf): it must stay exactly as it was (no NaN from a
    masked product), as the adapter rows must be their own slot's."""
    g = torch.Generator().manual_seed(3)
    slots_n, r_max, k, sizes = 5, 8, 16, [12, 4, 4]
    ranks = [[8, 3, 8, 0, 5], [2, 8, 8, 0, 1], [8, 8, 4, 0, 8]]
    a_list = [torch.randn(slots_n, r_max, k, generator=g) for _ in sizes]
    # B rank-major, as the wrappers store it: [S, n, r_max] indexing over [S, r_max, n] memory.
    b_list = [torch.randn(slots_n, r_max, n, generator=g).transpose(1, 2) for n in sizes]
    slots = [-1, -1, 0, 0, 0, 1, 3, 4, 4] if order == "grouped" else [4, -1, 0, 3, 1, 0, -1, 4, 0]
    x = torch.randn(len(slots), k, generator=g)
    base_rows = [i for i, s in enumerate(slots) if s < 0]
    x[base_rows[0]] = float("inf")
    y = torch.randn(len(slots), sum(sizes), generator=g)
    offsets = [0, 12, 16]
    want = _oracle(y, x, a_list, b_list, ranks, offsets, slots, True)
    got = add_lora(y.clone(), x, a_list, b_list, ranks, offsets, torch.tensor(slots))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert all(torch.equal(got[t], y[t]) for t in base_rows)


def test_the_cost_model_picks_dense_for_decode_and_grouped_for_long_prefills() -> None:
    """Few rows over several adapters: the dense form (op-bound); thousands of rows at a wide padded rank
    with small true ranks: the grouped form (product-bound)."""
    a, b = torch.zeros(4, 8, 256), torch.zeros(4, 8, 512).transpose(1, 2)
    decode = ReferenceLoRABatch.build(sorted(i % 4 for i in range(16)), 4, CPU)
    assert decode._dense_pays(a, b, [8] * 4)
    a64, b64 = torch.zeros(4, 64, 256), torch.zeros(4, 64, 512).transpose(1, 2)
    prefill = ReferenceLoRABatch.build(sorted(i % 4 for i in range(4096)), 4, CPU)
    assert not prefill._dense_pays(a64, b64, [8] * 4)


def test_expand_truncates_to_each_slots_rank() -> None:
    g = torch.Generator().manual_seed(1)
    b = torch.randn(2, 6, 8, generator=g)
    buf = torch.randn(3, 8, generator=g)  # shrink result at r_max = 8; slot 1's adapter has rank 4
    y = torch.zeros(3, 6)
    expand(y, buf, b, torch.tensor([0, 1, 0]), [8, 4], 0, True)
    torch.testing.assert_close(y[1], buf[1, :4] @ b[1, :, :4].t())
    torch.testing.assert_close(y[0], buf[0, :8] @ b[0].t())


def test_expand_refuses_a_shrink_result_wider_than_b() -> None:
    """A [T, r_max * tp] buffer (an all-gather where none belongs) must not be silently cut (seed bug 2)."""
    with pytest.raises(ValueError, match=r"does not match LoRA B"):
        expand(torch.zeros(3, 6), torch.zeros(3, 16), torch.zeros(2, 6, 8), torch.tensor([0, 1, 0]), [8, 4], 0)


def test_shape_checks() -> None:
    with pytest.raises(ValueError, match="inputs"):
        add_lora(torch.zeros(2, 4), torch.zeros(2, 5), [torch.zeros(1, 2, 3)], [torch.zeros(1, 4, 2)], [[2]], [0],
                 torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="outside y"):
        reference.lora_expand(torch.zeros(2, 4), torch.zeros(2, 2), torch.zeros(1, 6, 2), torch.tensor([0, 0]), [2], 0,
                              True)
    with pytest.raises(ValueError, match="rank dim"):
        add_lora(torch.zeros(2, 4), torch.zeros(2, 3), [torch.zeros(1, 2, 3)], [torch.zeros(1, 4, 5)], [[2]], [0],
                 torch.tensor([0, 0]))
