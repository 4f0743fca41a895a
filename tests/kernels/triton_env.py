"""Where the Triton kernel tests can run in this process: on an accelerator, or on the CPU when the
process was started with TRITON_INTERPRET=1 (the test files re-run themselves that way)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

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


def pytest_under_interpreter(path: str, select: str = "not interpreter") -> None:
    """Run the cases of the test file `path` that `select` (pytest -k) picks in a child pytest under
    TRITON_INTERPRET=1 (it must be set before triton is imported). All must pass and none may skip: a child without
    a kernel device would skip them all. Skips where triton is missing or the kernels run in this process already."""
    if not HAS_TRITON or DEV is not None:
        pytest.skip("needs triton; elsewhere the kernels run in this process already")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path, "-k", select],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout and " skipped" not in proc.stdout, \
        proc.stdout[-3000:]
