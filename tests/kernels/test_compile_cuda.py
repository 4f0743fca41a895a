"""Every Triton kernel of the project compiles for NVIDIA sm_90 (H100 / H200) and sm_80 (A100) through its real
launcher, on this CPU-only machine (tools/triton_compile.py: triton's compiler and its wheel's ptxas, nothing
launched). It catches what the interpreter tests cannot before any device time: types, constexpr misuse, what the
compiler or ptxas refuses. Results are checked elsewhere (the interpreter tests, the GPU checks)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import kernels
from tools.triton_compile import compile_only, ptxas_available, run_all, usage


def _project_kernels() -> set[str]:
    """Every @triton.jit function named *_kernel in kernels/ (helpers inlined into kernels have other names)."""
    from triton.runtime.jit import JITFunction

    names: set[str] = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        names |= {n for n, v in vars(module).items() if isinstance(v, JITFunction) and n.endswith("_kernel")}
    return names


@pytest.mark.skipif(not ptxas_available(), reason="needs triton with its NVIDIA backend, outside the interpreter")
@pytest.mark.parametrize("arch", [90, 80])
def test_every_triton_kernel_compiles(arch: int) -> None:
    with compile_only(arch) as done:
        run_all()
    assert not done.errors, done.errors
    want = _project_kernels()
    assert len(want) >= 14, f"found only {sorted(want)}"
    assert done.names() == want, f"not launched by run_all: {sorted(want - done.names())}"
    shrink = next(kernel for name, kernel in done.kernels if name == "_lora_shrink_kernel")
    res = usage(shrink)  # read from the cubin: what bounds the kernel's programs per SM
    assert 0 < res["registers"] <= 255 and res["warps"] == 4 and res["dynamic_shared"] > 0, res


@pytest.mark.skipif(not ptxas_available(), reason="needs triton with its NVIDIA backend, outside the interpreter")
def test_a_kernel_that_cannot_compile_is_reported() -> None:
    """The check can fail: a kernel whose body mixes a pointer with a float does not compile, and is named."""
    import torch
    from triton.compiler.errors import CompilationError

    from kernels.triton_env import tl, triton

    @triton.jit
    def _broken_kernel(x_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + 0.5 * offs))

    x = torch.zeros(16)
    with compile_only(90) as done, pytest.raises(CompilationError):
        _broken_kernel[(1,)](x, BLOCK=16)
    assert [name for name, _ in done.errors] == ["_broken_kernel"]
