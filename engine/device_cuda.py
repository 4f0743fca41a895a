"""CUDA driver calls for the kernels compiled at run time (kernels.int4_cuda), behind engine.device.

    kernels = load(binary, names, index)                        # once per process and device
    kernels[name](grid, block, args, dependent=pdl_enabled(i))  # on the current stream, graph-capturable

`dependent=True` launches with programmatic stream serialization (PDL, sm_90+): the kernel's blocks may start as
soon as the previous kernel's blocks have exited, before that kernel's end is made visible, and the kernel itself
waits (`griddepcontrol.wait`) before it reads anything the previous kernel wrote. Why: a decode step at batch 1 is
~300 short kernels, and an int4 GEMM's weights are constants, so it can prefetch them during that gap instead of
after it. Inside a CUDA graph capture the launch becomes a programmatic edge. XPULORA_PDL=0 turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID in cuda.h


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(msg))
        raise RuntimeError(f"CUDA driver {what}: {(msg.value or b'error %d' % result).decode()}")


@functools.cache
def pdl_enabled(index: int) -> int:
    """Dependent launches on device `index`: sm_90+ (griddepcontrol), unless XPULORA_PDL=0."""
    return int(os.environ.get("XPULORA_PDL", "1")) if torch.cuda.get_device_capability(index) >= (9, 0) else 0


class CudaKernel:
    """One kernel of a loaded module; args are tensors (passed as their data pointers) and ints (as C int)."""

    def __init__(self, func: ctypes.c_void_p, module: ctypes.c_void_p, name: str) -> None:
        self.func, self.module, self.name = func, module, name

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: list[torch.Tensor | int],
                 dependent: bool = False) -> None:
        held: list[ctypes.c_void_p | ctypes.c_int] = []
        for a in args:
            if isinstance(a, torch.Tensor):
                if not a.is_cuda:
                    raise ValueError(f"{self.name}: tensor arguments must be on the GPU, got {a.device}")
                held.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, int):
                held.append(ctypes.c_int(a))
            else:
                raise TypeError(f"{self.name}: arguments are tensors and ints, got {type(a).__name__}")
        params = (ctypes.c_void_p * len(held))(*(ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in held))
        attr = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        config = _Config(*grid, *block, 0, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                         ctypes.pointer(attr), 1 if dependent else 0)
        _check(_driver().cuLaunchKernelEx(ctypes.byref(config), self.func, params, None), f"launch of {self.name}")


def load(binary: bytes, names: list[str], index: int) -> dict[str, CudaKernel]:
    """The named kernels of a compiled module (cubin bytes) on device `index`."""
    lib = _driver()
    with torch.cuda.device(index), torch.cuda.stream(torch.cuda.current_stream(index)):
        module = ctypes.c_void_p()
        _check(lib.cuModuleLoadData(ctypes.byref(module), binary), "module load")
        out = {}
        for name in names:
            func = ctypes.c_void_p()
            _check(lib.cuModuleGetFunction(ctypes.byref(func), module, name.encode()), f"lookup of {name}")
            out[name] = CudaKernel(func, module, name)
    return out
