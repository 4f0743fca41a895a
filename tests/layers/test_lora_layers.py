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


_EPILOGUE_CHECK = r"""
import os
os.environ["XPULORA_LORA_CONFIG"] = "epilogue=1"
import zlib
import torch
import kernels.int4 as I4
from engine.forward_context import ForwardContext, forward_context
from engine.layers.quant import Int4LinearMethod
from engine.lora.adapter import LoRAModule
from engine.lora.punica import TritonLoRABatch, build_mapping
from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from kernels import lora_prologue, lora_triton
from tests.helpers import count_calls
from tests.layers.test_lora_layers import RANKS, _make, dense_oracle

joins = count_calls(lora_prologue, ["norm_shrink", "act_shrink"])

fused = []
mma = I4.mma_mm
I4.mma_mm = lambda *a: fused.append(a[-1] is not None) or mma(*a)  # which launches took the epilogue
checked = 0
for kind in ("qkv", "gate_up", "row"):
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(zlib.crc32(kind.encode()))
        base, wrapped, names, sizes = _make(kind, True, gen, dtype)  # int4 base
        base.method = Int4LinearMethod(128, 1, backend="triton_mma")
        base.process_after_loading()
        k = base.in_features
        adapters = []
        for slot, r in enumerate(RANKS):
            mods = {n: LoRAModule(torch.randn(r, k, generator=gen) * 0.1, torch.randn(o, r, generator=gen) * 0.1, r)
                    for n, o in zip(names, sizes)}
            if kind != "row" and slot == 2:
                mods.pop(names[-1])  # an adapter that skips one slice
            adapters.append(mods)
            wrapped.set_slot(slot, mods)
        slots = torch.tensor([-1, 0, 1, 2, 3] * 4)[torch.randperm(20, generator=gen)].tolist()
        x = torch.randn(20, k, generator=gen).to(dtype)
        outs = {}
        for on in (1, 0):
            lora_triton.CONFIG_OVERRIDES["epilogue"] = on
            fused.clear()
            mapping = build_mapping(slots, x.device, TritonLoRABatch, num_slots=len(RANKS))
            with forward_context(ForwardContext(attn=None, lora=mapping)):
                outs[on] = wrapped(x).float()
            assert fused == [bool(on)], (kind, on, fused)  # one base launch, with the epilogue only when on
        tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
        ref = dense_oracle(base, x, slots, adapters, names, sizes, dtype)  # the dense formula, not our kernels
        torch.testing.assert_close(outs[1], ref, **tol)
        torch.testing.assert_close(outs[0], ref, **tol)
        base_rows = [i for i, s in enumerate(slots) if s < 0]
        with forward_context(ForwardContext(attn=None, lora=None)):
            y_base = base(x).float()
        assert torch.equal(outs[1][base_rows], y_base[base_rows]), kind  # base tokens: the base output exactly
        # The shrink joined to the norm / activation before the layer, its partials expanded in the base GEMM's
        # store: no LoRA launch of the layer's own (lora_prologue's call and the epilogue are both counted).
        lora_triton.CONFIG_OVERRIDES.update(epilogue=1, prologue=32)
        fused.clear()
        before = dict(joins)
        mapping = build_mapping(slots, x.device, TritonLoRABatch, num_slots=len(RANKS))
        with forward_context(ForwardContext(attn=None, lora=mapping)):
            if kind == "row":
                gu = torch.randn(20, 2 * k, generator=gen).to(dtype)
                act = SiluAndMul("triton")
                got, x_in = wrapped.forward_act(act, gu).float(), act(gu)  # the layer's input as the op rounds it
            else:
                norm = RMSNorm(k, 1e-6, dtype, backend="triton")
                norm.weight.data.copy_(torch.linspace(0.5, 1.5, k))
                got, x_in = wrapped.forward_normed(norm, x, None)[0].float(), norm(x)
        del lora_triton.CONFIG_OVERRIDES["prologue"]
        key = "act_shrink" if kind == "row" else "norm_shrink"
        assert fused == [True] and joins[key] == before[key] + 1, (kind, fused, joins)
        ref = dense_oracle(base, x_in, slots, adapters, names, sizes, dtype)
        torch.testing.assert_close(got, ref, **tol)
        checked += 1
print("ok", checked)
"""


def test_lora_expand_fused_into_the_int4_mma_store_under_interpreter() -> None:
    """The opt-in LoRA epilogue (XPULORA_LORA_CONFIG=epilogue=1: the expand inside the triton_mma base GEMM's
    store, kernels.int4_lora.LoRAEpilogue) and the split shrink + expand both equal the dense formula, for fused
    qkv / gate_up slices (one adapter skipping a slice), the row-parallel layer, ranks 1-64, fp32 and bf16, and
    leaves base-model rows exactly the base output; the base launch took the epilogue only when it was on. With
    the shrink joined to the RMSNorm / silu-and-mul before the layer as well (prologue=32), the layer launches no
    LoRA kernel of its own and still equals the dense formula on the op's output."""
    from tests.interp import run_under_interpreter

    run_under_interpreter(_EPILOGUE_CHECK, timeout=600)


_CUDA_EPILOGUE_CHECK = r"""
import os
import sys
os.environ["XPULORA_LORA_CONFIG"] = "epilogue=1"
import zlib
import torch
import kernels.int4 as I4
from engine.forward_context import ForwardContext, forward_context
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from engine.layers.quant import Int4LinearMethod
from engine.lora.adapter import LoRAModule
from engine.lora.layers import ColumnParallelLinearWithLoRA
from engine.lora.punica import TritonLoRABatch, build_mapping
from engine.layers.norm import RMSNorm
from kernels import lora_prologue, lora_triton
from tests.helpers import count_calls
from tests.layers.test_lora_layers import G, _random_params, dense_oracle

joins = count_calls(lora_prologue, ["norm_shrink"])

dev = torch.device(sys.argv[1])
fused = []
real = I4.cuda_mm
I4.cuda_mm = lambda *a: fused.append(a[-1] is not None) or real(*a)  # which launches took the epilogue
ranks, dtype, checked = [1, 8, 16, 12], torch.bfloat16, 0
for kind in ("qkv", "gate_up"):
    gen = torch.Generator().manual_seed(zlib.crc32(kind.encode()))
    method = Int4LinearMethod(G, 1, backend="cuda_mma")
    if kind == "qkv":
        base = QKVParallelLinear(512, 64, 4, 2, bias=True, method=method, prefix="l.qkv_proj", dtype=dtype)
        names, sizes = ["l.q_proj", "l.k_proj", "l.v_proj"], [256, 128, 128]
    else:
        base = MergedColumnParallelLinear(512, [384, 384], method=method, prefix="l.gate_up_proj", dtype=dtype)
        names, sizes = ["l.gate_proj", "l.up_proj"], [384, 384]
    _random_params(base.to(dev), gen)
    wrapped = ColumnParallelLinearWithLoRA(base, names, max_loras=len(ranks), max_rank=16, dtype=dtype)
    adapters = []
    for slot, r in enumerate(ranks):
        mods = {n: LoRAModule(torch.randn(r, 512, generator=gen) * 0.1, torch.randn(o, r, generator=gen) * 0.1, r)
                for n, o in zip(names, sizes)}
        if slot == 2:
            mods.pop(names[-1])  # an adapter that skips one slice
        adapters.append(mods)
        wrapped.set_slot(slot, mods)
    slots = torch.tensor([-1, 0, 1, 2, 3] * 4)[torch.randperm(20, generator=gen)].tolist()
    x = torch.randn(20, 512, generator=gen).to(dtype)
    outs = {}
    for on in (1, 0):
        lora_triton.CONFIG_OVERRIDES["epilogue"] = on
        fused.clear()
        mapping = build_mapping(slots, dev, TritonLoRABatch, num_slots=len(ranks))
        with forward_context(ForwardContext(attn=None, lora=mapping)):
            outs[on] = wrapped(x.to(dev)).float().cpu()
        assert fused == [bool(on)], (kind, on, fused)  # one base launch, with the epilogue only when on
    # the shrink joined to the norm before the layer, its partials expanded in the base GEMM's store
    lora_triton.CONFIG_OVERRIDES.update(epilogue=1, prologue=32)
    fused.clear()
    before = joins["norm_shrink"]
    norm = RMSNorm(512, 1e-6, dtype, backend="triton").to(dev)
    norm.weight.data.copy_(torch.linspace(0.5, 1.5, 512))
    mapping = build_mapping(slots, dev, TritonLoRABatch, num_slots=len(ranks))
    with forward_context(ForwardContext(attn=None, lora=mapping)):
        joined = wrapped.forward_normed(norm, x.to(dev), None)[0].float().cpu()
    x_in = norm(x.to(dev)).cpu()  # the layer's input as the norm rounds it
    del lora_triton.CONFIG_OVERRIDES["prologue"]
    assert fused == [True] and joins["norm_shrink"] == before + 1, (kind, fused, joins)
    base_cpu = base.to("cpu")  # the oracle reads the dense weight on the CPU
    ref = dense_oracle(base_cpu, x, slots, adapters, names, sizes, dtype)  # the dense formula, not our kernels
    torch.testing.assert_close(outs[1], ref, atol=3e-2 * float(ref.abs().max()), rtol=2e-2)
    torch.testing.assert_close(outs[0], ref, atol=3e-2 * float(ref.abs().max()), rtol=2e-2)
    ref = dense_oracle(base_cpu, x_in, slots, adapters, names, sizes, dtype)
    torch.testing.assert_close(joined, ref, atol=3e-2 * float(ref.abs().max()), rtol=2e-2)
    checked += 1
print("ok", checked)
"""


def test_lora_expand_fused_into_the_cuda_mma_store_on_cuda() -> None:
    """The same through the CUDA C kernel (kernels.int4_cuda, bf16, ranks up to 16): fused qkv / gate_up slices
    with one adapter skipping a slice, epilogue on and off both equal the dense formula, and the base launch
    took the epilogue only when it was on; so does the layer after an RMSNorm with the shrink joined to the
    norm and the epilogue on (no LoRA launch of the layer's own)."""
    from kernels import int4_cuda
    from tests.layers.test_int4_auto import _on_accelerator

    if not int4_cuda.available():
        pytest.skip("the CUDA C int4 kernel runs on CUDA only")
    _on_accelerator(_CUDA_EPILOGUE_CHECK)
