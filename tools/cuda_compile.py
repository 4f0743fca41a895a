"""Compile the project's CUDA C (kernels.int4_cuda, backend cuda_mma) for an NVIDIA GPU on a machine without one.

NVRTC from PyPI's `nvidia-cuda-nvrtc-cu12` wheel (loaded with ctypes: torch's CPU build has none) turns the module's
source into PTX for compute_<arch> with the engine's options (engine.device.CUDA_COMPILE_OPTIONS), and the triton
wheel's ptxas assembles it for sm_<arch>, reporting each kernel's registers, spills and shared memory. On a GPU the
engine compiles the same source with torch's NVRTC, so what fails here would fail there, before any device time.
Used by tests/kernels/test_compile_cuda.py; `python -m tools.cuda_compile` prints the table for sm_90 and sm_80.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from engine.device import CUDA_COMPILE_OPTIONS
from tools.triton_compile import nvidia_tool, ptxas_available


class CudaCompileError(RuntimeError):
    """NVRTC or ptxas refused the source; the message is the compiler's log."""


@dataclass(frozen=True)
class Resources:
    """What ptxas -v reports for one kernel: registers per thread, local memory stores and loads of spilled
    registers, stack frame, and static shared memory per block (bytes)."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int


@functools.cache
def _nvrtc() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    for folder in spec.submodule_search_locations or [] if spec else []:
        path = os.path.join(folder, "lib", "libnvrtc.so.12")
        if os.path.exists(path):
            return ctypes.CDLL(path)
    return None


def available() -> bool:
    """NVRTC (the wheel) and ptxas (triton's) are both installed."""
    try:
        return _nvrtc() is not None and ptxas_available()
    except (ImportError, OSError):
        return False


def to_ptx(source: str, arch: int) -> str:
    """source -> PTX for compute_<arch> (NVRTC), or CudaCompileError with NVRTC's log."""
    lib = _nvrtc()
    if lib is None:
        raise CudaCompileError("NVRTC is not installed (pip install nvidia-cuda-nvrtc-cu12)")
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"xpulora.cu", 0, None, None):
        raise CudaCompileError("nvrtcCreateProgram failed")
    try:
        opts = [o.encode() for o in (*CUDA_COMPILE_OPTIONS, f"--gpu-architecture=compute_{arch}")]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc:
            raise CudaCompileError(log.value.decode(errors="replace"))
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def assemble(ptx: str, arch: int) -> dict[str, Resources]:
    """PTX -> sm_<arch> (the triton wheel's ptxas -v): each entry's resources, or CudaCompileError."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([nvidia_tool("ptxas"), f"-arch=sm_{arch}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    if out.returncode:
        raise CudaCompileError(out.stderr or out.stdout)
    found: dict[str, Resources] = {}
    name, spill = "", (0, 0, 0)
    for line in (out.stdout + out.stderr).splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = m.group(1)
        elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spill = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            smem = re.search(r"(\d+) bytes smem", line)
            found[name] = Resources(int(m.group(1)), spill[1], spill[2], spill[0], int(smem.group(1)) if smem else 0)
            name, spill = "", (0, 0, 0)
    return found


def compile_int4(arch: int) -> dict[str, Resources]:
    """Every cuda_mma launch shape compiled for sm_<arch>, as the engine compiles them."""
    from kernels import int4_cuda

    return assemble(to_ptx(int4_cuda._source(), arch), arch)


def main() -> int:
    if not available():
        print("needs nvidia-cuda-nvrtc-cu12 and triton with its NVIDIA backend", file=sys.stderr)
        return 1
    for arch in (90, 80):
        print(f"sm_{arch}: kernel, registers, spill stores / loads, stack, shared memory (bytes)")
        for name, r in compile_int4(arch).items():
            print(f"  {name:34s} {r.registers:4d} {r.spill_stores:4d} / {r.spill_loads:<4d} {r.stack:4d} {r.shared:6d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
