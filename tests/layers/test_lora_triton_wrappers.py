"""The LoRA wrappers driving the Triton kernels (device-side ranks, per-step grouping) give the same
result as with the reference kernels, with A and B in the model dtype and in fp8; on the CPU under the
Triton interpreter. So do the wrappers after an RMSNorm / silu-and-mul (forward_normed / forward_act), where the
Triton batch joins the shrink to that launch (kernels.lora_prologue: counted, so that the case cannot pass by
falling back), fp8 storage included."""

from __future__ import annotations

from tests.interp import run_under_interpreter

CODE = r"""
import torch
from engine.forward_context import ForwardContext, forward_context
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.lora.adapter import LoRAModule
from engine.lora.layers import ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA
from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.lora.punica import LORA_IMPLS, build_mapping
from kernels import lora_config, lora_prologue
from tests.helpers import count_calls
lora_config.CONFIG_OVERRIDES["prologue"] = 32  # the default, whatever the environment says
calls = count_calls(lora_prologue, ["norm_shrink", "act_shrink"])
g = torch.Generator().manual_seed(0)
norm, act = RMSNorm(64, 1e-6, torch.float32, backend="triton"), SiluAndMul("triton")
norm.weight.data.copy_(torch.rand(64, generator=g) + 0.5)
for kind, wd in (("qkv", None), ("row", None), ("qkv", torch.float8_e4m3fn), ("row", torch.float8_e4m3fn)):
    if kind == "qkv":
        base = QKVParallelLinear(64, 16, 4, 2, prefix="l.qkv_proj")
        w = ColumnParallelLinearWithLoRA(base, ["l.q_proj", "l.k_proj", "l.v_proj"], 3, 16, torch.float32,
                                         weight_dtype=wd)
        sizes = {"l.q_proj": 64, "l.k_proj": 32, "l.v_proj": 32}
    else:
        base = RowParallelLinear(64, 48, prefix="l.o_proj")
        w = RowParallelLinearWithLoRA(base, ["l.o_proj"], 3, 16, torch.float32, weight_dtype=wd)
        sizes = {"l.o_proj": 48}
    assert (w.scales is not None) == (wd is not None)
    for p in base.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    for slot, r in enumerate((1, 8, 16)):
        w.set_slot(slot, {n: LoRAModule(torch.randn(r, 64, generator=g), torch.randn(o, r, generator=g), r)
                          for n, o in sizes.items()})
    slots = [2, -1, 0, 1, 1, -1, 2, 0]
    x = torch.randn(len(slots), 64, generator=g)
    h, res, gu = torch.randn(len(slots), 64, generator=g), torch.randn(len(slots), 64, generator=g), torch.randn(len(slots), 128, generator=g)
    outs = []
    for backend in ("reference", "triton"):
        before = dict(calls)
        with forward_context(ForwardContext(attn=None, lora=build_mapping(slots, x.device, LORA_IMPLS[backend], 3))):
            after_op = list(w.forward_normed(norm, h, res)) + list(w.forward_normed(norm, h, None)) if kind == "qkv" \
                else [w.forward_act(act, gu)]
            outs.append([w(x), *after_op])
        joined = calls["norm_shrink" if kind == "qkv" else "act_shrink"] - before["norm_shrink" if kind == "qkv" else "act_shrink"]
        assert joined == (2 if kind == "qkv" else 1) * (backend == "triton"), (kind, wd, backend, calls)
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
print("ok")
"""


def test_triton_wrappers_equal_reference_wrappers() -> None:
    run_under_interpreter(CODE)
