"""The skinny linear (kernels.skinny_triton) against torch's F.linear in float32 from the same rounded inputs:
rows 1 to beyond one row block, features not a multiple of the feature block, K not a multiple of the K slice,
strided rows (a view of a wider activation, as a layer's input can be), with and without a bias; the launch shapes
the benchmark sweeps; and the boundary's refusals. Compiled on an accelerator; on the CPU in a child pytest under
TRITON_INTERPRET=1 (test_kernels_under_interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.triton_env import DEV, assert_close_rel, needs_kernels, pytest_under_interpreter

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 4e-3)}
"""float32: only the sums' order differs; bfloat16: the output's rounding."""


def _problem(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + 3, generator=g).to(dtype)[:, 3:]  # rows strided by k + 3
    w = torch.randn(n, k, generator=g).to(dtype)
    return x, w, torch.randn(n, generator=g).to(dtype) if bias else None


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "bias"), [(1, 96, 320, False), (3, 10, 200, True), (6, 33, 64, False),
                                                   (1, 7, 2500, True)])
def test_skinny_matches_linear(m: int, n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    from kernels.skinny_triton import skinny_linear_triton

    x, w, b = _problem(m, n, k, dtype, bias)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    out = skinny_linear_triton(x.to(DEV), w.to(DEV), None if b is None else b.to(DEV))
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close_rel(out, ref, TOLERANCES[dtype], f"m={m} n={n} k={k}")


@needs_kernels
@pytest.mark.parametrize("config", [(1, 1, 128, 1), (4, 4, 64, 4), (8, 2, 256, 8)])
def test_skinny_launch_shapes(config: tuple[int, int, int, int]) -> None:
    from kernels.skinny_triton import skinny_linear_triton

    x, w, b = _problem(9, 20, 300, torch.bfloat16, True, seed=1)
    ref = F.linear(x.float(), w.float(), b.float())
    assert_close_rel(skinny_linear_triton(x.to(DEV), w.to(DEV), b.to(DEV), config), ref,
                     TOLERANCES[torch.bfloat16], f"config {config}")


@needs_kernels
def test_skinny_refuses_what_it_does_not_take() -> None:
    from kernels.skinny_triton import MAX_FEATURES, MAX_ROWS, skinny_linear_triton

    x, w, _ = _problem(2, 8, 64, torch.bfloat16, False)
    x, w = x.to(DEV), w.to(DEV)
    with pytest.raises(ValueError, match="share K"):
        skinny_linear_triton(x, w[:, 1:])
    with pytest.raises(ValueError, match="float32"):
        skinny_linear_triton(x, w.float())
    with pytest.raises(ValueError, match="contiguous"):
        skinny_linear_triton(x.t().contiguous().t(), w)
    with pytest.raises(ValueError, match="contiguous"):
        skinny_linear_triton(x, w, w.new_zeros(16)[::2])
    with pytest.raises(ValueError, match="exceed"):
        skinny_linear_triton(x.new_zeros(MAX_ROWS + 1, 64), w)
    with pytest.raises(ValueError, match="exceed"):
        skinny_linear_triton(x, w.new_zeros(MAX_FEATURES + 1, 64))


def test_kernels_under_interpreter() -> None:
    pytest_under_interpreter(__file__, "not interpreter")


def test_only_16bit_layers_take_the_skinny_method() -> None:
    from engine.layers.linear import MergedColumnParallelLinear
    from engine.layers.quant import Int4LinearMethod, SkinnyLinearMethod, UnquantizedLinearMethod, with_skinny

    int4 = Int4LinearMethod(128, 1, "reference")
    assert type(with_skinny(UnquantizedLinearMethod(), True)) is SkinnyLinearMethod
    assert type(with_skinny(UnquantizedLinearMethod(), False)) is UnquantizedLinearMethod
    assert with_skinny(int4, True) is int4
    # Where the kernel does not take the rows (too many here; on the CPU outside the interpreter, any), F.linear.
    layer = MergedColumnParallelLinear(64, [5, 5], False, SkinnyLinearMethod(), torch.float32, "ba")
    layer.weight.data.copy_(torch.randn(10, 64))
    x = torch.randn(70, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=0, atol=0)
