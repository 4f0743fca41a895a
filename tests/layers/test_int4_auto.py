"""The GPU int4 dispatch (small M: memory-bound kernel; large M: fused dequantization + dense GEMM),
exercised on the CPU with native_cpu as the small-M kernel and Triton under the interpreter."""

from __future__ import annotations

from tests.interp import run_under_interpreter

CODE = r"""
import torch
from engine.layers.linear import RowParallelLinear
from engine.layers.quant import Int4LinearMethod, SMALL_M
from kernels.reference import pack_int4_cols, pack_int4_rows
g = torch.Generator().manual_seed(0)
layer = RowParallelLinear(256, 64, bias=True, method=Int4LinearMethod(128, 1, "auto:native_cpu"), prefix="l")
layer.qweight.data.copy_(pack_int4_rows(torch.randint(0, 16, (256, 64), generator=g)))
layer.qzeros.data.copy_(pack_int4_cols(torch.randint(0, 15, (2, 64), generator=g)))
layer.scales.data.copy_((torch.randn(2, 64, generator=g) * 0.05).half())
layer.bias.data.copy_(torch.randn(64, generator=g))
layer.process_after_loading()
assert [(n, w.backend) for n, w in layer.int4_paths] == [(SMALL_M["native"], "native_cpu"), (SMALL_M["triton"], "triton")]
w = layer.dense_weight().float()
# Every path: native up to SMALL_M["native"] rows, Triton up to SMALL_M["triton"], dequantize + GEMM above.
for m in (1, SMALL_M["native"], SMALL_M["native"] + 1, SMALL_M["triton"], SMALL_M["triton"] + 1):
    x = torch.randn(m, 256, generator=g)
    torch.testing.assert_close(layer(x), x @ w.t() + layer.bias, atol=1e-4, rtol=1e-4)
print("ok")
"""


def test_small_and_large_m_paths_equal_the_dense_formula() -> None:
    run_under_interpreter(CODE)


def test_without_triton_the_native_op_takes_every_size() -> None:
    """No Triton (an XPU box without triton-xpu): no fused dequantization either, so the native op must
    serve large M too instead of failing on the dequantization path."""
    import subprocess
    import sys

    code = "import sys; sys.modules['triton'] = None\n" + CODE.split("layer.process_after_loading()")[0] + r"""
layer.process_after_loading()
assert [(n, w.backend) for n, w in layer.int4_paths] == [(None, "native_cpu")]
w = layer.dense_weight().float()
for m in (1, 64, 300):
    x = torch.randn(m, 256, generator=g)
    torch.testing.assert_close(layer(x), x @ w.t() + layer.bias, atol=1e-4, rtol=1e-4)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
