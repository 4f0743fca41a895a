"""Where the Triton kernel tests can run in this process: on an accelerator, or on the CPU when the
process was started with TRITON_INTERPRET=1 (the test files re-run themselves that way)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _kernel_device() -> torch.device | None:
    if not HAS_TRITON:
        return None
    if INTERPRETING:
        return torch.device("cpu")
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.current_accelerator()
    return None


DEV = _kernel_device()
needs_kernels = pytest.mark.skipif(
    DEV is None, reason="no triton, or no accelerator (the CPU runs these under the interpreter, see "
    "test_kernels_under_interpreter)")


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, tol: tuple[float, float], what: str = "") -> None:
    """out == ref within rtol = tol[0] and an atol of tol[1] times ref's largest magnitude (compared on the CPU
    in float32)."""
    ref32 = ref.detach().cpu().float()
    atol = tol[1] * max(ref32.abs().max().item(), 1e-6)
    torch.testing.assert_close(out.detach().cpu().float(), ref32, rtol=tol[0], atol=atol, msg=lambda m: f"{what}: {m}")
