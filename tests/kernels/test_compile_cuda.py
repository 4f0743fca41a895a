"""Every Triton kernel of the project compiles for NVIDIA sm_90 (H100 / H200) and sm_80 (A100) through its real
launcher, on this CPU-only machine (tools/triton_compile.py: triton's compiler and its wheel's ptxas, nothing
launched), and so does the CUDA C of the cuda_mma int4 kernel (tools/cuda_compile.py: NVRTC from its PyPI wheel,
then the same ptxas). It catches what the interpreter tests cannot before any device time: types, constexpr misuse, what the
compiler or ptxas refuses. Results are checked elsewhere (the interpreter tests, the GPU checks)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import kernels
from tools import cuda_compile
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


@pytest.mark.skipif(not ptxas_available(), reason="needs triton with its NVIDIA backend, outside the interpreter")
def test_each_block_compiles_for_its_own_target() -> None:
    """A kernel compiled for sm_80 in one block is not reused in the next block's sm_90, and the process keeps its
    own caches: on a GPU machine the sm_80 cubins once stayed in triton's per-device cache, and every later launch
    of those kernels on the H200 failed with "no kernel image is available" (twenty-fifth session's check)."""
    import torch

    from kernels.triton_env import tl, triton

    @triton.jit
    def _copy_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs))

    x = torch.zeros(16)
    before = _copy_kernel.device_caches
    for arch in (80, 90):
        with compile_only(arch) as done:
            _copy_kernel[(1,)](x, x, BLOCK=16)
        (_, kernel), = done.kernels
        assert kernel.metadata.target.arch == arch
    assert _copy_kernel.device_caches is before and not before


@pytest.mark.skipif(not cuda_compile.available(), reason="needs nvidia-cuda-nvrtc-cu12 and triton's NVIDIA backend")
@pytest.mark.parametrize("arch", [90, 80])
def test_every_cuda_c_kernel_compiles(arch: int) -> None:
    """Every cuda_mma launch shape, with the engine's NVRTC options; ptxas reports its resources."""
    from kernels import int4_cuda

    got = cuda_compile.compile_int4(arch)
    assert set(got) == set(int4_cuda._names()) and len(got) >= 30, sorted(set(int4_cuda._names()) ^ set(got))
    assert all(0 < r.registers <= 255 for r in got.values())
    # the (4, 1, 4) shape at 32 rows and the (8, 1, 2) LoRA variant sit at the register budget (4 bytes spilled);
    # a change that spills more elsewhere costs local-memory traffic in the GEMM's inner loop
    spilled = {name: r.spill_stores for name, r in got.items() if r.spill_stores > 16}
    assert not spilled, spilled


@pytest.mark.skipif(not cuda_compile.available(), reason="needs nvidia-cuda-nvrtc-cu12 and triton's NVIDIA backend")
def test_a_cuda_c_error_is_reported() -> None:
    """The check can fail: NVRTC's log names what it refuses, and ptxas's error comes back too."""
    from kernels.int4_cuda_src import SOURCE

    broken = SOURCE + 'extern "C" __global__ void broken(float* y) { y[0] = not_declared(1); }\n'
    with pytest.raises(cuda_compile.CudaCompileError, match="not_declared"):
        cuda_compile.to_ptx(broken, 90)
    with pytest.raises(cuda_compile.CudaCompileError):
        cuda_compile.assemble(".version 8.0\n.target sm_90\n.address_size 64\n.entry k() { bogus; }\n", 90)
