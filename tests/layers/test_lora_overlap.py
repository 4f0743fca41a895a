"""The LoRA shrink on the device's side stream beside the base GEMM (TritonLoRABatch.add_lora_over) gives the same
output as the serial order, bit for bit, eagerly and replayed from a captured graph, and matches the reference
wrappers. CUDA only: the CPU and XPU have no side stream (engine.device.side_stream), so there the serial path runs
and the interpreter tests cover it."""

from __future__ import annotations

import pytest
import torch

from engine.device import side_stream
from kernels import triton_env

CUDA = torch.cuda.is_available() and triton_env.usable_on("cuda")


def test_no_side_stream_off_cuda() -> None:
    assert side_stream(torch.device("cpu")) is None


@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
@pytest.mark.parametrize("kind", ["qkv", "row"])
def test_overlapped_shrink_equals_serial(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.forward_context import ForwardContext, forward_context
    from engine.layers.linear import QKVParallelLinear, RowParallelLinear
    from engine.lora.adapter import LoRAModule
    from engine.lora.layers import ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA
    from engine.lora.punica import LORA_IMPLS, build_mapping
    from kernels import lora_triton

    dev, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    g = torch.Generator().manual_seed(0)
    if kind == "qkv":
        base = QKVParallelLinear(512, 64, 4, 2, prefix="l.qkv_proj")
        sizes = {"l.q_proj": 256, "l.k_proj": 128, "l.v_proj": 128}
        k = 512
    else:
        base = RowParallelLinear(1024, 512, prefix="l.o_proj")
        sizes = {"l.o_proj": 512}
        k = 1024
    for p in base.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)
    base.to(dev, dtype)  # the wrapper keeps its slots where the base layer lives
    w = (ColumnParallelLinearWithLoRA(base, list(sizes), 4, 16, dtype) if kind == "qkv"
         else RowParallelLinearWithLoRA(base, list(sizes), 4, 16, dtype))
    for slot, r in enumerate((1, 8, 16, 16)):
        w.set_slot(slot, {n: LoRAModule(torch.randn(r, k, generator=g) / k ** 0.5, torch.randn(o, r, generator=g), r)
                          for n, o in sizes.items()})
    slots = [(i * 7) % 5 - 1 for i in range(40)]  # every slot and -1, interleaved
    x = (torch.randn(len(slots), k, generator=g) * 0.5).to(dev, dtype)

    def run(impl: str, overlap: int) -> torch.Tensor:
        monkeypatch.setitem(lora_triton.CONFIG_OVERRIDES, "overlap", overlap)
        with forward_context(ForwardContext(attn=None, lora=build_mapping(slots, dev, LORA_IMPLS[impl], 4))):
            return w(x)

    serial, beside = run("triton", 0), run("triton", 1)
    torch.cuda.synchronize()
    assert torch.equal(beside, serial), "the overlapped shrink changed the output"
    ref = run("reference", 1)
    torch.testing.assert_close(beside.float(), ref.float(), rtol=2e-2, atol=2e-2 * float(ref.abs().max()))

    # captured with the fork: the side stream's shrink is a parallel branch of the graph
    monkeypatch.setitem(lora_triton.CONFIG_OVERRIDES, "overlap", 1)
    mapping = build_mapping(slots, dev, LORA_IMPLS["triton"], 4)
    with forward_context(ForwardContext(attn=None, lora=mapping)):
        w(x)  # warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = w(x)
    x.mul_(-1.0)  # a new input in place: the replay must read it
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run("triton", 0)), "the graph with the forked shrink differs from the serial output"
