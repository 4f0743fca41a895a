"""Triton where it is installed: the one guarded import every kernel module uses, and what their
bindings ask of the environment. Importing this works without triton (XPU boxes without triton-xpu, CI)."""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

__all__ = ["FLOATS", "interpreting", "tl", "triton", "usable"]

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
"""Activation dtypes the Triton kernels take."""


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors. It multiplies bf16
    bit patterns in tl.dot (triton-lang/triton#11584), so kernels dot in fp32 there: exact for 16-bit
    inputs, which keeps the interpreter tests meaningful."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def usable_on(device_type: str) -> bool:
    """Triton kernels can run on tensors of this device type: compiled ones need a GPU's tensors, so CPU
    tensors run only under the interpreter, even on a machine with a GPU."""
    return usable() and (device_type != "cpu" or interpreting())


def usable() -> bool:
    """Triton kernels can run here: on the interpreter, or with a GPU driver triton can target."""
    if triton is None:
        return False
    if interpreting():
        return True
    try:
        triton.runtime.driver.active.get_current_target()
    except Exception:  # no GPU driver: triton raises various errors here
        return False
    return True
