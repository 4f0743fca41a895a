"""LoRA wrappers against the dense oracle y = x W^T + b + (x A^T) B^T (scale folded into B), for every
wrapped layer kind, fp and int4 bases, ranks 1/8/16/64 and batches mixing slots and -1 in any order."""

from __future__ import annotations

import zlib

import pytest
import torch

from engine.forward_context import ForwardContext, forward_context
from engine.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.quant import Int4LinearMethod, UnquantizedLinearMethod
from engine.lora.adapter import LoRAModule
from engine.lora.layers import ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA
from engine.lora.punica import ReferenceLoRABatch, build_mapping
from kernels.reference import fp8_rows, pack_int4_cols, pack_int4_rows

RANKS = [1, 8, 16, 64]
MAX_RANK = 64
G = 128


def _random_params(layer, gen: torch.Generator) -> None:
    """Fill every parameter with random checkpoint-layout tensors, then finish loading."""
    for name, p in list(layer.named_parameters()):
        if name == "qweight":
            k, n = p.shape[0] * 8, p.shape[1]
            full = pack_int4_rows(torch.randint(0, 16, (k, n), generator=gen))
        elif name == "qzeros":
            full = pack_int4_cols(torch.randint(0, 15, (p.shape[0], p.shape[1] * 8), generator=gen))
        elif name == "scales":
            full = (torch.randn(p.shape, generator=gen) * 0.02).half()
        else:
            full = torch.randn(p.shape, generator=gen) * 0.05
        p.data.copy_(full)
    layer.process_after_loading()


def _make(kind: str, quant: bool, gen: torch.Generator, dtype: torch.dtype = torch.float32,
          weight_dtype: torch.dtype | None = None):
    method = Int4LinearMethod(G, 1) if quant else UnquantizedLinearMethod()
    if kind == "qkv":
        layer = QKVParallelLinear(256, 64, 4, 2, bias=True, method=method, prefix="l.qkv_proj", dtype=dtype)
        names, sizes = ["l.q_proj", "l.k_proj", "l.v_proj"], [256, 128, 128]
    elif kind == "gate_up":
        layer = MergedColumnParallelLinear(256, [384, 384], method=method, prefix="l.gate_up_proj", dtype=dtype)
        names, sizes = ["l.gate_proj", "l.up_proj"], [384, 384]
    elif kind == "column":
        layer = ColumnParallelLinear(256, 128, bias=True, method=method, prefix="l.proj", dtype=dtype)
        names, sizes = ["l.proj"], [128]
    else:
        layer = RowParallelLinear(384, 256, bias=True, method=method, prefix="l.down_proj", dtype=dtype)
        names, sizes = ["l.down_proj"], [256]
    _random_params(layer, gen)
    cls = RowParallelLinearWithLoRA if kind == "row" else ColumnParallelLinearWithLoRA
    return (layer, cls(layer, names, max_loras=len(RANKS), max_rank=MAX_RANK, dtype=dtype, weight_dtype=weight_dtype),
            names, sizes)


def _dequant_fp8(t: torch.Tensor) -> torch.Tensor:
    q, scale = fp8_rows(t)
    return q.float() * scale[:, None]


def dense_oracle(base, x: torch.Tensor, slots: list[int], adapters: list[dict[str, LoRAModule]], names: list[str],
                 sizes: list[int], dtype: torch.dtype, fp8: bool = False,
                 slot_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x W^T + b + (x A^T) B^T per row's slot, in float32 from the layer's dense weight and the adapters."""
    y = x.float() @ base.dense_weight().float().t() + (base.bias.float() if base.bias is not None else 0)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    for i, s in enumerate(slots):
        if s < 0:
            continue
        for n, off, o in zip(names, offsets, sizes):
            m = adapters[s].get(n)
            if m is not None:
                # The buffers hold A and B in the layer's dtype, or slot_dtype (or fp8 + a scale per row of A and
                # of B): the oracle uses the same rounded values.
                if fp8:
                    a, b = _dequant_fp8(m.a), _dequant_fp8(m.b)
                else:
                    a, b = m.a.to(slot_dtype or dtype).float(), m.b.to(slot_dtype or dtype).float()
                y[i, off:off + o] += (x[i].float() @ a.t()) @ b.t()
    return y


@pytest.mark.parametrize(("quant", "dtype", "slots"), [(False, torch.float32, None), (False, torch.bfloat16, None),
                                                       (True, torch.float32, None),
                                                       (False, torch.float32, torch.float8_e4m3fn),
                                                       (False, torch.bfloat16, torch.float8_e4m3fn),
                                                       (False, torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16", "int4", "fp8-fp32", "fp8-bf16", "bf16-fp32slots"])
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "column", "row"])
def test_wrapper_equals_dense_formula(kind: str, quant: bool, dtype: torch.dtype, slots: torch.dtype | None) -> None:
    """bf16-fp32slots: a bf16 model with float32 slots, what lora_dtype "auto" gives on the CPU."""
    fp8 = slots == torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}-{quant}".encode()))  # hash() varies per process
    base, wrapped, names, sizes = _make(kind, quant, gen, dtype, slots)
    k = base.in_features
    adapters: list[dict[str, LoRAModule]] = []
    for slot, r in enumerate(RANKS):
        mods = {n: LoRAModule(torch.randn(r, k, generator=gen) * 0.1, torch.randn(o, r, generator=gen) * 0.1, r)
                for n, o in zip(names, sizes)}
        if kind in ("qkv", "gate_up") and slot == 2:
            mods.pop(names[-1])  # an adapter that skips one slice of a fused layer
        adapters.append(mods)
        wrapped.set_slot(slot, mods)
    t = 40
    token_slots = torch.tensor([-1, 0, 1, 2, 3] * 8)[torch.randperm(t, generator=gen)].tolist()
    x = torch.randn(t, k, generator=gen).to(dtype)
    y_ref = dense_oracle(base, x, token_slots, adapters, names, sizes, dtype, fp8, None if fp8 else slots)
    with forward_context(ForwardContext(attn=None, lora=build_mapping(token_slots, x.device))):
        y = wrapped(x)
    # fp32: accumulation order only. bf16: the output and the shrink result are rounded to bf16 (8 bits).
    tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(y.float(), y_ref, **tol)
    base_rows = [i for i, s in enumerate(token_slots) if s < 0]
    with forward_context(ForwardContext(attn=None, lora=None)):
        y_base = base(x)
    # Base-model tokens in a mixed batch get exactly the base output (seed bug 4: no slot -1 -> last slot).
    assert torch.equal(y[base_rows], y_base[base_rows])


def test_no_lora_tokens_means_no_mapping() -> None:
    assert build_mapping([-1, -1, -1], torch.device("cpu")) is None
    m = build_mapping([-1, 2], torch.device("cpu"))
    assert isinstance(m, ReferenceLoRABatch) and m.slots.tolist() == [-1, 2]


def test_zero_b_adapter_gives_exactly_the_base_output() -> None:
    gen = torch.Generator().manual_seed(3)
    base, wrapped, names, sizes = _make("qkv", True, gen)
    wrapped.set_slot(0, {n: LoRAModule(torch.randn(8, 256, generator=gen), torch.zeros(o, 8), 8)
                         for n, o in zip(names, sizes)})
    x = torch.randn(5, 256, generator=gen)
    with forward_context(ForwardContext(attn=None, lora=build_mapping([0] * 5, x.device))):
        y = wrapped(x)
    with forward_context(ForwardContext(attn=None, lora=None)):
        assert torch.equal(y, base(x))


def test_clear_slot_removes_the_adapter() -> None:
    gen = torch.Generator().manual_seed(4)
    base, wrapped, names, sizes = _make("row", False, gen)
    wrapped.set_slot(1, {names[0]: LoRAModule(torch.randn(16, 384, generator=gen), torch.randn(256, 16, generator=gen), 16)})
    wrapped.clear_slot(1)
    x = torch.randn(3, 384, generator=gen)
    with forward_context(ForwardContext(attn=None, lora=build_mapping([1, 1, 1], x.device))):
        y = wrapped(x)
    with forward_context(ForwardContext(attn=None, lora=None)):
        assert torch.equal(y, base(x))
    assert wrapped.ranks[0][1] == 0


